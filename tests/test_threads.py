"""Threads: decoding releases the GIL; concurrent use of a context is refused, never corrupting."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from llamacrab import ConcurrentUseError, CustomSampler, Llama, LlamaError


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


class _CallsItsOwnLlama(CustomSampler):
    """A sampler whose first call uses the Llama it samples for, and keeps what happened."""

    def __init__(self, llm: Llama, action: str) -> None:
        self.llm, self.action, self.outcome = llm, action, ""

    def apply(self, candidates: object) -> None:
        if self.outcome:
            return
        try:
            if self.action == "close":
                self.llm.close()
            elif self.action == "complete":
                self.llm.create_completion("x", max_tokens=1)
            elif self.action == "reset":
                self.llm.reset(slot=0 if self.llm.scheduler else None)
            elif self.action == "evaluate":
                self.llm.evaluate([1, 2])
            self.outcome = "worked"
        except LlamaError as error:
            self.outcome = f"{type(error).__name__}: {error}"


@pytest.mark.parametrize("parallel", [None, 2])
@pytest.mark.parametrize("action", ["close", "complete", "reset", "evaluate"])
def test_a_sampler_calling_its_own_llama_is_refused_and_changes_nothing(
    tiny_model_path: Path, parallel: int | None, action: str
) -> None:
    # Before: on parallel slots a completion from inside one waited for the engine thread it
    # ran on (a hang of every slot); on one slot it cut the running generation short; a
    # close was refused half-way, leaving the model closed and never freed.
    with Llama(tiny_model_path, n_ctx=256, n_threads=1, parallel=parallel) as llm:
        expected = llm.create_completion("the cat", max_tokens=6, temperature=0).text
        hook = _CallsItsOwnLlama(llm, action)
        result: list[str] = []
        worker = threading.Thread(
            target=lambda: result.append(
                llm.create_completion(
                    "the cat", max_tokens=6, temperature=0, custom_samplers=[hook]
                ).text
            ),
            daemon=True,
        )
        worker.start()
        worker.join(30)
        assert not worker.is_alive(), "the generation waited for itself"
        assert hook.outcome.startswith("ConcurrentUseError: "), hook.outcome
        assert result == [expected]
        assert llm.create_completion("the cat", max_tokens=6, temperature=0).text == expected
