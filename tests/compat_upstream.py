"""LangChain's own tests of its llama.cpp classes, from the langchain-community sdist on PyPI
(the version tests/compat_frameworks.py pins), fetched once into llamacrab's cache for
tests/test_compat_upstream.py.

The sdist ships four such files. Their model comes from a ``get_model()`` that downloads
Alpaca 7B from the Hugging Face Hub, converts it, and returns the file name; it downloads only
what is missing from the working directory, so a run in a folder that already holds those
names (the model one a link to our GGUF, the tokenizer and conversion script empty) uses our
local model with the test files unchanged. The chat test names a placeholder path, which the
runner maps to ours. What their pytest configuration needs (blockbuster for the unit tests'
conftest, syrupy and pytest-asyncio for its options) goes into a ``--target`` folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from compat_frameworks import FRAMEWORKS, INSTALL_TIMEOUT, cache_root, constraints

SDIST = next(pin for pin in FRAMEWORKS if pin.startswith("langchain-community=="))
TESTS = (
    "tests/integration_tests/llms/test_llamacpp.py",
    "tests/integration_tests/chat_models/test_llamacpp.py",
    "tests/integration_tests/embeddings/test_llamacpp.py",
    "tests/unit_tests/embeddings/test_llamacpp.py",
)
# What those files import or their pytest configuration loads, besides the package itself and
# the ``__init__.py`` of every folder above them (their modules share a name, test_llamacpp).
SUPPORT = (
    "pyproject.toml",
    "tests/integration_tests/conftest.py",
    "tests/unit_tests/conftest.py",
    "tests/unit_tests/callbacks/__init__.py",
    "tests/unit_tests/callbacks/fake_callback_handler.py",
)
TEST_TOOLS = ("blockbuster==1.5.29", "syrupy==7.0.2", "pytest-asyncio==1.5.0")


def ensure_fetched() -> tuple[Path, Path]:
    """The extracted sdist root (only the files above) and the test tools' folder."""
    files = "\n".join([sys.version, SDIST, *TEST_TOOLS, *TESTS, *SUPPORT])
    key = hashlib.sha256(files.encode()).hexdigest()[:16]
    root = cache_root().parent / "compat-upstream-tests"
    done = root / key
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (done / "complete").exists():
            _fetch(root, done)
    return next((done / "sdist").iterdir()), done / "tools"


def _fetch(root: Path, done: Path) -> None:
    with tempfile.TemporaryDirectory(dir=root, prefix="fetching-") as work:
        staging = Path(work) / "env"
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
        _run([*pip, "download", "--no-deps", "--no-binary", ":all:", "-d", work, SDIST])
        archive = next(Path(work).glob("*.tar.gz"))
        with tarfile.open(archive) as tar:
            top = tar.getnames()[0].split("/")[0]
            packages = {f"{p}/__init__.py" for f in TESTS for p in Path(f).parents if p.parts}
            wanted = {f"{top}/{name}" for name in (*TESTS, *SUPPORT, *packages)}
            members = [m for m in tar.getmembers() if m.name in wanted and m.isfile()]
            if len(members) != len(wanted):
                found = {m.name for m in members}
                raise RuntimeError(f"{SDIST} lacks {sorted(wanted - found)}")
            tar.extractall(staging / "sdist", members=members, filter="data")
        (pins := Path(work) / "constraints.txt").write_text(constraints())
        _run([*pip, "install", "--no-input", "--target", str(staging / "tools"), "-c", str(pins),
              *TEST_TOOLS])  # fmt: skip
        (staging / "complete").write_text(SDIST)
        shutil.rmtree(done, ignore_errors=True)
        staging.rename(done)


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:8])} ... failed:\n{result.stderr[-3000:]}")
