"""LangChain's own tests of LlamaCpp, ChatLlamaCpp and LlamaCppEmbeddings (shipped in the
langchain-community sdist), unchanged, run with pytest on llamacrab.compat: the LLM and chat
tests with Gemma 3 270M, the embedding tests with all-MiniLM-L6-v2 (see tests/compat_upstream.py
for how their model download is answered locally). The outcomes below are the README's.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from compat_frameworks import ensure_installed
from compat_upstream import TESTS, ensure_fetched

from support import REPO, load_repo_module

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(1800)]

RUNNER = REPO / "tests" / "compat_upstream_runner.py"
RUN_TIMEOUT = 900  # seconds per model's run
# Three failures are LangChain's own, whatever runs underneath. Its embedding tests expect
# 512-dimensional vectors: the size of no model they name (the Alpaca 7B they download has
# 4,096); all-MiniLM-L6-v2 gives 384.
WRONG_SIZE = "assert 384 == 512"
# LlamaCpp.stream is langchain-core's Runnable.stream now: it yields strings, where the test
# expects llama-cpp-python's dict chunks (the text streamed is right).
STREAM_YIELDS_TEXT = "AssertionError: assert not True"
# langchain-core 1.x warns about a field given in model_kwargs instead of raising ValueError.
ONLY_WARNS = "Failed: DID NOT RAISE"
EXPECTED = {
    "tests.integration_tests.llms.test_llamacpp::test_llamacpp_inference": "passed",
    "tests.integration_tests.llms.test_llamacpp::test_llamacpp_streaming": STREAM_YIELDS_TEXT,
    "tests.integration_tests.llms.test_llamacpp::test_llamacpp_streaming_callback": "passed",
    "tests.integration_tests.llms.test_llamacpp::test_llamacpp_model_kwargs": "passed",
    "tests.integration_tests.llms.test_llamacpp::test_llamacpp_invalid_model_kwargs": ONLY_WARNS,
    "tests.integration_tests.llms.test_llamacpp::test_llamacpp_incorrect_field": "passed",
    "tests.integration_tests.chat_models.test_llamacpp::test_structured_output": "passed",
    "tests.integration_tests.embeddings.test_llamacpp::test_llamacpp_embedding_documents": (
        WRONG_SIZE
    ),
    "tests.integration_tests.embeddings.test_llamacpp::test_llamacpp_embedding_query": WRONG_SIZE,
    "tests.unit_tests.embeddings.test_llamacpp::test_initialization": "passed",
    "tests.unit_tests.embeddings.test_llamacpp::test_embed_documents": "passed",
    "tests.unit_tests.embeddings.test_llamacpp::test_embed_query": "passed",
    "tests.unit_tests.embeddings.test_llamacpp::test_embed_query_not_nested": "passed",
}


def run_upstream(model: Path, files: list[str], work: Path) -> dict[str, str]:
    """Each test's outcome: "passed", "skipped", or the first line of its failure."""
    root, tools = ensure_fetched()
    report = work / "report.xml"
    command = [sys.executable, str(RUNNER), str(model), str(root), *map(str, ensure_installed()),
               str(tools), "--", "-p", "no:cacheprovider", f"--junitxml={report}",
               *(str(root / f) for f in files)]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=work)
    assert report.exists(), f"pytest exited {run.returncode}: {run.stdout[-3000:]}"
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        problems = [p for p in (case.find("failure"), case.find("error")) if p is not None]
        if not problems:
            outcome = "skipped" if case.find("skipped") is not None else "passed"
        else:
            outcome = (problems[0].get("message") or "failed").splitlines()[0]
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return outcomes


def test_langchains_own_llamacpp_tests(
    gemma_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    on_gemma = [f for f in TESTS if "/embeddings/" not in f]
    outcomes = run_upstream(gemma_path, on_gemma, tmp_path_factory.mktemp("gemma"))
    minilm = load_repo_module("scripts/convert_bert.py").minilm()
    on_minilm = [f for f in TESTS if "/embeddings/" in f]
    outcomes |= run_upstream(minilm, on_minilm, tmp_path_factory.mktemp("minilm"))
    assert {name: outcome[: len(EXPECTED.get(name, ""))] for name, outcome in outcomes.items()} == (
        EXPECTED
    ), outcomes
