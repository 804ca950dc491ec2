"""The installed llamacrab_sys: build info, shipped libraries, and the command-line report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import llamacrab_sys
from build_tools.source import read_pin
from llamacrab_sys import build_info

SYS_DIR = Path(__file__).resolve().parents[2] / "llamacrab-sys"


def test_build_records_the_pinned_commit_and_backend() -> None:
    info = build_info()
    assert info.llama_cpp_commit == read_pin()["llama_cpp_commit"]
    assert info.backend == "cpu"
    assert info.package_version == llamacrab_sys.__version__
    assert "-DBUILD_SHARED_LIBS=ON" in info.cmake_options


def test_libraries_ship_inside_the_package_and_are_the_ones_loaded() -> None:
    info = build_info()
    names = {p.name for p in info.libraries}
    # Names and SONAMEs of our own: another package's libllama.so.0 in the same process is
    # never taken for ours (tests/test_ffi_traps.py, duplicate symbols).
    expected = {"libllama.so.0", "libggml.so.0", "libggml-base.so.0", "libmtmd.so.0"}
    assert {"libllamacrab-" + name.removeprefix("lib") for name in expected} <= names
    assert all(name.startswith("libllamacrab-") for name in names), names
    for path in info.libraries:
        assert path.is_file() and path.parent == info.library_dir
    with open("/proc/self/maps") as maps:
        mapped = maps.read()
    assert str(info.library_dir / "libllamacrab-llama.so.0") in mapped


def test_system_info_comes_from_llama_cpp() -> None:
    assert "CPU" in build_info().system_info


def test_python_m_llamacrab_sys_prints_build_info_as_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "llamacrab_sys", "--json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    report = json.loads(out)
    assert report["llama_cpp_commit"] == build_info().llama_cpp_commit
    assert report["system_info"] == build_info().system_info
    assert report["library_dir"] == str(build_info().library_dir)
    # The shipped build: the pinned commit, every feature.
    assert (report["llama_cpp_prefix"], report["commit_source"]) == (None, "pin")
    assert report["unavailable_features"] == []
    assert report["missing_backends"] == build_info().missing_backends


def test_only_known_functions_were_left_out() -> None:
    # Variadic functions cannot be bound; one declared function is exported by no library;
    # ggml-rpc.h's functions exist only in a build with the RPC backend.
    skipped = dict(build_info().skipped_functions)
    rpc_functions = {k for k in skipped if k.startswith("ggml_backend_rpc") or "is_rpc" in k}
    assert not (build_info().rpc and rpc_functions)
    for name in rpc_functions:
        assert skipped.pop(name) == "not exported by the built libraries"
    assert skipped == {
        "ggml_abort": "variadic",
        "ggml_format_name": "variadic",
        "ggml_threadpool_get_n_threads": "not exported by the built libraries",
    }


def test_the_rpc_backend_is_built_by_default_and_recorded() -> None:
    pyproject = (SYS_DIR / "pyproject.toml").read_text()  # (no tomllib on Python 3.10)
    assert 'LLAMACRAB_RPC = { env = "LLAMACRAB_RPC", default = "ON" }' in pyproject
    info = build_info()
    assert info.rpc == ("-DGGML_RPC=ON" in info.cmake_options)
    assert info.rpc == any("ggml-rpc" in p.name for p in info.libraries)


WINDOWS_IMPORT = """
import os, sys
added = []
def add_dll_directory(path):
    added.append((path, "llamacrab_sys._native" in sys.modules))
    return object()
os.add_dll_directory = add_dll_directory
sys.platform = "win32"  # what the package reads to know it runs on Windows
import llamacrab_sys
print(added)
print(llamacrab_sys.build_info().library_dir)
"""


def test_on_windows_the_library_directory_is_added_before_the_module_loads() -> None:
    # Windows has no rpath: without os.add_dll_directory, loading _native finds no llama.dll.
    out = subprocess.run(
        [sys.executable, "-c", WINDOWS_IMPORT], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == repr([(out[1], False)])  # added, and before _native was imported
    assert Path(out[1]).is_dir()
