"""Parallel slots: concurrent generations batched by one engine thread."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from llamacrab import (
    ClosedHandleError,
    Completion,
    CompletionChunk,
    ConcurrentUseError,
    InvalidParameterError,
    Llama,
    PromptLookup,
    QueueFullError,
    RamCache,
    Stream,
)
from llamacrab._engine.generation import Request, Session, Step
from llamacrab._engine.scheduler import _Job
from llamacrab._native.batch import Batch

from support import Gate, Slow, assert_same_up_to_near_ties, record_decodes

PROMPTS = [f"Write one sentence about the number {i}." for i in range(8)]


def _wait_for(condition: Callable[[], bool], timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture(scope="module")
def gemma_slots(gemma_path: Path) -> Iterator[Llama]:
    with Llama(gemma_path, n_ctx=4 * 512, n_threads=2, parallel=4) as llm:
        yield llm


@pytest.mark.real_model
def test_concurrent_greedy_outputs_equal_sequential_ones(gemma: Llama, gemma_slots: Llama) -> None:
    options = {"max_tokens": 24, "temperature": 0}
    alone = [gemma.create_completion(p, logprobs=2, **options).choices[0] for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: gemma_slots.create_completion(p, **options), PROMPTS))
    for lone, together in zip(alone, results, strict=True):
        assert_same_up_to_near_ties(lone, together.choices[0])
    assert all(r.usage.completion_tokens == 24 for r in results)
    assert gemma_slots.scheduler is not None and gemma_slots.scheduler.busy_slots == 0


@pytest.mark.real_model
def test_each_answer_names_its_slot(gemma: Llama, gemma_slots: Llama) -> None:
    """A completion's choice and every chunk of a stream say which slot ran them (the
    server's id_slot was always -1); without parallel slots, the one sequence, 0."""
    options = {"max_tokens": 12, "temperature": 0}
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: gemma_slots.create_completion(p, **options),
                                PROMPTS[:4]))  # fmt: skip
    assert sorted(r.choices[0].slot for r in results) == [0, 1, 2, 3]
    chunks = list(gemma_slots.stream_completion(PROMPTS[0], **options))
    assert {c.slot for c in chunks} == {chunks[0].slot} and chunks[0].slot is not None
    assert gemma.create_completion(PROMPTS[0], **options).choices[0].slot == 0


@pytest.mark.real_model
def test_a_slot_reuses_the_prefix_it_holds(gemma_slots: Llama) -> None:
    prompt = "The history of the printing press began"
    gemma_slots.create_completion(prompt, max_tokens=4, temperature=0)
    again = gemma_slots.create_completion(prompt + " in", max_tokens=4, temperature=0)
    assert again.usage.cached_tokens >= len(gemma_slots.tokenize(prompt)) - 1


def test_each_slot_gets_its_share_of_the_context(tiny_model_path: Path) -> None:
    with Llama(tiny_model_path, n_ctx=512, parallel=2) as llm:
        limit = llm.context.n_ctx_seq
        assert limit == llm.context.n_ctx // 2
        with pytest.raises(ValueError, match=f"context holds {limit}"):
            llm.create_completion(list(range(1, limit + 1)))
        result = llm.create_completion([1, 2, 3], max_tokens=None, temperature=0)
        assert result.choices[0].finish_reason == "length"
        assert result.usage.prompt_tokens + result.usage.completion_tokens == limit


def test_closing_a_stream_frees_its_slot_at_once(tiny_model_path: Path) -> None:
    slow = Slow(0.05)
    with Llama(tiny_model_path, n_ctx=2048, parallel=1) as llm:
        scheduler = llm.scheduler
        assert scheduler is not None
        # Left alone it would take 2,000 tokens x 50 ms = 100 s.
        stream = llm.stream_completion("hello", max_tokens=None, min_tokens=2000,
                                       custom_samplers=(slow,))  # fmt: skip
        next(stream)
        stream.close()
        started = time.perf_counter()
        assert _wait_for(lambda: scheduler.busy_slots == 0, timeout=1)
        calls = slow.calls
        assert (
            llm.create_completion("again", max_tokens=3, min_tokens=3).usage.completion_tokens == 3
        )
        assert time.perf_counter() - started < 2
        assert slow.calls == calls  # its sampler is never asked again


def test_a_full_queue_refuses_and_a_waiting_stream_can_be_cancelled(
    tiny_model_path: Path,
) -> None:
    gate = Gate()
    with Llama(tiny_model_path, n_ctx=128, parallel=1, max_queue=1) as llm:
        scheduler = llm.scheduler
        assert scheduler is not None
        running = llm.stream_completion("one", max_tokens=8, custom_samplers=(gate,))
        assert _wait_for(lambda: scheduler.busy_slots == 1)  # inside its first sample
        waiting = llm.stream_completion("two", max_tokens=4)  # queued
        results: list[object] = []
        first = threading.Thread(target=lambda: results.append(next(running)))
        first.start()
        waiter = threading.Thread(target=lambda: results.append(list(waiting)))
        waiter.start()  # waits on "two"
        with pytest.raises(QueueFullError, match="queue limit"):
            llm.stream_completion("three")  # refused at once: the queue holds "two"
        waiting.cancel()  # from this thread, while another waits on it
        waiter.join(timeout=10)
        assert not waiter.is_alive()
        gate.open.set()
        first.join(timeout=30)
        # The first chunk may already be the last one (the tiny model can end at once).
        first_chunk = next(r for r in results if not isinstance(r, list))
        assert [first_chunk, *running][-1].finish_reason in ("length", "eos")
    cancelled = next(r for r in results if isinstance(r, list))
    assert [c.finish_reason for c in cancelled] == ["cancelled"]


def test_cancel_and_timeout_end_a_generation(tiny_model_path: Path) -> None:
    with Llama(tiny_model_path, n_ctx=512, parallel=2) as llm:
        gate = Gate()
        stream = llm.stream_completion("hello", max_tokens=None, min_tokens=9,
                                       custom_samplers=(gate,))  # fmt: skip
        stream.cancel()  # while the engine is held inside its first sample
        gate.open.set()
        assert [c.finish_reason for c in stream][-1] == "cancelled"
        event, gate = threading.Event(), Gate()
        options = {"max_tokens": None, "min_tokens": 9, "custom_samplers": (gate,), "cancel": event}
        worker = ThreadPoolExecutor(1).submit(llm.create_completion, "hi", n=2, **options)
        event.set()  # one event stops both choices, from another thread
        gate.open.set()
        assert [c.finish_reason for c in worker.result(timeout=30).choices] == ["cancelled"] * 2
        timed = llm.create_completion("hi", max_tokens=None, min_tokens=100, timeout=1e-6)
        assert timed.choices[0].finish_reason == "cancelled"
        with pytest.raises(InvalidParameterError, match="timeout"):
            llm.create_completion("hi", timeout=0)


def test_close_during_a_generation_raises_in_the_consumer(tiny_model_path: Path) -> None:
    llm = Llama(tiny_model_path, n_ctx=128, parallel=1)
    stream = llm.stream_completion("hello", max_tokens=None, min_tokens=100)
    next(stream)
    llm.close()
    with pytest.raises(ClosedHandleError):
        list(stream)
    with pytest.raises(ClosedHandleError):
        llm.create_completion("again")


def test_a_close_while_queued_streams_are_cancelled_ends_every_stream(
    tiny_model_path: Path,
) -> None:
    # Found by the server's models section (a forced unload while clients left): the engine
    # thread, leaving after the close, iterated its queue while a cancelled stream took its job
    # out of it; "deque mutated during iteration" killed the thread, and the jobs after it
    # waited forever (the server's leases with them).
    with _thread_deaths() as died:
        for _ in range(5):
            _close_while_cancelling_the_queue(tiny_model_path)
    assert died == []


@contextlib.contextmanager
def _thread_deaths() -> Iterator[list[BaseException | None]]:
    """The exceptions threads die of in the block (threading.excepthook's reports)."""
    died: list[BaseException | None] = []
    previous, threading.excepthook = threading.excepthook, lambda a: died.append(a.exc_value)
    try:
        yield died
    finally:
        threading.excepthook = previous


def _close_while_cancelling_the_queue(model: Path) -> None:
    gate = Gate()
    llm = Llama(model, n_ctx=128, parallel=1, max_queue=400)
    scheduler = llm.scheduler
    assert scheduler is not None
    running = llm.stream_completion("one", max_tokens=8, custom_samplers=(gate,))
    assert _wait_for(lambda: scheduler.busy_slots == 1)  # held inside its first sample
    queued = [llm.stream_completion("two", max_tokens=4) for _ in range(300)]
    closer = threading.Thread(target=llm.close)
    canceller = threading.Thread(target=lambda: [s.cancel() for s in queued])
    closer.start()
    canceller.start()
    gate.open.set()  # the engine goes on to its exit while the cancels come
    readers = [threading.Thread(target=_drain, args=(s,)) for s in [running, *queued]]
    for thread in readers:
        thread.start()
    for thread in [closer, canceller, *readers]:
        thread.join(timeout=30)
        assert not thread.is_alive(), "a stream was never ended"


def test_a_cancel_nested_in_the_end_of_timed_out_waiting_jobs_ends_each_once(
    tiny_model_path: Path,
) -> None:
    # A finalizer the garbage collector runs on the engine thread while it ends the waiting jobs
    # whose time ran out may cancel another of them: that nested call took the job out of the
    # queue, and the outer one's remove() of it raised ValueError and killed the engine thread
    # (every client of the Llama then waited for ever).
    with _thread_deaths() as died, Llama(tiny_model_path, n_ctx=128, parallel=1) as llm:
        scheduler = llm.scheduler
        assert scheduler is not None
        gate = Gate()
        running = llm.stream_completion("one", max_tokens=4, custom_samplers=(gate,))
        assert _wait_for(lambda: scheduler.busy_slots == 1)  # held inside its first sample
        first, second = (llm.stream_completion(p, max_tokens=2, timeout=0.05)
                         for p in ("two", "three"))  # fmt: skip
        job = scheduler.waiting[0]
        close = job.samplers.close

        def close_and_cancel_the_other() -> None:  # what the finalizer did, here for sure
            close()
            second.cancel()

        job.samplers.close = close_and_cancel_the_other  # type: ignore[method-assign]
        time.sleep(0.1)  # both waiting jobs are past their timeout, neither woke the engine
        gate.open.set()
        assert _finish_reasons(first) == ["cancelled"]
        assert _finish_reasons(second) == ["cancelled"]
        assert _finish_reasons(running)[-1] in ("length", "eos")
        assert _finish_reasons(llm.stream_completion("four", max_tokens=2))[-1] in ("length", "eos")
    assert died == []


@pytest.mark.parametrize("running_tokens", [1, 4])
def test_samplers_a_cancel_may_not_close_are_closed_by_the_engine(
    tiny_model_path: Path, running_tokens: int
) -> None:
    # A cancel on a thread inside a sampler call (a finalizer the garbage collector ran there)
    # is refused the close of a waiting job's samplers: the job still ends at once, the refusal
    # does not reach whoever cancelled, and the engine closes them at its next look, or idle
    # when the running job ends at the step it was held in (1 token; in CI, an early EOS).
    with Llama(tiny_model_path, n_ctx=128, parallel=1) as llm:
        scheduler = llm.scheduler
        assert scheduler is not None
        gate = Gate()
        running = llm.stream_completion("one", max_tokens=running_tokens,
                                        custom_samplers=(gate,))  # fmt: skip
        assert _wait_for(lambda: scheduler.busy_slots == 1)
        waiting = llm.stream_completion("two", max_tokens=2)
        samplers = scheduler.waiting[0].samplers
        close, closers = samplers.close, []

        def refused_at_first() -> None:
            closers.append(threading.current_thread().name)
            if len(closers) == 1:
                raise ConcurrentUseError("this sampler is in use by a call on this thread")
            close()

        samplers.close = refused_at_first  # type: ignore[method-assign]
        waiting.cancel()
        assert _finish_reasons(waiting) == ["cancelled"]
        gate.open.set()
        assert _finish_reasons(running)[-1] in ("length", "eos")
        assert _wait_for(lambda: len(closers) == 2)
        assert closers == [threading.current_thread().name, "llamacrab-engine"]


def _finish_reasons(stream: Stream[CompletionChunk], timeout: float = 30) -> list[str | None]:
    """The stream's finish reasons, read on a daemon thread: a stream never ended fails the
    test instead of hanging it."""
    reasons: list[str | None] = []
    reader = threading.Thread(target=lambda: reasons.extend(c.finish_reason for c in stream),
                              daemon=True)  # fmt: skip
    reader.start()
    reader.join(timeout)
    assert not reader.is_alive(), "the stream was never ended"
    return reasons


def _drain(stream: Iterator[object]) -> None:
    with contextlib.suppress(ClosedHandleError):
        for _ in stream:
            pass


def test_one_slot_only_features_are_refused_clearly(tiny_model_path: Path) -> None:
    with Llama(tiny_model_path, n_ctx=128, parallel=2) as llm:
        with pytest.raises(InvalidParameterError, match="parallel=None"):
            llm.save_state()
        with pytest.raises(InvalidParameterError, match="parallel=None"):
            llm.create_completion("x", speculative=PromptLookup())
    with pytest.raises(InvalidParameterError, match="embeddings"):
        Llama(tiny_model_path, embeddings=True, parallel=2)
    with pytest.raises(InvalidParameterError, match="parallel"):
        Llama(tiny_model_path, parallel=0)


@pytest.mark.real_model
def test_a_sequence_never_sees_the_other_sequences_of_its_batch(gemma_slots: Llama) -> None:
    context = gemma_slots.context
    prompts = [np.array(gemma_slots.tokenize(p), dtype=np.int32) for p in PROMPTS[:4]]
    batch = Batch(context.n_batch, 4)

    def first_sequence_logits(order: list[int]) -> np.ndarray:
        with gemma_slots._completer.lock:  # the engine thread is idle; keep it so
            context.clear()
            chosen = [prompts[i] for i in order]
            lengths = [len(p) for p in chosen]
            logits = np.zeros(sum(lengths), dtype=np.int8)
            logits[lengths[0] - 1] = 1
            positions = np.concatenate([np.arange(n) for n in lengths])
            batch.set_rows(np.concatenate(chosen), positions,
                           np.repeat(np.arange(4), lengths), logits)  # fmt: skip
            context.decode(batch)
            values = context.logits(lengths[0] - 1)
            context.clear()
        return values

    assert len({len(p) for p in prompts}) == 1  # same shape whatever the order
    same = first_sequence_logits([0, 1, 2, 3])
    assert np.array_equal(same, first_sequence_logits([0, 3, 1, 2]))
    assert np.array_equal(same, first_sequence_logits([0, 0, 0, 0]))
    assert not np.array_equal(same, first_sequence_logits([1, 0, 2, 3]))


def test_slots_share_a_prompt_cache(tiny_model_path: Path) -> None:
    cache = RamCache()
    with Llama(tiny_model_path, n_ctx=512, parallel=1, cache=cache) as llm:
        prompt = "the cat sat on the mat " * 10
        llm.create_completion(prompt, max_tokens=4, temperature=0)
        llm.create_completion("hello world " * 10, max_tokens=4)  # the slot now holds this
        again = llm.create_completion(prompt + "again", max_tokens=4, temperature=0)
        assert again.usage.cached_tokens >= len(llm.tokenize(prompt)) - 1  # from the cache
        assert len(cache) == 3


def test_candidates_of_one_request_share_the_slots(tiny_model_path: Path) -> None:
    gate = Gate()
    with Llama(tiny_model_path, n_ctx=4 * 128, parallel=4) as llm:
        scheduler = llm.scheduler
        assert scheduler is not None
        results: list[object] = []
        options = {"max_tokens": 3, "temperature": 1.0, "seed": 1, "custom_samplers": (gate,)}
        worker = threading.Thread(
            target=lambda: results.append(llm.create_completion("hi", n=4, **options))
        )
        worker.start()
        # All four are in the engine at once (one held by the gate, three queued behind it),
        # not submitted one after the other.
        assert _wait_for(lambda: scheduler.busy_slots + scheduler.queue_depth == 4)
        gate.open.set()
        worker.join(timeout=30)
        completion = results[0]
        assert isinstance(completion, Completion) and len(completion.choices) == 4


def test_a_stream_dropped_unread_stops_its_generation(tiny_model_path: Path) -> None:
    slow = Slow(0.05, gated=True)
    with Llama(tiny_model_path, n_ctx=2048, parallel=1) as llm:
        scheduler = llm.scheduler
        assert scheduler is not None
        # Once the gate opens it would take 2,000 tokens x 50 ms = 100 s.
        stream = llm.stream_completion("hi", max_tokens=None, min_tokens=2000,
                                       custom_samplers=(slow,))  # fmt: skip
        assert _wait_for(lambda: scheduler.busy_slots == 1)
        del stream
        gc.collect()
        slow.open.set()
        assert _wait_for(lambda: scheduler.busy_slots == 0, timeout=1)
        calls = slow.calls
        time.sleep(0.2)
        assert slow.calls == calls <= 20  # stopped, not merely paused


def test_a_burst_to_an_idle_engine_shares_its_first_step(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests reaching an idle engine a little apart (a server tokenizes each on its own
    thread) go into one first step together, so none waits a whole prompt decode for its
    first token; the window is widened here so that the test does not depend on timing."""
    from llamacrab._engine import scheduler
    from llamacrab._native.context import Context

    monkeypatch.setattr(scheduler, "GATHER_SECONDS", 0.5)
    monkeypatch.setattr(scheduler, "GATHER_LIMIT", 2.0)
    decoded: list[int] = []
    decode = Context.decode

    def counting(self: Context, batch: Batch, *args: object, **kwargs: object) -> None:
        decoded.append(batch.value.n_tokens)
        decode(self, batch, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Context, "decode", counting)
    with Llama(tiny_model_path, n_ctx=512, n_threads=1, parallel=4) as llm:
        prompts = PROMPTS[:3]
        lengths = [len(llm.tokenize(prompt)) for prompt in prompts]
        streams = []
        for prompt in prompts:
            streams.append(llm.stream_completion(prompt, max_tokens=2, temperature=0))
            time.sleep(0.05)  # apart, each within the (widened) window of the one before
        for stream in streams:
            assert list(stream)
    assert decoded[0] == sum(lengths), decoded[:3]


def test_a_decode_whose_jobs_all_stopped_is_aborted(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer that leaves (a Ctrl-C, a closed stream, a server client gone) while its
    prompt is decoded stops that decode, instead of the next request waiting for it; a cancel
    that comes just before the decode starts counts too."""
    streams: list[Stream[CompletionChunk]] = []

    def leave_at_the_prompt(batch: Batch) -> None:
        if batch.value.n_tokens > 1:
            streams[0].cancel()

    outcomes = record_decodes(monkeypatch, leave_at_the_prompt)
    with Llama(tiny_model_path, n_ctx=512, n_threads=1, parallel=2) as llm:
        streams.append(llm.stream_completion(PROMPTS[0] * 4, max_tokens=4, temperature=0))
        assert [chunk.finish_reason for chunk in streams[0]] == ["cancelled"]
        assert outcomes == ["aborted"]
        assert llm.held_tokens(slot=0) == llm.held_tokens(slot=1) == []  # none left half-made
        assert llm.create_completion(PROMPTS[1], max_tokens=2).choices[0].finish_reason == "length"


def test_a_decode_goes_on_for_the_jobs_that_did_not_stop(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llamacrab._engine import scheduler

    monkeypatch.setattr(scheduler, "GATHER_SECONDS", 0.5)  # both prompts in one decode
    monkeypatch.setattr(scheduler, "GATHER_LIMIT", 2.0)
    streams: list[Stream[CompletionChunk]] = []

    def leave_at_the_prompts(batch: Batch) -> None:
        if batch.output_sequences() == {0, 1} and batch.value.n_tokens > 2:
            streams[0].cancel()

    outcomes = record_decodes(monkeypatch, leave_at_the_prompts)
    with Llama(tiny_model_path, n_ctx=512, n_threads=1, parallel=2) as llm:
        for prompt in PROMPTS[:2]:
            streams.append(llm.stream_completion(prompt, max_tokens=4, min_tokens=4))
        assert [chunk.finish_reason for chunk in streams[0]][-1] == "cancelled"
        assert [chunk.finish_reason for chunk in streams[1]][-1] == "length"
        assert outcomes[0] == "decoded"
        assert "aborted" not in outcomes


@pytest.mark.parametrize("leave", ["cancel", "event", "timeout"])
def test_leaving_during_a_long_prompt_stops_its_decode(
    gemma_path: Path, monkeypatch: pytest.MonkeyPatch, leave: str
) -> None:
    """The consumer leaves while its prompt is decoded: a Ctrl-C in its wait for the first
    token cancels the stream on its way out, a server sets the event it passed as ``cancel``
    when its client goes, or its ``timeout`` passes. The engine's decode aborts instead of
    running on (and the next request waiting for it)."""
    started = threading.Event()

    def mark(batch: Batch) -> None:
        if batch.value.n_tokens > 1:
            started.set()

    outcomes = record_decodes(monkeypatch, mark)
    event = threading.Event()
    with Llama(gemma_path, n_ctx=4096, n_batch=2048, n_ubatch=2048, n_threads=2,
               parallel=2, graph_sampling="off") as llm:  # fmt: skip
        stream = llm.stream_completion(
            "the cat sat on the mat. " * 250, max_tokens=1, cancel=event,
            timeout=0.5 if leave == "timeout" else None,
        )  # fmt: skip
        consumer = threading.Thread(target=lambda: list(stream))
        consumer.start()
        assert started.wait(30)
        if leave != "timeout":
            time.sleep(0.2)  # inside the decode: ~1,750 tokens take seconds on a CPU
            stream.cancel() if leave == "cancel" else event.set()
        consumer.join(timeout=30)
        assert outcomes == ["aborted"]


def _outputs_by_sequence(batch: Batch) -> dict[int, int]:
    """How many rows of each sequence ask for logits in ``batch``."""
    value = batch.value
    counts: dict[int, int] = {}
    for row in range(value.n_tokens):
        if value.logits[row]:
            seq_id = int(value.seq_id[row][0])
            counts[seq_id] = counts.get(seq_id, 0) + 1
    return counts


def test_prompt_logprobs_leave_the_slot_holding_their_prompt(tiny_model_path: Path) -> None:
    # They decode the whole prompt again, reusing nothing: they took the slot whose memory
    # could serve the prompt most, and whatever it held for a later request was lost.
    with Llama(tiny_model_path, parallel=2, n_ctx=1024, n_threads=1) as llm:
        prompt = PROMPTS[0] * 3
        held = llm.create_completion(prompt, max_tokens=1).choices[0].slot
        echo = llm.create_completion(prompt, echo=True, logprobs=1, max_tokens=0)
        assert echo.choices[0].slot not in (None, held)
        again = llm.create_completion(prompt, max_tokens=1)
        assert again.choices[0].slot == held and again.usage.cached_tokens > 0


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_prompt_logprobs_on_parallel_slots_equal_one_slots(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch, max_tokens: int
) -> None:
    """echo with logprobs on parallel slots (what a server always runs; it was refused): the
    prompt's tokens get the values one slot gives them, read in decodes of a bounded number
    of rows that another slot's generation shares, whose text stays what it is alone; a
    prompt the slot holds is decoded again for its logits, as on one slot."""
    rows = 16
    monkeypatch.setattr("llamacrab._engine.logprobs._PROMPT_LOGITS_BYTES", rows * 4 * 271)
    prompt, other = PROMPTS[0] * 3, PROMPTS[1]
    options = {"echo": True, "logprobs": 2, "max_tokens": max_tokens, "temperature": 0}
    settings = {"n_ctx": 1024, "n_threads": 1, "graph_sampling": "off"}
    with Llama(tiny_model_path, **settings) as one:  # type: ignore[arg-type]
        assert one.vocab.n_tokens == 271
        expected = one.create_completion(prompt, **options).choices[0]
    batches: list[dict[int, int]] = []
    record_decodes(monkeypatch, lambda batch: batches.append(_outputs_by_sequence(batch)))
    with Llama(tiny_model_path, parallel=2, **settings) as llm:  # type: ignore[arg-type]
        lone = llm.create_completion(other, max_tokens=40, min_tokens=40, temperature=0).text
        llm.create_completion(prompt, max_tokens=1)  # held by a slot: decoded again anyway
        batches.clear()
        stream = llm.stream_completion(other, max_tokens=40, min_tokens=40, temperature=0,
                                       custom_samplers=(Slow(0.01),))  # fmt: skip
        text = next(stream).text  # generating now, on the other slot
        result = llm.create_completion(prompt, **options)
        text += "".join(chunk.text for chunk in stream)
        n = len(llm.tokenize(prompt))  # the first (a BOS) without values: nothing rates it
    assert text == lone
    choice = result.choices[0]
    assert choice.text == expected.text and result.usage.cached_tokens == 0
    got, want = choice.logprobs, expected.logprobs
    assert got is not None and want is not None
    assert len(got.tokens) == n + max_tokens and got.tokens == want.tokens
    assert got.text_offset == want.text_offset
    assert got.token_logprobs[0] is None is want.token_logprobs[0]
    np.testing.assert_allclose(got.token_logprobs[1:], want.token_logprobs[1:], rtol=0, atol=1e-4)
    for mine, theirs in zip(got.top_logprobs[1:], want.top_logprobs[1:], strict=True):
        assert mine is not None and theirs is not None
        assert mine.keys() == theirs.keys() and len(mine) == 2
        np.testing.assert_allclose(list(mine.values()), list(theirs.values()), rtol=0, atol=1e-4)
    scored = choice.slot
    shared = [b for b in batches if len(b) == 2 and b.get(scored, 0) > 1]
    assert len(shared) >= 2  # the prompt's rows, read beside the other slot's next token
    assert max(b.get(scored, 0) for b in batches) == rows  # never more rows than one slot reads
    assert all(b.get(1 - scored, 0) <= 1 for b in batches)  # the other slot's rows unchanged


def test_a_job_hands_over_its_last_step_even_when_its_samplers_refuse_to_close() -> None:
    # Seen in CI under churn: a stream's finalizer cancelled a waiting job while its thread was
    # inside a sampler call; the refused close skipped the last step, so its client (and the
    # server's exit) waited for ever.
    class Refusing:
        def close(self) -> None:
            raise ConcurrentUseError("this sampler is in use")

    job = _Job(Request([1]), Refusing(), Session(), None)  # type: ignore[arg-type]
    last = Step("", None, "cancelled")
    with pytest.raises(ConcurrentUseError):
        job.finish(last)
    assert job.steps.get_nowait() is last
