"""Threads: decoding releases the GIL; concurrent use of a context is refused, never corrupting."""

from __future__ import annotations

import threading
import time

import pytest

from llamacrab import ConcurrentUseError, Llama


@pytest.mark.real_model
def test_decoding_does_not_block_other_python_threads(gemma: Llama) -> None:
    done = threading.Event()
    count = 0

    def generate() -> None:
        gemma.create_completion("Once upon a time", max_tokens=24, temperature=0)
        done.set()

    worker = threading.Thread(target=generate)
    worker.start()
    while not done.is_set():
        count += 1
        time.sleep(0)
    worker.join()
    assert count > 1000  # the main thread kept running while llama.cpp decoded


def test_a_context_entered_from_two_threads_raises(tiny_llama: Llama) -> None:
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        with tiny_llama.context.exclusive():
            entered.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    entered.wait(10)
    try:
        with pytest.raises(ConcurrentUseError, match="another thread"):
            tiny_llama.context.clear()
    finally:
        release.set()
        holder.join()
    tiny_llama.context.clear()


def test_concurrent_completions_are_serialized(tiny_llama: Llama) -> None:
    prompts = ["the cat", "a dog sat on", "hello world", "the mat is"]
    options = {"max_tokens": 20, "min_tokens": 20, "temperature": 0}
    sequential = [tiny_llama.create_completion(p, **options).choices[0].tokens for p in prompts]
    results: dict[int, tuple[int, ...]] = {}
    start = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        start.wait(timeout=10)  # all four calls at once
        results[i] = tiny_llama.create_completion(prompts[i], **options).choices[0].tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    # One slot: each call ran alone, so each equals its sequential run token for token.
    assert [results.get(i) for i in range(len(prompts))] == sequential
    assert all(len(tokens) == 20 for tokens in sequential)


@pytest.mark.real_model
def test_cancel_from_another_thread(gemma: Llama) -> None:
    stream = gemma.stream_completion(
        "Count to one hundred: one, two,", max_tokens=200, temperature=0
    )
    next(stream)
    threading.Timer(0.2, gemma.cancel).start()
    chunks = list(stream)
    assert chunks[-1].finish_reason == "cancelled"
    assert sum(1 for c in chunks if c.tokens) < 199
