"""A llama.cpp install "a user built": the test fixture for bring-your-own llama.cpp.

Usage: python scripts/user_llama_cpp.py          (builds once, prints the install prefix)

``user_install()`` returns a prefix (include/, lib/) made the way llama.cpp's README builds it:
plain upstream CMake from the pinned source, shared libraries with upstream's names (libllama.so,
libggml*.so), CPU only, no tools (so no libmtmd), no RPC and none of llamacrab-sys's renaming or
RPATH options. ``LLAMACRAB_LLAMA_CPP_PREFIX=<prefix>`` then builds llamacrab-sys against it.

The prefix is cached under the llamacrab cache (``LLAMACRAB_CACHE_DIR``, else
``~/.cache/llamacrab``) in ``user-llama-cpp/<key>``, keyed by the commit, the CMake options and the
compilers; an exclusive lock lets concurrent runs wait for one build (about 10 minutes on 2 cores).
A partial build is never used: the stamp is written last.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "llamacrab-sys"))

from build_tools.cache import cache_root, locked  # noqa: E402
from build_tools.native import compilers  # noqa: E402
from build_tools.source import resolve_source  # noqa: E402

OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_COMMON=OFF", "-DGGML_CCACHE=OFF",
    "-DCMAKE_INSTALL_LIBDIR=lib",
]  # fmt: skip
_STAMP = "complete.json"


def _entry() -> tuple[Path, Path]:
    source = resolve_source(patched=False)  # a user builds upstream's source, not ours
    identity = {"commit": source.commit, "options": OPTIONS, "compilers": compilers("cpu", [])}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "user-llama-cpp" / f"{source.commit[:12]}-{digest}", source.path


def user_install(quiet: bool = True) -> Path:
    """The install prefix of the user's llama.cpp (built on first use)."""
    entry, source = _entry()
    prefix = entry / "install"
    if (entry / _STAMP).is_file():
        return prefix
    with locked(entry.with_suffix(".lock")):
        if (entry / _STAMP).is_file():  # another process built it while we waited
            return prefix
        build = entry / "build"
        shutil.rmtree(prefix, ignore_errors=True)
        env = dict(os.environ)
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        output = subprocess.DEVNULL if quiet else None
        for cmd in (
            ["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja",
             f"-DCMAKE_INSTALL_PREFIX={prefix}", *OPTIONS],
            ["cmake", "--build", str(build)],
            ["cmake", "--install", str(build)],
        ):  # fmt: skip
            subprocess.run(cmd, check=True, env=env, stdout=output)
        (entry / _STAMP).write_text(json.dumps({"options": OPTIONS}) + "\n")
    return prefix


if __name__ == "__main__":
    print(user_install(quiet=False))
