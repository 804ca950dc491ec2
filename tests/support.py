"""Helpers shared by the test suites: repository scripts and examples as modules, a gate, and
the comparison of greedy runs up to near-ties."""

from __future__ import annotations

import importlib.util
import io
import math
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
from llamacrab._native.sampler import SamplerChain as NativeChain

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


def chain_distribution(
    logits: np.ndarray, top_k: int, top_p: float, min_p: float, temp: float
) -> dict:
    """llama.cpp's chain top_k -> top_p -> min_p -> temperature -> dist, in numpy."""
    order = np.argsort(-logits, kind="stable")[:top_k]
    kept = logits[order].astype(np.float64)
    probs = np.exp(kept - kept[0])
    probs /= probs.sum()
    cut = int(np.searchsorted(np.cumsum(probs), top_p)) + 1  # up to the first reaching p
    order, kept = order[:cut], kept[:cut]
    keep = kept >= kept[0] + np.log(min_p)
    order, kept = order[keep], kept[keep]
    final = np.exp((kept - kept[0]) / temp)
    return dict(zip(order.tolist(), (final / final.sum()).tolist(), strict=True))


def chi_square(counts: dict[int, int], expected: dict[int, float], n: int) -> tuple[float, int]:
    assert set(counts) <= set(expected), "a token outside the kept set was sampled"
    # Pool the rare tokens (expected count < 5) into one bin, as the test needs.
    big = [t for t, p in expected.items() if p * n >= 5]
    rare = [t for t in expected if t not in big]
    observed = [counts.get(t, 0) for t in big]
    wanted = [expected[t] * n for t in big]
    if rare:
        observed.append(sum(counts.get(t, 0) for t in rare))
        wanted.append(sum(expected[t] for t in rare) * n)
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, wanted, strict=True))
    return stat, len(observed) - 1


def chi2_sf(x: float, k: int) -> float:
    """P(X > x) for chi-square with k degrees of freedom (Wilson-Hilferty, ample here)."""
    z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def count_whole_chain_picks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many picks of chains with a grammar applied it to every candidate, counted as they
    happen (the first item)."""
    counts = [0]
    whole_chain = NativeChain._constrained_pick

    def counted(self: NativeChain, *args: object) -> int:
        counts[0] += 1
        return whole_chain(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(NativeChain, "_constrained_pick", counted)
    return counts
