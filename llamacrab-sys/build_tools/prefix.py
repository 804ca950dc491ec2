"""Bring your own llama.cpp: describe an existing install instead of building the pinned source.

Usage: python -m build_tools.prefix --prefix DIR [--commit SHA] --json OUT

DIR is what `cmake --install` of a shared-library llama.cpp build produced (include/llama.h,
lib/libllama.so, lib/libggml*.so; libmtmd and ggml-rpc optional), for instance with a GPU backend
llamacrab-sys does not ship. The output has the shape build_tools.native gives, so the bindings are
generated from DIR's headers. Its libraries are used where they are, under their own names: the
wheel is tied to DIR, and another llama.cpp build loaded into the same process (llama-cpp-python,
...) may bind to them, which the renamed libllamacrab-* libraries of a normal build prevent.

The commit comes from --commit (LLAMACRAB_LLAMA_CPP_COMMIT), else from the install's CMake package
(lib/cmake/llama/llama-config.cmake records LLAMA_BUILD_COMMIT for a build from a git checkout).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

PREFIX_ENV = "LLAMACRAB_LLAMA_CPP_PREFIX"
COMMIT_ENV = "LLAMACRAB_LLAMA_CPP_COMMIT"
# The library names a llama.cpp install is made of (upstream names, or our renamed ones).
_OURS = ("libllama", "libggml", "libmtmd", "libllamacrab-")
# ggml's backend library name -> our backend name; the first one found wins.
_BACKEND_LIBS = {"cuda": "cuda", "hip": "hip", "vulkan": "vulkan", "metal": "metal",
                 "opencl": "opencl", "blas": "blas"}  # fmt: skip


class PrefixError(SystemExit):
    """The directory is not a usable llama.cpp install."""


def library_dir(prefix: Path) -> Path:
    for name in ("lib", "lib64"):
        if (prefix / name / "libllama.so").exists():
            return prefix / name
    raise PrefixError(
        f"llamacrab: {prefix} holds no lib/libllama.so: {PREFIX_ENV} must name the directory "
        "`cmake --install` filled from a llama.cpp build with -DBUILD_SHARED_LIBS=ON"
    )


def llama_libraries(lib_dir: Path) -> list[Path]:
    """The install's llama.cpp libraries, leaving out whatever else shares the directory."""
    return sorted(p for p in lib_dir.glob("lib*.so") if p.name.startswith(_OURS))


def backend_modules(prefix: Path) -> list[Path]:
    """Backends built for GGML_BACKEND_DL (dlopen-only modules, installed to bin/ by upstream)."""
    return sorted(p for p in (prefix / "bin").glob("libggml-*.so") if p.is_file())


def installed_commit(lib_dir: Path) -> str | None:
    """LLAMA_BUILD_COMMIT from the install's CMake package, if it knows one."""
    config = lib_dir / "cmake" / "llama" / "llama-config.cmake"
    if not config.is_file():
        return None
    match = re.search(r"set\(LLAMA_BUILD_COMMIT\s+\"?([^\s\")]+)", config.read_text())
    commit = match.group(1) if match else ""
    return commit if commit and commit.lower() != "unknown" else None


def backend_of(libraries: list[Path], modules: list[Path]) -> str:
    names = {p.name.removesuffix(".so") for p in libraries + modules}
    for part, backend in _BACKEND_LIBS.items():
        if any(name.endswith("ggml-" + part) for name in names):
            return backend
    return "cpu"


def describe(prefix: Path, commit: str | None = None) -> dict:
    """What build_tools.bindings needs to bind the install at ``prefix``."""
    prefix = prefix.expanduser().resolve()
    if not (prefix / "include" / "llama.h").is_file():
        raise PrefixError(f"llamacrab: {prefix}/include/llama.h not found ({PREFIX_ENV})")
    lib_dir = library_dir(prefix)
    libraries = llama_libraries(lib_dir)
    modules = backend_modules(prefix)
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
        "libraries": [str(p) for p in libraries],
        "module_dir": str(prefix / "bin"),
        "modules": [str(p) for p in modules],
        "commit": commit,
        "commit_source": commit_source,
        "source": str(prefix),
        "source_origin": "prefix",
        "backend": backend_of(libraries, modules),
        "portable": any(p.name.startswith("libggml-cpu") for p in modules),
        "rpc": any(p.name.startswith("libggml-rpc") for p in libraries + modules),
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
    args.json.write_text(json.dumps(info, indent=2))
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
