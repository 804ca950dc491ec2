"""Fixtures for raw-binding tests: models, contexts and error structs through llamacrab_sys.lib."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llamacrab_sys import ffi, lib

from raw import checked, load_model

SYS_DIR = Path(__file__).resolve().parents[2] / "llamacrab-sys"
if str(SYS_DIR) not in sys.path:
    sys.path.insert(0, str(SYS_DIR))  # build_tools: the generator the build used


@pytest.fixture(scope="session", autouse=True)
def backend() -> Iterator[None]:
    lib.llama_backend_init()
    yield
    lib.llama_backend_free()


@pytest.fixture(scope="module")
def tiny_model(tiny_model_path: Path) -> Iterator[Any]:
    model = load_model(tiny_model_path)
    yield model
    lib.llama_model_free(model)


@pytest.fixture
def tiny_context(tiny_model: Any) -> Iterator[Any]:
    params = lib.llama_context_default_params()
    params.n_ctx = 128
    params.n_threads = params.n_threads_batch = 2
    ctx = checked(lib.safe_llama_init_from_model, tiny_model, params)
    assert ctx != ffi.NULL
    yield ctx
    lib.llama_free(ctx)
