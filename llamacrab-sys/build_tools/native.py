"""Build llama.cpp as shared libraries into a cache entry keyed by everything that shapes the build.

Usage: python -m build_tools.native --backend cpu [--portable] [--rpc] [--sanitize address]
           [--cmake-arg -DX=Y ...] [--tool llama-bench ...] [--cmake PATH] [--generator NAME]
           [--make-program PATH] [--generator-platform x64] [--json OUT]

The key covers the llama.cpp commit, backend, CMake options and compiler identities, so a second
build with unchanged inputs reuses the installed tree at once. A tree from a local checkout is
rebuilt incrementally every time because its files may have changed under the same commit.
With --tool, the named upstream programs (e.g. llama-bench, for benchmarks against native
llama.cpp) are built instead, from the same source with the same options, and not installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from build_tools import layout
from build_tools.cache import cache_root, locked
from build_tools.source import Source, resolve_source

BACKENDS: dict[str, list[str]] = {
    "cpu": [],
    "cuda": ["-DGGML_CUDA=ON"],
    "vulkan": ["-DGGML_VULKAN=ON"],
    "metal": ["-DGGML_METAL=ON"],
    "hip": ["-DGGML_HIP=ON"],
    "opencl": ["-DGGML_OPENCL=ON"],
    "blas": ["-DGGML_BLAS=ON"],
}

# A library-only build: no upstream tests, examples, tools, server, web UI or network code.
BASE_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DLLAMA_BUILD_COMMON=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_MTMD=ON",
    "-DGGML_CCACHE=OFF",
    "-DCMAKE_INSTALL_LIBDIR=lib",
    # Libraries find each other next to themselves wherever the package is installed.
    f"-DCMAKE_INSTALL_RPATH={layout.current().library_rpath}",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=OFF",
]

# Names and SONAMEs of our own for the shared libraries (libllamacrab-llama.so.0, ...): the
# dynamic loader reuses an already-loaded library whose SONAME matches a NEEDED entry, so with
# upstream's names (libllama.so.0, libggml.so.0), another llama.cpp build in the same process
# (llama-cpp-python, ...) binds to our libraries, or we to its (tests/test_ffi_traps.py,
# duplicate symbols). A prefix set after each project() (CMAKE_PROJECT_INCLUDE) renames every
# SHARED library; dlopen-only backend MODULEs keep the names ggml's loader looks for.
LIBRARY_PREFIX = "libllamacrab-"
_NAMES_CMAKE = f'set(CMAKE_SHARED_LIBRARY_PREFIX "{LIBRARY_PREFIX}")\n'
# On Windows ggml empties the prefix again after its project() (its DLLs would be ggml.dll, ...,
# which the loader also matches by name with one already in the process): once the whole tree is
# configured, every SHARED library gets the prefix as a target property.
_WINDOWS_NAMES_CMAKE = f"""
function(llamacrab_prefix_shared_libraries directory)
  get_property(targets DIRECTORY "${{directory}}" PROPERTY BUILDSYSTEM_TARGETS)
  foreach(target IN LISTS targets)
    get_target_property(type "${{target}}" TYPE)
    if(type STREQUAL "SHARED_LIBRARY")
      set_target_properties("${{target}}" PROPERTIES PREFIX "{LIBRARY_PREFIX}")
    endif()
  endforeach()
  get_property(subdirectories DIRECTORY "${{directory}}" PROPERTY SUBDIRECTORIES)
  foreach(subdirectory IN LISTS subdirectories)
    llamacrab_prefix_shared_libraries("${{subdirectory}}")
  endforeach()
endfunction()
get_property(deferred GLOBAL PROPERTY LLAMACRAB_PREFIX_DEFERRED)
if(NOT deferred)
  set_property(GLOBAL PROPERTY LLAMACRAB_PREFIX_DEFERRED ON)
  cmake_language(DEFER DIRECTORY "${{CMAKE_SOURCE_DIR}}"
                 CALL llamacrab_prefix_shared_libraries "${{CMAKE_SOURCE_DIR}}")
endif()
"""


def names_cmake(system: layout.System) -> str:
    """The CMAKE_PROJECT_INCLUDE giving our libraries their names on ``system``."""
    return _NAMES_CMAKE + (_WINDOWS_NAMES_CMAKE if system is layout.WINDOWS else "")


NATIVE_CPU = ["-DGGML_NATIVE=ON"]
# A distributable wheel must run on any x86-64: every CPU variant, picked at run time.
PORTABLE_CPU = ["-DGGML_NATIVE=OFF", "-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON"]

# Sanitizer builds (CI's AddressSanitizer job): every llama.cpp, ggml and mtmd object is
# instrumented through the global flags, which reach targets that upstream's own
# LLAMA_SANITIZE_* options miss. A Python process loading them needs libasan preloaded.
SANITIZERS: dict[str, list[str]] = {
    "address": ["-fsanitize=address", "-fno-omit-frame-pointer"],
    "undefined": ["-fsanitize=undefined", "-fno-sanitize-recover=undefined"],
}

_STAMP = "complete.json"
# The upstream programs the benchmarks compare against, built together into one cache entry.
BENCH_TOOLS = ["llama-bench", "llama-server"]


def sanitizer_flags(sanitize: str) -> list[str]:
    """Compiler and linker flags for a comma-separated list of sanitizers ("" for none)."""
    flags: list[str] = []
    for name in filter(None, (part.strip() for part in sanitize.split(","))):
        if name not in SANITIZERS:
            raise SystemExit(f"unknown sanitizer {name!r}; choose from {', '.join(SANITIZERS)}")
        flags += [f for f in SANITIZERS[name] if f not in flags]
    return flags


def cmake_options(
    backend: str, portable: bool, rpc: bool, extra: list[str], sanitize: str = ""
) -> list[str]:
    if backend not in BACKENDS:
        raise SystemExit(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    options = BASE_OPTIONS + (PORTABLE_CPU if portable else NATIVE_CPU) + BACKENDS[backend]
    if rpc:
        # TCP only: the RDMA transport would link libibverbs wherever it happens to be installed.
        options += ["-DGGML_RPC=ON", "-DGGML_RPC_RDMA=OFF"]
    flags = " ".join(sanitizer_flags(sanitize))
    if flags:
        options += [
            f"-DCMAKE_C_FLAGS={flags}",
            f"-DCMAKE_CXX_FLAGS={flags}",
            f"-DCMAKE_SHARED_LINKER_FLAGS={flags}",
            f"-DCMAKE_EXE_LINKER_FLAGS={flags}",
        ]
    return options + extra


def _tool_identity(command: str) -> str:
    """The real path and version of a tool, the same whichever alias (cc, gcc) names it."""
    path = shutil.which(command)
    if path is None:
        return f"{command}: not found"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, check=True)
        # Drop the first word: it is the alias the tool was called by.
        version = " ".join(out.stdout.split()[1:])
    except (OSError, subprocess.CalledProcessError):
        version = "unknown version"
    return f"{os.path.realpath(path)} {version}"


def compilers(backend: str, options: list[str]) -> dict[str, str]:
    """Identities of the compilers CMake will use (an explicit -DCMAKE_<LANG>_COMPILER wins)."""
    chosen = dict(o[2:].split("=", 1) for o in options if o.startswith("-DCMAKE_") and "=" in o)
    ids = {
        "cc": _tool_identity(chosen.get("CMAKE_C_COMPILER", os.environ.get("CC", "cc"))),
        "cxx": _tool_identity(chosen.get("CMAKE_CXX_COMPILER", os.environ.get("CXX", "c++"))),
    }
    if backend == "cuda":
        nvcc = chosen.get("CMAKE_CUDA_COMPILER", os.environ.get("CUDACXX", "nvcc"))
        ids["nvcc"] = _tool_identity(nvcc)
    return ids


def cache_key(
    source: Source, backend: str, options: list[str], compiler_ids: dict, tools: list[str]
) -> str:
    identity: dict[str, object] = {
        "commit": source.commit,
        "source": str(source.path) if source.origin == "local" else "pinned",
        "patches": source.patches_digest,
        "backend": backend,
        "options": options,
        "compilers": compiler_ids,
    }
    if tools:
        identity["tools"] = sorted(tools)
    else:
        identity["library_names"] = names_cmake(layout.current())
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    kind = "tools" if tools else backend
    return f"{source.commit[:12]}-{kind}-{digest[:16]}"


@dataclass(frozen=True)
class Generator:
    """The CMake generator of the outer build (scikit-build-core's), reused for llama.cpp's."""

    name: str = "Ninja"
    make_program: str = ""  # its ninja or make, where the outer build found one
    platform: str = ""  # a Visual Studio generator's target platform (x64, ARM64)

    def cmake_args(self) -> list[str]:
        args = ["-G", self.name]
        # A Visual Studio or Xcode build drives MSBuild or xcodebuild, never a given program.
        if self.make_program and not self.name.startswith(("Visual Studio", "Xcode")):
            args.append(f"-DCMAKE_MAKE_PROGRAM={self.make_program}")
        if self.platform:
            args += ["-A", self.platform]
        return args


def _run(cmd: list[str], env: dict[str, str]) -> None:
    print("llamacrab: " + shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


def build(
    backend: str,
    portable: bool = False,
    rpc: bool = False,
    extra: list[str] | None = None,
    cmake: str = "cmake",
    generator: Generator | None = None,
    tools: list[str] | None = None,
    sanitize: str = "",
) -> dict:
    source = resolve_source()
    tools = tools or []
    options = cmake_options(backend, portable, rpc, extra or [], sanitize)
    if tools:  # later -D options win over BASE_OPTIONS
        options += ["-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON"]
    ids = compilers(backend, options)
    key = cache_key(source, backend, options, ids, tools)
    entry = cache_root() / "native" / key
    stamp = entry / _STAMP
    # For the shims, which CMake compiles with the same instrumentation.
    flags = {"sanitizer_flags": " ".join(sanitizer_flags(sanitize))}
    if source.immutable and stamp.is_file():
        return {**json.loads(stamp.read_text(encoding="utf-8")), **flags, "cache_hit": True}

    with locked(entry.with_suffix(".lock")):
        if source.immutable and stamp.is_file():
            return {**json.loads(stamp.read_text(encoding="utf-8")), **flags, "cache_hit": True}
        build_dir, prefix = entry / "build", entry / "install"
        env = dict(os.environ)
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        generator_args = (generator or Generator()).cmake_args()
        names = []
        if not tools:  # upstream's programs keep upstream's names
            entry.mkdir(parents=True, exist_ok=True)
            (entry / "names.cmake").write_text(names_cmake(layout.current()), encoding="utf-8")
            names = [f"-DCMAKE_PROJECT_INCLUDE={entry / 'names.cmake'}"]
        started = time.monotonic()
        _run([cmake, "-S", str(source.path), "-B", str(build_dir), *generator_args,
              f"-DCMAKE_INSTALL_PREFIX={prefix}", *names, *options], env)  # fmt: skip
        targets = [arg for tool in tools for arg in ("--target", tool)]
        _run([cmake, "--build", str(build_dir), "--config", "Release", *targets], env)
        if not tools:
            shutil.rmtree(prefix, ignore_errors=True)
            _run([cmake, "--install", str(build_dir), "--config", "Release"], env)
        info = {
            "key": key,
            "prefix": str(prefix),
            "include_dir": str(prefix / "include"),
            "lib_dir": str(prefix / "lib"),
            "bin_dir": str(build_dir / "bin"),
            "commit": source.commit,
            "source": str(source.path),
            "source_origin": source.origin,
            "patches": list(source.patches),
            "backend": backend,
            "portable": portable,
            "rpc": rpc,
            "sanitize": ",".join(n.strip() for n in sanitize.split(",") if n.strip()),
            "cmake_options": options,
            "compilers": ids,
            "build_seconds": round(time.monotonic() - started, 1),
        }
        stamp.write_text(json.dumps(info, indent=2), encoding="utf-8")
    return {**info, **flags, "cache_hit": False}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cpu", choices=sorted(BACKENDS))
    parser.add_argument("--portable", action="store_true")
    parser.add_argument("--rpc", action="store_true")
    parser.add_argument("--sanitize", default="", help="address, undefined or both (a,b)")
    parser.add_argument("--cmake-arg", action="append", default=[], dest="extra")
    parser.add_argument("--tool", action="append", default=[], dest="tools")
    parser.add_argument("--cmake", default="cmake")
    parser.add_argument("--generator", default="Ninja")
    parser.add_argument("--make-program", default="")
    parser.add_argument("--generator-platform", default="")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    try:
        info = build(
            args.backend, args.portable, args.rpc, args.extra, args.cmake,
            Generator(args.generator, args.make_program, args.generator_platform), args.tools,
            args.sanitize,
        )  # fmt: skip
    except subprocess.CalledProcessError as exc:
        sys.exit(f"llamacrab: llama.cpp build failed: {shlex.join(map(str, exc.cmd))}")
    text = json.dumps(info, indent=2)
    if args.json:
        args.json.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
