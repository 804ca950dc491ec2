"""build_tools.layout finds what to link, ship and dlopen in an install on Linux, macOS and Windows.

Each install is made of real libraries cross-compiled for that system (tests/sys/cross_libraries),
laid out as CMake installs llama.cpp there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cross_libraries import installed_library

from build_tools import bindings, layout
from build_tools.layout import LINUX, MACOS, WINDOWS, System

LIBRARIES = ["ggml", "ggml-base", "llama", "mtmd"]
SHIPPED_NAMES = {
    LINUX: ["libggml-base.so.0", "libggml.so.0", "libllama.so.0", "libmtmd.so.0"],
    MACOS: ["libggml-base.0.dylib", "libggml.0.dylib", "libllama.0.dylib", "libmtmd.0.dylib"],
    WINDOWS: ["ggml-base.dll", "ggml.dll", "llama.dll", "mtmd.dll"],
}
MODULES = {
    LINUX: ["libggml-cpu-haswell.so", "libggml-cuda.so"],
    MACOS: ["libggml-cpu-apple_m1.so", "libggml-metal.so"],
    WINDOWS: ["ggml-cpu-haswell.dll", "ggml-cuda.dll"],
}


def install(prefix: Path, system: System) -> list[Path]:
    links = [installed_library(prefix, name, system) for name in LIBRARIES]
    installed_library(prefix, "z", system)  # something else sharing the directories
    (prefix / "bin").mkdir(exist_ok=True)
    for module in MODULES[system]:
        (prefix / "bin" / module).write_bytes(b"")  # dlopen-only: never read at build time
    return links


@pytest.mark.parametrize("system", [LINUX, MACOS, WINDOWS], ids=lambda s: s.name)
def test_each_system_links_its_link_files_and_ships_what_they_load(
    tmp_path: Path, system: System
) -> None:
    links = install(tmp_path, system)
    found = layout.libraries(tmp_path / "lib", system)
    assert [library.link for library in found] == sorted(links)
    assert sorted(library.name for library in found) == SHIPPED_NAMES[system]
    for library in found:  # the file itself, which is shipped under the name it is loaded by
        assert library.runtime.is_file() and not library.runtime.is_symlink()
    modules = layout.backend_modules(tmp_path, found, system)
    assert [path.name for path in modules] == MODULES[system]


def test_a_windows_import_library_without_its_dll_is_refused_by_name(tmp_path: Path) -> None:
    installed_library(tmp_path, "llama", WINDOWS)
    (tmp_path / "bin" / "llama.dll").unlink()
    with pytest.raises(SystemExit, match=r"llama\.lib links llama\.dll, not found in bin/"):
        layout.libraries(tmp_path / "lib", WINDOWS)


def test_the_cmake_lists_keep_every_path_and_rpath_verbatim(tmp_path: Path) -> None:
    installed_library(tmp_path / "plain", "llama", LINUX)
    odd = (tmp_path / "plain").rename(tmp_path / "dir with spaces; $HOME ${X} \\ [=[ end")
    found = layout.libraries(odd / "lib", LINUX)
    text = bindings._libraries_cmake({"source_origin": "pinned"}, found, [])
    assert f"[==[{(odd / 'lib' / 'libllama.so').as_posix()}]==]" in text
    assert f"[==[{layout.current().module_rpath}]==]" in text
