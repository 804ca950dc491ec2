"""Tiny real shared libraries for every system, laid out as a llama.cpp install lays them out.

Cross-compiled by zig's clang (the ziglang wheel), so the Linux, macOS and Windows paths of the
build tools are tried on real files here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from build_tools.layout import LINUX, MACOS, WINDOWS, System

TARGETS = {LINUX: "x86_64-linux-gnu", MACOS: "aarch64-macos", WINDOWS: "x86_64-windows-gnu"}


def cross_compile(source: Path, target: str, out: Path, flags: list[str]) -> Path:
    subprocess.run(
        [sys.executable, "-m", "ziglang", "cc", "-target", target, "-O2", "-s", "-shared",
         "-fvisibility=hidden", "-o", str(out), str(source), *flags],
        check=True, capture_output=True,
    )  # fmt: skip
    return out


def installed_library(prefix: Path, name: str, system: System) -> Path:
    """Install ``name`` (e.g. "llama", "ggml-base") under ``prefix`` as CMake does on ``system``:
    return the file the module would link."""
    lib, bin_ = prefix / "lib", prefix / "bin"
    lib.mkdir(parents=True, exist_ok=True)
    source = prefix / f"{name}.c"
    symbol = name.replace("-", "_")
    export = '__attribute__((visibility("default")))'
    if system is WINDOWS:
        export = "__declspec(dllexport)"
    source.write_text(f"{export} int {symbol}_probe(void) {{ return 1; }}\n")
    target = TARGETS[system]
    if system is WINDOWS:
        bin_.mkdir(exist_ok=True)
        link = lib / f"{name}.lib"
        cross_compile(source, target, bin_ / f"{name}.dll", [f"-Wl,--out-implib,{link}"])
    else:  # VERSION 0.1.0, SOVERSION 0: the file, the load name's link, the link's link
        if system is LINUX:
            real, loaded, link = (lib / f"lib{name}.so{v}" for v in (".0.1.0", ".0", ""))
            flags = [f"-Wl,-soname,{loaded.name}"]
        else:
            real, loaded, link = (lib / f"lib{name}{v}.dylib" for v in (".0.1.0", ".0", ""))
            flags = [f"-Wl,-install_name,@rpath/{loaded.name}"]
        cross_compile(source, target, real, flags)
        loaded.symlink_to(real.name)
        link.symlink_to(loaded.name)
    source.unlink()
    return link
