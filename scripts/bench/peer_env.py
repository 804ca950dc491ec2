"""llama-cpp-python in a virtual environment of its own, running on our llama.cpp libraries.

The peer is pinned to the release whose vendored llama.cpp is our pinned commit
(llama-cpp-python==0.3.36, the sdist llamacrab-sys builds from), installed with
LLAMA_BUILD=OFF (its Python only, nothing compiled) plus its server extra. Its llama_cpp/lib
then links to the shared libraries llamacrab-sys built: both sides run the same machine code,
so the comparison measures the Python layers and nothing else.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

VERSION = "0.3.36"


def peer_python(cache: Path, source_archive: Path, library_dir: Path) -> Path:
    """The interpreter of the peer's environment (created on first use, under ``cache``)."""
    venv = cache / f"llama-cpp-python-{VERSION}"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        env = {**os.environ, "CMAKE_ARGS": "-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"}
        subprocess.run([str(python), "-m", "pip", "install", "--quiet",
                        f"{source_archive}[server]"], check=True, env=env)  # fmt: skip
    package = Path(subprocess.run(
        [str(python), "-c", "import importlib.util as u; print(u.find_spec('llama_cpp').origin)"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()).parent  # fmt: skip
    lib = package / "lib"
    lib.mkdir(exist_ok=True)
    for real in library_dir.glob("lib*.so*"):
        # Both the SONAME (what our libraries link to) and the bare upstream name (what it
        # dlopens: libllama.so for our libllamacrab-llama.so.0).
        stem = real.name.split(".so")[0].replace("libllamacrab-", "lib", 1)
        for name in {real.name, stem + ".so"}:
            link = lib / name
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(real)
    return python
