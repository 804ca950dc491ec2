"""Cross-build the pinned llama.cpp for arm64 macOS with zig's clang and check it from here.

Usage: python scripts/cross_check_macos.py

What a macOS build of llamacrab-sys would link, ship and dlopen (build_tools/layout.py) is read
from a real macOS install tree, every library must export the C API (non-C++ names) the Linux
build exports, read by build_tools/binaries.py from the Mach-O files (ggml-cpu leniently: its
kernels differ by architecture), and the bindings generated from it must be the Linux ones.
Metal, BLAS and Accelerate need Apple's SDK and are off. The build (about 10 minutes on two
cores) is cached like any other (build_tools.native). Exits non-zero on any difference.
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "llamacrab-sys"))

from build_tools import binaries, bindings, layout, native  # noqa: E402
from build_tools.cache import cache_root  # noqa: E402

# zig's drivers wrapped for CMake: our name -> zig's subcommand.
TOOLS = {"cc": "cc", "cxx": "c++", "ar": "ar", "ranlib": "ranlib"}
MACOS_OPTIONS = [
    "-DCMAKE_SYSTEM_NAME=Darwin",
    "-DCMAKE_SYSTEM_PROCESSOR=arm64",
    "-DCMAKE_INSTALL_NAME_TOOL=/bin/true",  # install names stay as linked (@rpath/...)
    "-DGGML_NATIVE=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_BLAS=OFF",
    "-DGGML_ACCELERATE=OFF",
    "-DGGML_OPENMP=OFF",
]


def zig_wrappers(directory: Path) -> list[str]:
    """Scripts CMake can call as its compilers and archivers (one path each, no arguments)."""
    directory.mkdir(parents=True, exist_ok=True)
    options = []
    for name, command in TOOLS.items():
        target = "-target aarch64-macos " if name in ("cc", "cxx") else ""
        script = directory / f"zig-{name}"
        script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ziglang {command} {target}"$@"\n')
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
        variable = {"cc": "C_COMPILER", "cxx": "CXX_COMPILER", "ar": "AR", "ranlib": "RANLIB"}
        options.append(f"-DCMAKE_{variable[name]}={script}")
    return options


def c_functions(library: Path) -> set[str]:
    return {name for name in binaries.read(library).functions if not name.startswith("_Z")}


def main() -> int:
    wrappers = zig_wrappers(cache_root() / "zig-macos")
    mac = native.build("cpu", rpc=True, extra=wrappers + MACOS_OPTIONS)
    linux = native.build("cpu", rpc=True)
    mac_libraries = layout.libraries(Path(mac["lib_dir"]), layout.MACOS)
    linux_all = {
        library.link.name.removesuffix(".so"): library
        for library in layout.libraries(Path(linux["lib_dir"]), layout.LINUX)
    }
    linux_libraries = dict(linux_all)
    failures = 0
    for library in mac_libraries:
        stem = library.link.name.removesuffix(".dylib")
        ours = c_functions(library.runtime)
        theirs = c_functions(linux_libraries.pop(stem).runtime)
        missing, extra = sorted(theirs - ours), sorted(ours - theirs)
        lenient = stem.endswith("ggml-cpu")  # architecture-specific kernels
        ok = lenient or not (missing or extra)
        failures += not ok
        print(f"{'ok  ' if ok else 'DIFF'} {library.name:38} {len(ours):5} C functions "
              f"(Linux {len(theirs)}; missing {len(missing)}, extra {len(extra)})")  # fmt: skip
        if not ok:
            print(f"     missing: {missing[:10]}\n     extra: {extra[:10]}")
    for stem in linux_libraries:
        print(f"DIFF {stem}: built on Linux, not found in the macOS install")
        failures += 1
    modules = layout.backend_modules(Path(mac["prefix"]), mac_libraries, layout.MACOS)
    print(f"modules: {[p.name for p in modules] or 'none (not a portable build)'}")
    # The binding itself: the functions it declares come from the headers and the exports.
    cdefs = [
        bindings.render([Path(build["include_dir"])], [lib.runtime for lib in libraries])[3]
        for build, libraries in ((mac, mac_libraries), (linux, list(linux_all.values())))
    ]
    same = cdefs[0] == cdefs[1]
    failures += not same
    print(f"{'ok  ' if same else 'DIFF'} the generated cdef ({len(cdefs[0])} characters)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
