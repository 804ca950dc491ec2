"""The generated declarations cover the headers and match the pinned source they came from."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from build_tools import bindings
from build_tools.source import resolve_source
from llamacrab_sys import build_info, ffi, lib


@pytest.fixture(scope="module")
def source_tree() -> Path:
    return resolve_source().path


def declared_functions(header: Path, api_macro: str) -> set[str]:
    """Names of the C functions a header exports with its API macro, read from the raw text."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", "", header.read_text(), flags=re.S)
    # C++-only declarations (std::map returns and the like) are not part of the C API.
    text = re.sub(r"#ifdef __cplusplus.*?#endif", "", text, flags=re.S)
    names = set()
    pattern = rf"(?m)^(?!\s*#).*?\b{api_macro}\b\s*(?:DEPRECATED\()?([^(;]*)\("
    for match in re.finditer(pattern, text):
        names.add(re.findall(r"\w+", match.group(1))[-1])
    return names


@pytest.mark.parametrize(
    ("header", "macro", "at_least"),
    [("include/llama.h", "LLAMA_API", 200), ("tools/mtmd/mtmd.h", "MTMD_API", 40)],
)
def test_every_api_function_of_the_header_is_reachable(
    source_tree: Path, header: str, macro: str, at_least: int
) -> None:
    names = declared_functions(source_tree / header, macro)
    assert len(names) >= at_least  # the scan itself found the header's API
    missing = sorted(n for n in names if not hasattr(lib, n))
    assert missing == []
    print(f"{header}: {len(names)} {macro} functions, all reachable")


@pytest.mark.skipif(not build_info().rpc, reason="built without the RPC backend")
def test_every_rpc_function_is_reachable_through_a_shim(source_tree: Path) -> None:
    names = declared_functions(source_tree / "ggml/include/ggml-rpc.h", "GGML_BACKEND_API")
    assert "ggml_backend_rpc_add_server" in names and "ggml_backend_rpc_start_server" in names
    assert sorted(n for n in names if not hasattr(lib, f"safe_{n}")) == []
    assert (lib.RPC_PROTO_MAJOR_VERSION, lib.GGML_RPC_MAX_SERVERS) >= (7, 16)


def test_functions_of_cpp_headers_have_shims(source_tree: Path) -> None:
    for header, macro in [("include/llama.h", "LLAMA_API"), ("tools/mtmd/mtmd.h", "MTMD_API")]:
        names = declared_functions(source_tree / header, macro)
        assert sorted(n for n in names if not hasattr(lib, f"safe_{n}")) == []


def test_struct_layouts_come_from_the_compiler() -> None:
    # API mode: sizes and offsets are what the C compiler computed for the real headers.
    assert ffi.sizeof("struct llama_batch") == ffi.sizeof("int32_t") * 2 + ffi.sizeof("void *") * 6
    assert ffi.offsetof("struct llama_batch", "token") == ffi.sizeof("void *")
    assert lib.GGML_TYPE_COUNT > lib.GGML_TYPE_Q4_K > 0


def test_generated_declarations_are_not_stale(source_tree: Path) -> None:
    """Regenerate from the pinned headers: the compiled module must have been built from them."""
    include_dirs = [
        source_tree / "include",
        source_tree / "ggml/include",
        source_tree / "tools/mtmd",
    ]
    *_, cdef = bindings.render(include_dirs, list(build_info().libraries))
    assert hashlib.sha256(cdef.encode()).hexdigest() == build_info().cdef_sha256, (
        "llamacrab_sys was built from other headers or another generator: reinstall llamacrab-sys"
    )


def test_declarations_do_not_depend_on_the_locale(source_tree: Path, tmp_path: Path) -> None:
    """llama.h's comments hold UTF-8: the headers were read in the locale's encoding, which
    failed under Windows' East Asian code pages (cp932). An ASCII locale (Python's UTF-8 mode
    and locale coercion off) fails the same way; the generator reads UTF-8 whatever it is."""
    script = (
        "import hashlib, sys; from pathlib import Path; from build_tools import bindings; "
        "dirs = [Path(sys.argv[1], d) for d in ('include', 'ggml/include', 'tools/mtmd')]; "
        "*_, cdef = bindings.render(dirs, [Path(p) for p in sys.argv[2:]]); "
        "print(hashlib.sha256(cdef.encode()).hexdigest())"
    )
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    run = subprocess.run(
        [sys.executable, "-c", script, str(source_tree), *build_info().libraries],
        capture_output=True, text=True, env=env, cwd=Path(bindings.__file__).parents[1],
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == build_info().cdef_sha256


@pytest.mark.parametrize("target", ["x86_64-windows-gnu", "aarch64-macos", "x86_64-linux-gnu"])
def test_the_generated_shims_compile_for_every_system(
    source_tree: Path, tmp_path: Path, target: str
) -> None:
    """The shims are C++ for Linux, macOS and Windows alike (POSIX signals only where they exist,
    bool rather than C's _Bool, no stray bytes): zig's clang compiles them against each system's
    headers, warnings as errors."""
    include_dirs = [source_tree / d for d in ("include", "ggml/include", "tools/mtmd")]
    _, header, source, _ = bindings.render(include_dirs, list(build_info().libraries))
    (tmp_path / "llamacrab_shims.h").write_text(header)
    (tmp_path / "llamacrab_shims.cpp").write_text(source)
    compiled = subprocess.run(
        [sys.executable, "-m", "ziglang", "c++", "-target", target, "-std=c++17", "-Werror",
         "-c", "-o", str(tmp_path / "shims.o"), f"-I{tmp_path}",
         *(f"-I{d}" for d in include_dirs), str(tmp_path / "llamacrab_shims.cpp")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert compiled.returncode == 0, compiled.stderr
