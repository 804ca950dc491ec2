"""Where a llama.cpp install keeps its libraries on each system, and how the module finds them.

Linux and macOS: the module links the unversioned names in lib/ (symlinks); the files they resolve
to are shipped into llamacrab_sys/lib under the names the loader looks for (SONAME, install name)
and found through an rpath relative to the module. Windows: the module links the import libraries
in lib/; the DLLs they name, in bin/, are shipped and found through os.add_dll_directory.
Dlopen-only backend modules (GGML_BACKEND_DL) sit in bin/ and are shipped beside the libraries.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from build_tools import binaries

# The libraries a llama.cpp install is made of, by name without the "lib" prefix (upstream's
# names, or our renamed ones), leaving out whatever else shares its directories.
_LLAMA_NAMES = ("llama", "ggml", "mtmd", "llamacrab-")


@dataclass(frozen=True)
class Library:
    link: Path  # what the linker is given
    runtime: Path  # the file loaded at run time
    name: str  # the name the loader looks for, which the file is shipped under


@dataclass(frozen=True)
class System:
    name: str
    link_suffixes: tuple[str, ...]  # of the files the module links
    module_pattern: str  # dlopen-only backend modules in bin/, as ggml's loader names them
    module_rpath: str  # how the module finds llamacrab_sys/lib ("": it cannot, by rpath)
    library_rpath: str  # how the libraries find each other there


LINUX = System("linux", (".so",), "libggml-*.so", "$ORIGIN/lib", "$ORIGIN")
# CMake gives MODULE libraries the .so suffix on macOS too, which is what ggml's loader expects.
MACOS = System("macos", (".dylib",), "libggml-*.so", "@loader_path/lib", "@loader_path")
# MSVC names import libraries .lib, MinGW's linkers .dll.a.
WINDOWS = System("windows", (".lib", ".dll.a"), "ggml-*.dll", "", "")


def current() -> System:
    if sys.platform == "win32":
        return WINDOWS
    return MACOS if sys.platform == "darwin" else LINUX


def _is_llama(file_name: str) -> bool:
    return file_name.removeprefix("lib").startswith(_LLAMA_NAMES)


def _link_files(lib_dir: Path, system: System) -> list[Path]:
    """Unversioned link files (libllama.so, not libllama.so.0 or libllama.0.dylib)."""
    found = [
        path
        for suffix in system.link_suffixes
        for path in lib_dir.glob("*" + suffix)
        if "." not in path.name.removesuffix(suffix) and (path.is_file() or path.is_symlink())
    ]
    return sorted(path for path in found if _is_llama(path.name))


def libraries(lib_dir: Path, system: System | None = None) -> list[Library]:
    """The llama.cpp libraries of an install whose link files are in ``lib_dir``."""
    system = system or current()
    found = []
    for link in _link_files(lib_dir, system):
        if system is WINDOWS:
            runtime = lib_dir.parent / "bin" / binaries.import_library_target(link)
            if not runtime.is_file():
                raise SystemExit(f"llamacrab: {link} links {runtime.name}, not found in bin/")
            found.append(Library(link, runtime, runtime.name))
        else:
            runtime = link.resolve()
            found.append(Library(link, runtime, binaries.load_name(runtime)))
    return found


def backend_modules(
    prefix: Path, linked: list[Library], system: System | None = None
) -> list[Path]:
    """Dlopen-only backends, in bin/ (beside the linked DLLs on Windows, which are not ones)."""
    system = system or current()
    linked_files = {library.runtime for library in linked}
    return sorted(
        path
        for path in (prefix / "bin").glob(system.module_pattern)
        if path.is_file() and path.resolve() not in linked_files
    )
