"""LangChain's LlamaCpp / ChatLlamaCpp / LlamaCppEmbeddings and LlamaIndex's LlamaCPP,
unmodified from PyPI (versions pinned in tests/compat_frameworks.py), run on the ``llama_cpp``
alias of llamacrab.compat with Gemma 3 270M and all-MiniLM-L6-v2.

The frameworks are installed once into llamacrab's cache (a first run needs PyPI and about a
minute); tests/compat_frameworks_driver.py exercises them in a separate process, one check per
feature, and each check below reports one of its results.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from compat_frameworks import ensure_installed

from support import REPO, load_repo_module

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(1800)]

DRIVER = REPO / "tests" / "compat_frameworks_driver.py"
# Seconds for every check together (300-420 on a 2-core machine other work loads); a check
# cut short fails below.
DRIVER_TIMEOUT = 900
CHECKS = [
    "langchain LlamaCpp.invoke",
    "langchain LlamaCpp.stream",
    "langchain LlamaCpp.batch",
    "langchain LlamaCpp stop and get_num_tokens",
    "langchain LlamaCpp grammar",
    "langchain ChatLlamaCpp.invoke",
    "langchain ChatLlamaCpp.stream",
    "langchain ChatLlamaCpp.batch (threads)",
    "langchain ChatLlamaCpp.bind_tools",
    "langchain ChatLlamaCpp.with_structured_output",
    "langchain LlamaCppEmbeddings",
    "llamaindex LlamaCPP.complete",
    "llamaindex LlamaCPP.stream_complete",
    "llamaindex LlamaCPP.chat",
]


@pytest.fixture(scope="module")
def results(gemma_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folders = ensure_installed()
    minilm = load_repo_module("scripts/convert_bert.py").minilm()
    work = tmp_path_factory.mktemp("frameworks")
    out = work / "results.jsonl"
    models = [str(gemma_path), str(minilm)]
    command = [sys.executable, str(DRIVER), str(out), *models, *map(str, folders)]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=DRIVER_TIMEOUT,
                             cwd=work)  # fmt: skip
        ending = f"the driver exited {run.returncode}: {run.stderr[-3000:]}"
    except subprocess.TimeoutExpired:
        ending = f"the driver ran past {DRIVER_TIMEOUT} s"
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return {"records": {r["name"]: r for r in records}, "ending": ending}


@pytest.mark.parametrize("name", CHECKS)
def test_framework_feature_works_on_llamacrab(results: dict[str, Any], name: str) -> None:
    record = results["records"].get(name)
    assert record is not None, f"{name!r} did not run; {results['ending']}"
    assert record["ok"], record["detail"]


def test_every_check_is_listed(results: dict[str, Any]) -> None:
    assert sorted(results["records"]) == sorted(CHECKS)
