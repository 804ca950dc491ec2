"""A prompt's decode (or an image's encode) that nobody waits for any more is aborted while it
runs: on one slot and on parallel slots, by cancel(), a timeout or a caller's event; and a
cancel meant for one call never lands on the next one (_engine/decode_watch.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from llamacrab import CompletionChunk, Image, Llama, Stream
from llamacrab._native.batch import Batch
from llamacrab._native.context import Context

from support import load_repo_module, record_decodes

LONG_PROMPT = "the cat sat on the mat. " * 250  # ~1,750 Gemma tokens: one chunk of seconds
SHORT_PROMPT = "one two three four five"


@pytest.mark.parametrize("leave", ["timeout", "event", "Llama.cancel"])
def test_a_one_slot_prompt_chunk_stops_at_a_timeout_an_event_or_a_cancel(
    gemma_path: Path, monkeypatch: pytest.MonkeyPatch, leave: str
) -> None:
    """Only a cancel() aborted the chunk in flight: a timeout or a set ``cancel`` event (a
    server's client gone) waited for the chunk's end, n_batch tokens, seconds on a CPU.
    Llama.cancel() still does, now through the decode watch."""
    started = threading.Event()
    event = threading.Event()

    def mark(batch: Batch) -> None:
        if batch.value.n_tokens > 1:
            started.set()

    with Llama(gemma_path, n_ctx=4096, n_batch=2048, n_ubatch=2048, n_threads=2,
               graph_sampling="off") as llm:  # fmt: skip

        def leave_in_the_decode() -> None:
            if started.wait(30):
                time.sleep(0.2)
                if leave == "event":
                    event.set()
                else:
                    llm.cancel()

        outcomes = record_decodes(monkeypatch, mark)
        if leave != "timeout":
            threading.Thread(target=leave_in_the_decode, daemon=True).start()
        began = time.monotonic()
        result = llm.create_completion(
            LONG_PROMPT, max_tokens=1, cancel=event,
            timeout=0.3 if leave == "timeout" else None,
        )  # fmt: skip
        took = time.monotonic() - began
        assert result.choices[0].finish_reason == "cancelled"
        assert outcomes == ["aborted"], f"the prompt's decode ran its course ({took:.2f} s)"
        assert took < 2.0  # the whole chunk takes 6 s here, on 2 busy cores
        # The decode after it is the next request's own.
        after = llm.create_completion(SHORT_PROMPT, max_tokens=2, min_tokens=2, temperature=0)
        assert after.choices[0].finish_reason == "length"
        assert "aborted" not in outcomes[1:]


# -- a cancel that comes late ------------------------------------------------------------------

# The threads that decode: a one-slot generation's consumer (here the test's) and the engine.
DECODERS = {"MainThread", "llamacrab-engine"}
PATIENCE = 0.5  # how long a late cancel waits for the next call


class LateCancels:
    """Every Context.cancel() from a thread that does not decode (a watcher, a thread calling
    Stream.cancel()) is held, as if that thread were preempted just before it, until the call
    after the first one armed from now on is armed (at most PATIENCE seconds). At the first
    arming, ``at_first()`` runs; the next arming waits for a held cancel to land."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at_first: Callable[[], None]) -> None:
        self.at_first = at_first
        self.armed = 0
        self.held = threading.Event()  # a cancel is held now
        self.next_armed = threading.Event()
        self.landed = threading.Event()
        cancel, arm = Context.cancel, Context.arm_cancel

        def late_cancel(context: Context) -> None:
            if threading.current_thread().name not in DECODERS:
                self.held.set()
                self.next_armed.wait(PATIENCE)
                cancel(context)
                self.landed.set()
                return
            cancel(context)

        def counted_arm(context: Context) -> None:
            arm(context)
            self.armed += 1
            if self.armed == 1:
                self.at_first()
            else:
                self.next_armed.set()
                self.landed.wait(2 * PATIENCE)

        monkeypatch.setattr(Context, "cancel", late_cancel)
        monkeypatch.setattr(Context, "arm_cancel", counted_arm)

    def wait_held(self) -> None:
        assert self.held.wait(10), "no cancel came"


@pytest.mark.parametrize("canceller", ["Stream.cancel", "Llama.cancel"])
def test_a_late_cancel_of_a_one_slot_prompt_spares_the_next_prompt(
    tiny_llama: Llama, monkeypatch: pytest.MonkeyPatch, canceller: str
) -> None:
    """Stream.cancel() or Llama.cancel() from another thread, preempted between reading what
    to call and calling it, cancelled the next generation's prompt instead (Llama.cancel()
    cancelled the context itself, not through the running session's decode watch)."""
    streams: list[Stream[CompletionChunk]] = []

    def cancel_from_another_thread() -> None:
        cancel = streams[0].cancel if canceller == "Stream.cancel" else tiny_llama.cancel
        threading.Thread(target=cancel, daemon=True).start()
        late.wait_held()

    late = LateCancels(monkeypatch, cancel_from_another_thread)
    streams.append(tiny_llama.stream_completion(SHORT_PROMPT, max_tokens=4))
    assert [chunk.finish_reason for chunk in streams[0]][-1] == "cancelled"
    after = tiny_llama.create_completion(SHORT_PROMPT + " six", max_tokens=2, min_tokens=2)
    assert after.choices[0].finish_reason == "length"


def test_a_late_watcher_spares_the_next_decode_of_parallel_slots(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watcher of a prompt's decode saw its job's event set, then ran late: its cancel
    aborted the next request's decode."""
    event = threading.Event()

    def leave_at_the_prompt() -> None:
        event.set()
        late.wait_held()  # the watcher saw it and is about to cancel

    with Llama(tiny_model_path, n_ctx=512, n_threads=1, parallel=2) as llm:
        late = LateCancels(monkeypatch, leave_at_the_prompt)
        stream = llm.stream_completion(SHORT_PROMPT, max_tokens=4, cancel=event)
        assert [chunk.finish_reason for chunk in stream][-1] == "cancelled"
        after = llm.create_completion(SHORT_PROMPT, max_tokens=2, min_tokens=2)
        assert after.choices[0].finish_reason == "length"


@pytest.fixture(scope="module")
def media_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tiny = load_repo_module("scripts/make_tiny_gguf.py")
    mmproj = load_repo_module("scripts/make_tiny_mmproj.py")
    out = tmp_path_factory.mktemp("watch-media")
    return {
        "text": tiny.write_tiny_llama(out / "text.gguf"),
        "vision": mmproj.write_tiny_vision_mmproj(out / "vision.gguf"),
        # about a second's encode on one thread
        "slow": mmproj.write_tiny_gemma3_mmproj(
            out / "slow.gguf", merge=16, vision=mmproj.SLOW_VISION
        ),
    }


PIXELS = np.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=np.uint8)


@pytest.fixture
def two_image_streams(
    media_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[], list[Stream[CompletionChunk]]]]:
    from llamacrab._engine import scheduler

    monkeypatch.setattr(scheduler, "GATHER_SECONDS", 0.5)  # both in the engine's first step
    monkeypatch.setattr(scheduler, "GATHER_LIMIT", 2.0)
    with Llama(media_files["text"], n_ctx=1024, n_threads=1, parallel=2,
               mmproj=media_files["vision"]) as llm:  # fmt: skip

        def start() -> list[Stream[CompletionChunk]]:
            options = {"max_tokens": 2, "min_tokens": 2, "media": [Image(pixels=PIXELS)]}
            prompts = [f"look {i} {llm.media_marker} now" for i in range(2)]
            return [llm.stream_completion(prompt, **options) for prompt in prompts]

        yield start


def test_a_late_cancel_of_an_image_encode_spares_the_next_slot_encode(
    two_image_streams: Callable[[], list[Stream[CompletionChunk]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stream.cancel() during slot 0's image encode, preempted before its cancel, aborted
    slot 1's encode, which the same engine step began next."""
    streams: list[Stream[CompletionChunk]] = []
    encoded_first: list[Stream[CompletionChunk]] = []

    def cancel_slot_0() -> None:
        encoded_first.append(next(s for s in streams if s.session.slot == 0))
        threading.Thread(target=encoded_first[0].cancel, daemon=True).start()
        late.wait_held()

    late = LateCancels(monkeypatch, cancel_slot_0)
    streams.extend(two_image_streams())
    reasons = [[chunk.finish_reason for chunk in s][-1] for s in streams]
    assert reasons[streams.index(encoded_first[0])] == "cancelled"
    assert sorted(reasons) == ["cancelled", "length"]


@pytest.mark.parametrize("parallel", [None, 2])
def test_a_timeout_stops_an_image_encode_in_the_middle(
    media_files: dict[str, Path], parallel: int | None
) -> None:
    """Before, only cancel() and closing did: a timeout waited for the whole encode."""
    with Llama(media_files["text"], n_ctx=512, n_threads=1, mmproj=media_files["slow"],
               parallel=parallel) as llm:  # fmt: skip
        prompt = f"look {llm.media_marker} now"
        began = time.monotonic()
        whole = llm.create_completion(prompt, media=[Image(pixels=PIXELS)], max_tokens=1)
        took_whole = time.monotonic() - began
        assert whole.choices[0].finish_reason == "length"
        assert took_whole > 0.5, f"the slow projector encodes in {took_whole:.2f} s: too fast"
        began = time.monotonic()
        result = llm.create_completion(
            prompt, media=[Image(pixels=PIXELS)], max_tokens=1, timeout=0.1
        )
        took = time.monotonic() - began
        assert result.choices[0].finish_reason == "cancelled"
        assert took < 0.1 + took_whole / 4, (took, took_whole)
