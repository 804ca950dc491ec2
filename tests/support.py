"""Helpers shared by the test suites: repository scripts and examples as modules, a gate, and
the comparison of greedy runs up to near-ties."""

from __future__ import annotations

import importlib.util
import io
import sys
import threading
import time
import wave
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from llamacrab import CompletionChoice, CustomSampler, DecodeAbortedError
from llamacrab._native.batch import Batch
from llamacrab._native.context import Context

REPO = Path(__file__).resolve().parent.parent


def load_repo_module(relative_path: str) -> ModuleType:
    """Import a file such as scripts/make_tiny_gguf.py or examples/raw_generate.py."""
    path = REPO / relative_path
    name = "llamacrab_repo_" + path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class Gate(CustomSampler):
    """A sampler that holds the engine thread at each token until the test opens it."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def apply(self, candidates: np.ndarray) -> None:
        self.open.wait(timeout=30)


class Slow(CustomSampler):
    """A sampler that takes ``delay`` seconds per token (after the test opens ``open``, when
    ``gated``) and counts its calls: a generation that outlasts any limit a test sets, so only
    cancelling it ends it in time."""

    def __init__(self, delay: float = 0.05, gated: bool = False) -> None:
        self.delay = delay
        self.calls = 0
        self.open = threading.Event()
        if not gated:
            self.open.set()

    def apply(self, candidates: np.ndarray) -> None:
        self.open.wait(timeout=30)
        self.calls += 1
        time.sleep(self.delay)


def assert_same_up_to_near_ties(alone: CompletionChoice, batched: CompletionChoice) -> None:
    """Greedy tokens of a run in a shared batch equal those of a lone run (decoded with
    logprobs=2), except after a step the lone run decided narrowly: llama.cpp's CPU kernels
    round differently by batch shape (logits moved by up to ~1 between an 11- and an 88-token
    batch), so a near-tie may flip. What other sequences contain never matters (see
    test_parallel)."""
    differ = next(
        (i for i, (a, b) in enumerate(zip(alone.tokens, batched.tokens, strict=False)) if a != b),
        None,
    )
    if differ is None:
        assert len(alone.tokens) == len(batched.tokens)
        return
    assert alone.logprobs is not None
    top = sorted(alone.logprobs.top_logprobs[differ].values(), reverse=True)
    assert top[0] - top[1] < 0.5, f"diverged at token {differ} on a clear decision {top}"


def record_decodes(monkeypatch: pytest.MonkeyPatch, before: Callable[[Batch], None]) -> list[str]:
    """Context.decode calls ``before(batch)`` first; each call's outcome ("decoded" or
    "aborted") is recorded in the list returned."""
    outcomes: list[str] = []
    decode = Context.decode

    def recorded(self: Context, batch: Batch, *args: object, **kwargs: object) -> None:
        before(batch)
        try:
            decode(self, batch, *args, **kwargs)  # type: ignore[arg-type]
        except DecodeAbortedError:
            outcomes.append("aborted")
            raise
        outcomes.append("decoded")

    monkeypatch.setattr(Context, "decode", recorded)
    return outcomes


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    """A mono 16-bit WAV file of ``samples`` (floats in [-1, 1]) at ``rate`` Hz."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buffer.getvalue()
