"""Bring your own llama.cpp: describe an existing install instead of building the pinned source.

Usage: python -m build_tools.prefix --prefix DIR [--commit SHA] --json OUT

DIR is what `cmake --install` of a shared-library llama.cpp build produced (include/llama.h,
lib/libllama.so, lib/libggml*.so, or their macOS and Windows forms: build_tools/layout.py;
libmtmd and ggml-rpc optional), for instance with a GPU backend llamacrab-sys does not ship.
The output has the shape build_tools.native gives, so the bindings are generated from DIR's
headers. Its libraries are used where they are, under their own names: the wheel is tied to DIR,
and another llama.cpp build loaded into the same process (llama-cpp-python, ...) may bind to
them, which the renamed libllamacrab-* libraries of a normal build prevent.

The commit comes from --commit (LLAMACRAB_LLAMA_CPP_COMMIT), else from the install's CMake package
(lib/cmake/llama/llama-config.cmake records LLAMA_BUILD_COMMIT for a build from a git checkout).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from build_tools import layout

PREFIX_ENV = "LLAMACRAB_LLAMA_CPP_PREFIX"
COMMIT_ENV = "LLAMACRAB_LLAMA_CPP_COMMIT"
# ggml's backend library name -> our backend name; the first one found wins.
_BACKEND_LIBS = {"cuda": "cuda", "hip": "hip", "vulkan": "vulkan", "metal": "metal",
                 "opencl": "opencl", "blas": "blas"}  # fmt: skip


class PrefixError(SystemExit):
    """The directory is not a usable llama.cpp install."""


def library_dir(prefix: Path, system: layout.System) -> Path:
    for name in ("lib", "lib64"):
        if any(library.name.removeprefix("lib").startswith("llama.") for library in
               layout.libraries(prefix / name, system)):  # fmt: skip
            return prefix / name
    raise PrefixError(
        f"llamacrab: {prefix} holds no lib/ with llama.cpp's libllama: {PREFIX_ENV} must name the "
        "directory `cmake --install` filled from a llama.cpp build with -DBUILD_SHARED_LIBS=ON"
    )


def installed_commit(lib_dir: Path) -> str | None:
    """LLAMA_BUILD_COMMIT from the install's CMake package, if it knows one."""
    config = lib_dir / "cmake" / "llama" / "llama-config.cmake"
    if not config.is_file():
        return None
    match = re.search(
        r"set\(LLAMA_BUILD_COMMIT\s+\"?([^\s\")]+)", config.read_text(encoding="utf-8")
    )
    commit = match.group(1) if match else ""
    return commit if commit and commit.lower() != "unknown" else None


def backend_of(libraries: list[Path], modules: list[Path]) -> str:
    names = {p.name.split(".")[0] for p in libraries + modules}
    for part, backend in _BACKEND_LIBS.items():
        if any(name.endswith("ggml-" + part) for name in names):
            return backend
    return "cpu"


def describe(prefix: Path, commit: str | None = None) -> dict:
    """What build_tools.bindings needs to bind the install at ``prefix``."""
    prefix = prefix.expanduser().resolve()
    if not (prefix / "include" / "llama.h").is_file():
        raise PrefixError(f"llamacrab: {prefix}/include/llama.h not found ({PREFIX_ENV})")
    system = layout.current()
    lib_dir = library_dir(prefix, system)
    linked = layout.libraries(lib_dir, system)
    libraries = [library.link for library in linked]
    modules = layout.backend_modules(prefix, linked, system)
    recorded = installed_commit(lib_dir)
    if commit:
        commit_source = "given"
    elif recorded:
        commit, commit_source = recorded, "install"
    else:
        raise PrefixError(
            f"llamacrab: the llama.cpp install at {prefix} does not record its commit (built "
            f"outside a git checkout); set {COMMIT_ENV} to the commit it was built from"
        )
    return {
        "key": f"prefix:{prefix}",
        "prefix": str(prefix),
        "include_dir": str(prefix / "include"),
        "lib_dir": str(lib_dir),
        "runtime_dir": str(linked[0].runtime.parent),  # bin/ on Windows
        "libraries": [str(p) for p in libraries],
        "module_dir": str(prefix / "bin"),
        "modules": [str(p) for p in modules],
        "commit": commit,
        "commit_source": commit_source,
        "source": str(prefix),
        "source_origin": "prefix",
        "backend": backend_of(libraries, modules),
        "portable": any("ggml-cpu" in p.name for p in modules),
        "rpc": any("ggml-rpc" in p.name for p in libraries + modules),
        "sanitize": "",
        "sanitizer_flags": "",
        "cmake_options": [],
        "compilers": {},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=Path, required=True)
    parser.add_argument("--commit", default="")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    info = describe(args.prefix, args.commit or None)
    args.json.write_text(json.dumps(info, indent=2), encoding="utf-8")
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
