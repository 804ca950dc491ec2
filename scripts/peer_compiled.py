"""llama-cpp-python with its OWN compiled llama.cpp, for the duplicate-symbols test.

Usage: python scripts/peer_compiled.py          (builds once, prints the directory)

``compiled_peer()`` returns a directory to put on ``sys.path`` (after our own environment's
site-packages): llama-cpp-python 0.3.36 and diskcache, installed with ``pip --target`` from the
pinned sdist (the one llamacrab-sys builds from), its libllama, libggml* compiled by its own
build (CPU backend only: no mtmd, examples, tools, tests or server). Our environment provides
its other dependencies (numpy, jinja2, typing-extensions). Unlike scripts/bench/peer_env.py,
nothing here links to our libraries: two llama.cpp builds end up in one process.

The directory is cached under the llamacrab cache (``LLAMACRAB_CACHE_DIR``, else
``~/.cache/llamacrab``), keyed by the peer's version, the Python version and the machine; an
exclusive lock lets concurrent runs wait for one build (about 10 minutes on 2 cores) instead of
colliding. A partial build is never used: it is installed into a temporary directory renamed
into place at the end.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "llamacrab-sys"))

from build_tools.cache import cache_root, locked  # noqa: E402
from build_tools.patches import PATCHES, patched_text  # noqa: E402
from build_tools.source import pinned_archive, read_pin  # noqa: E402

# The peer is the release whose vendored llama.cpp is our pinned commit (pin.json).
VERSION = read_pin()["source_archive"]["pip_requirement"].split("==")[1]
CMAKE_ARGS = " ".join([
    "-DLLAVA_BUILD=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DGGML_CUDA=OFF",
    "-DGGML_VULKAN=OFF", "-DGGML_METAL=OFF", "-DGGML_BLAS=OFF", "-DGGML_RPC=OFF",
])  # fmt: skip
_STAMP = ".llamacrab-complete"
# The peer runs llama.cpp as released but for this one of our patches: compiled by GCC 12, its
# AMX matrix product faults at the first prompt on a CPU with AMX (build_tools/patches.py).
_PEER_PATCHES = [p for p in PATCHES if p.name == "ggml-amx-tile-config"]


def peer_dir() -> Path:
    """Where the compiled peer lives (whether or not it is built yet)."""
    patched = hashlib.sha256(repr(_PEER_PATCHES).encode()).hexdigest()[:12]
    key = f"cp{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}-{patched}"
    return cache_root() / "peer-compiled" / f"llama-cpp-python-{VERSION}-{key}"


def compiled_peer(quiet: bool = True) -> Path:
    """The directory holding the compiled llama-cpp-python (built on first use, ~10 min)."""
    target = peer_dir()
    if (target / _STAMP).is_file():
        return target
    with locked(target.with_name(target.name + ".lock")):
        if (target / _STAMP).is_file():  # another process built it while we waited
            return target
        archive = pinned_archive()
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=target.name + ".") as tmp:
            staging = Path(tmp) / "site"
            env = {
                **os.environ,
                "CMAKE_ARGS": CMAKE_ARGS,
                "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2),
            }
            env.pop("LLAMA_CPP_LIB_PATH", None)
            # pip builds in an isolated environment (scikit-build-core, cmake, ninja from PyPI).
            command = [
                sys.executable, "-m", "pip", "install", "--disable-pip-version-check",
                "--no-deps", "--no-cache-dir", "--target", str(staging),
                str(_patched_source(archive, Path(tmp) / "source")), "diskcache>=5.6.1",
            ]  # fmt: skip
            if quiet:
                command.insert(4, "--quiet")
            print(f"llamacrab: compiling llama-cpp-python {VERSION} into {target}", flush=True)
            subprocess.run(command, check=True, env=env)
            if not list((staging / "llama_cpp" / "lib").glob("libllama*.so*")):
                raise RuntimeError(f"the build left no libllama in {staging}/llama_cpp/lib")
            (staging / _STAMP).write_text(f"{archive.name}\n{CMAKE_ARGS}\n")
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
    return target


def _patched_source(archive: Path, into: Path) -> Path:
    """The sdist unpacked into ``into``, its vendored llama.cpp patched; its root."""
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    [root] = into.iterdir()
    for patch in _PEER_PATCHES:
        target = root / "vendor" / "llama.cpp" / patch.path
        target.write_text(patched_text(patch, target.read_text(encoding="utf-8")), "utf-8")
    return root


if __name__ == "__main__":
    print(compiled_peer(quiet=False))
