"""LangChain and LlamaIndex, pinned, installed from PyPI once into llamacrab's cache, for the
framework tests of llamacrab.compat (tests/test_compat_frameworks.py).

They go into two ``pip install --target`` folders, not into the project's environment: the
frameworks (and what they need) at the versions below, constrained to the versions this
environment already has, and LlamaIndex's llama.cpp integration without its dependencies (it
requires llama-cpp-python, which is exactly what llamacrab.compat stands in for). A driver
process puts the folders after its own site-packages, so shared packages come from this
environment. The folders are keyed by the pins and this Python, and installed again when this
environment's version of a package they share changes: a rerun finds them and installs
nothing.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FRAMEWORKS = (
    "langchain-community==0.4.2",
    "langchain-core==1.8.3",
    "langchain-classic==1.0.8",
    "llama-index-core==0.14.25",
)
# Requires llama-cpp-python<0.4: installed without dependencies.
WITHOUT_DEPENDENCIES = ("llama-index-llms-llama-cpp==0.7.0",)
_INSTALLERS = {"pip", "setuptools", "wheel"}
INSTALL_TIMEOUT = 900  # seconds, for a first install on a slow connection


def cache_root() -> Path:
    base = os.environ.get("LLAMACRAB_CACHE_DIR") or Path.home() / ".cache" / "llamacrab"
    return Path(base) / "compat-frameworks"


def constraints() -> str:
    """``name==version`` of every distribution installed here from an index (local and
    editable installs, such as llamacrab itself, are left out, and so are the installers a
    venv is seeded with: llama-index-core needs a newer setuptools than Python's venv brings)."""
    lines = set()
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name in _INSTALLERS:
            continue
        if name and dist.read_text("direct_url.json") is None:
            lines.add(f"{name}=={dist.version}")
    return "\n".join(sorted(lines)) + "\n"


def ensure_installed() -> tuple[Path, Path]:
    """The two folders to append to ``sys.path``, installed if not yet there (or if this
    environment's version of a package they share has changed since)."""
    key = hashlib.sha256(
        "\n".join([sys.version, *FRAMEWORKS, *WITHOUT_DEPENDENCIES]).encode()
    ).hexdigest()[:16]
    root = cache_root()
    done = root / key
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one install at a time; others wait, then reuse it
        if not _usable(done):
            _install(root, done)
    return done / "frameworks", done / "integrations"


def _install(root: Path, done: Path) -> None:
    with tempfile.TemporaryDirectory(dir=root, prefix="installing-") as work:
        staging = Path(work) / "env"
        (constraints_file := Path(work) / "constraints.txt").write_text(constraints())
        pip = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check",
               "--quiet", "--no-input"]  # fmt: skip
        _run([*pip, "--target", str(staging / "frameworks"), "-c", str(constraints_file),
              *FRAMEWORKS])  # fmt: skip
        _run([*pip, "--no-deps", "--target", str(staging / "integrations"),
              *WITHOUT_DEPENDENCIES])  # fmt: skip
        (staging / "shared.txt").write_text(_shared(staging / "frameworks"))
        (staging / "complete").write_text("\n".join([*FRAMEWORKS, *WITHOUT_DEPENDENCIES]))
        shutil.rmtree(done, ignore_errors=True)
        staging.rename(done)
    for old in root.iterdir():  # other keys: installs for other pins or Pythons
        if old.is_dir() and old != done and not old.name.startswith("installing-"):
            shutil.rmtree(old, ignore_errors=True)


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _shared(folder: Path) -> str:
    """``name==version`` here of each package installed in ``folder`` that this environment
    has too (the driver uses this environment's copy of those)."""
    installed = {
        _normalized(d.metadata["Name"] or ""): d for d in importlib.metadata.distributions()
    }
    lines = []
    for info in folder.glob("*.dist-info"):
        name = _normalized(info.name.removesuffix(".dist-info").split("-")[0])
        if name in installed:
            lines.append(f"{name}=={installed[name].version}")
    return "\n".join(sorted(lines)) + "\n"


def _usable(done: Path) -> bool:
    if not (done / "complete").exists() or not (done / "shared.txt").exists():
        return False
    for line in (done / "shared.txt").read_text().split():
        name, version = line.split("==")
        try:
            if importlib.metadata.version(name) != version:
                return False
        except importlib.metadata.PackageNotFoundError:
            continue  # gone from here: the folder's own copy serves
    return True


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:8])} ... failed:\n{result.stderr[-3000:]}")
