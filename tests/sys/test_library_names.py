"""Our libraries get names of their own on every system, ggml's included (build_tools/native.py).

ggml empties CMAKE_SHARED_LIBRARY_PREFIX after its project() on Windows, which the prefix set by
CMAKE_PROJECT_INCLUDE cannot outlive; there the prefix is set on every SHARED target once the tree
is configured. A tiny project that does what ggml does is configured with each system's
names.cmake, and the names CMake would build are read from its Ninja file.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from build_tools import layout, native

TOP = """\
cmake_minimum_required(VERSION 3.21)
project(top C)
add_subdirectory(ggml_like)
add_library(llama SHARED llama.c)
"""
GGML_LIKE = """\
project(ggml_like C)
set(CMAKE_SHARED_LIBRARY_PREFIX "")  # what ggml/CMakeLists.txt does on WIN32
set(CMAKE_SHARED_MODULE_PREFIX "")
add_library(ggml-base SHARED base.c)
add_library(ggml-cpu-haswell MODULE cpu.c)  # a dlopen-only backend: keeps the name ggml loads
"""


def built_names(tmp_path: Path, system: layout.System) -> set[str]:
    source = tmp_path / "src"
    (source / "ggml_like").mkdir(parents=True)
    (source / "CMakeLists.txt").write_text(TOP)
    (source / "ggml_like" / "CMakeLists.txt").write_text(GGML_LIKE)
    for name in ("llama.c", "ggml_like/base.c", "ggml_like/cpu.c"):
        (source / name).write_text("int probe(void) { return 0; }\n")
    names = tmp_path / "names.cmake"
    names.write_text(native.names_cmake(system))
    subprocess.run(
        ["cmake", "-S", str(source), "-B", str(tmp_path / "build"), "-G", "Ninja",
         f"-DCMAKE_PROJECT_INCLUDE={names}"],
        check=True, capture_output=True,
    )  # fmt: skip
    ninja = (tmp_path / "build" / "build.ninja").read_text()
    return set(re.findall(r"^build ([\w.-]+\.so)\b", ninja, re.MULTILINE))


def test_windows_names_outlive_a_project_that_empties_the_prefix(tmp_path: Path) -> None:
    assert built_names(tmp_path, layout.WINDOWS) == {
        "libllamacrab-llama.so",
        "libllamacrab-ggml-base.so",
        "ggml-cpu-haswell.so",
    }


def test_without_it_such_a_project_keeps_its_own_names(tmp_path: Path) -> None:
    # Why the Windows part exists: the project include alone loses to ggml's reset.
    assert "ggml-base.so" in built_names(tmp_path, layout.LINUX)
