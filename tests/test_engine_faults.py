"""Faults inside the engine: a failing prompt cache, and stopping a generation during a long
prompt prefill."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from llamacrab import Llama
from llamacrab._engine.cache import RamCache
from llamacrab._native.state import SavedState

GREEDY: dict[str, Any] = {"temperature": 0.0, "seed": 1}


class FailingCache(RamCache):
    """A RamCache whose saves and/or lookups fail like a full disk or a locked database;
    ``lookups_failing`` lookups fail, then they work."""

    def __init__(self, *, fail_store: bool = False, lookups_failing: int = 0) -> None:
        super().__init__(capacity_bytes=64 << 20)
        self.fail_store, self.lookups_failing = fail_store, lookups_failing
        self.stores = self.lookups = 0
        self._count = threading.Lock()

    def store(self, state: SavedState, namespace: bytes = b"") -> None:
        with self._count:
            self.stores += 1
        if self.fail_store:
            raise OSError(28, "No space left on device")
        super().store(state, namespace)

    def longest_prefix(
        self, tokens: Sequence[int], namespace: bytes = b""
    ) -> tuple[int, SavedState] | None:
        with self._count:
            self.lookups += 1
            failing = self.lookups <= self.lookups_failing
        if failing:
            raise OSError("database is locked")
        return super().longest_prefix(tokens, namespace)


def _within(seconds: float, work: Callable[[], Any]) -> Any:
    """Run ``work`` in a daemon thread; its result, or a test failure (not a hung test run)
    when it is not done within ``seconds``."""
    outcome: list[Any] = []

    def target() -> None:
        try:
            outcome.append(("ok", work()))
        except BaseException as error:
            outcome.append(("error", error))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still waiting after {seconds} s")
    kind, value = outcome[0]
    if kind == "error":
        raise value
    return value


def _finish_reasons(llm: Llama, prompts: list[str]) -> list[str | None]:
    """Run the prompts side by side (all queued first) and return each last finish_reason."""
    streams = [llm.stream_completion(p, max_tokens=4, **GREEDY) for p in prompts]
    return [[chunk.finish_reason for chunk in stream][-1] for stream in streams]


def _warned(caplog: pytest.LogCaptureFixture, words: str) -> bool:
    return any(
        r.name == "llamacrab" and r.levelno == logging.WARNING and words in r.getMessage()
        for r in caplog.records
    )


# -- a failing prompt cache ----------------------------------------------------------------------


def test_parallel_slots_finish_when_saving_to_the_cache_fails(
    tiny_model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = FailingCache(fail_store=True)
    with Llama(tiny_model_path, n_ctx=256, n_threads=2, parallel=2, cache=cache) as llm:
        prompts = ["the cat sat", "a dog ran far"]
        reasons = _within(60, lambda: _finish_reasons(llm, prompts))
        assert all(reason in ("length", "eos", "stop") for reason in reasons)
        assert cache.stores >= 2 and len(cache) == 0
        # The engine still serves the next request.
        assert _within(60, lambda: _finish_reasons(llm, ["the cat"]))[0] is not None
    assert _warned(caplog, "prompt cache save failed")


def test_a_failing_cache_lookup_is_a_miss_for_its_slot_only(
    tiny_model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = FailingCache(lookups_failing=1)
    with Llama(tiny_model_path, n_ctx=256, n_threads=2, parallel=2, cache=cache) as llm:
        prompts = ["the cat sat", "a dog ran far"]
        reasons = _within(60, lambda: _finish_reasons(llm, prompts))
        assert all(reason in ("length", "eos", "stop") for reason in reasons)
        assert cache.lookups >= 2 and len(cache) == 2  # saving still works
    assert _warned(caplog, "prompt cache lookup failed")


def test_one_slot_survives_a_failing_cache(
    tiny_model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = FailingCache(fail_store=True, lookups_failing=1)
    with Llama(tiny_model_path, n_ctx=128, n_threads=2, cache=cache) as llm:
        first = llm.create_completion("the cat sat", max_tokens=4, **GREEDY)
        second = llm.create_completion("the cat sat", max_tokens=4, **GREEDY)
        assert first.choices[0].finish_reason in ("length", "eos")
        assert second.choices[0].text == first.choices[0].text
        assert cache.lookups == 2 and cache.stores == 2 and len(cache) == 0
    assert _warned(caplog, "prompt cache lookup failed")
    assert _warned(caplog, "prompt cache save failed")


# -- stopping during a long prompt prefill ---------------------------------------------------------


def test_cancel_and_timeout_stop_a_long_prompt_prefill(gemma_path: Path) -> None:
    with Llama(gemma_path, n_ctx=2048, n_batch=64, n_threads=2) as llm:
        words = " ".join(f"item{i} is followed by item{i + 1}." for i in range(400))
        prompt = llm.tokenize(words)[:1500]
        assert len(prompt) == 1500

        started = time.monotonic()
        full = llm.create_completion(prompt, max_tokens=0)
        prefill = time.monotonic() - started
        assert full.choices[0].finish_reason == "length"

        def cancelled_run(**options: Any) -> tuple[str | None, float]:
            llm.reset()  # nothing of the prompt in memory: the whole prefill is ahead
            stream = llm.stream_completion(prompt, max_tokens=1, **options)
            if "timeout" not in options:
                threading.Timer(0.2, stream.cancel).start()
            begun = time.monotonic()
            reasons = [chunk.finish_reason for chunk in stream]
            return reasons[-1], time.monotonic() - begun

        for options in ({}, {"timeout": 0.2}):
            reason, elapsed = _within(120, lambda options=options: cancelled_run(**options))
            assert reason == "cancelled", options
            # 0.2 s plus at most one 64-token chunk, far from the whole 1500-token prefill.
            assert elapsed < 0.2 + 0.5 * (prefill - 0.2), (options, elapsed, prefill)
