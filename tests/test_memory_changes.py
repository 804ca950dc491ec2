"""A generation whose KV memory is changed under it (context.clear(), remove, ...) ends
"cancelled", as after llm.reset(), and nothing believes the changed memory still holds it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from llamacrab import Llama
from llamacrab._native.context import Context

from support import Slow

PROMPT = "one two three four five six seven eight nine ten eleven twelve"

CHANGES: dict[str, Callable[[Context, int], object]] = {
    "clear": lambda context, seq: context.clear(),
    "remove a hole": lambda context, seq: context.remove(seq, 5, 10),
    "remove the start": lambda context, seq: context.remove(seq, 0, 3),
    "remove the end": lambda context, seq: context.remove(seq, 5, -1),
    "shift": lambda context, seq: context.shift(seq, 1),
    "divide": lambda context, seq: context.divide(seq, 2),
    "load a state": lambda context, seq: context.load_state_bytes(context.state_bytes(seq), seq),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_stream_ends_cancelled_when_its_memory_changes_under_it(
    tiny_llama: Llama, change: str
) -> None:
    stream = tiny_llama.stream_completion(PROMPT, max_tokens=12, temperature=0)
    first = next(stream)
    assert first.finish_reason is None
    CHANGES[change](tiny_llama.context, 0)
    rest = list(stream)
    assert [chunk.finish_reason for chunk in rest] == ["cancelled"]
    # Nothing of the changed memory is reused: the prompt is decoded whole again.
    again = tiny_llama.create_completion(PROMPT, max_tokens=1, temperature=0)
    assert again.usage.cached_tokens == 0


def test_a_change_after_a_generation_is_not_reused_nor_saved(tiny_llama: Llama) -> None:
    tiny_llama.create_completion(PROMPT, max_tokens=4, temperature=0)
    assert tiny_llama.create_completion(PROMPT, max_tokens=1).usage.cached_tokens > 0
    tiny_llama.context.remove(0, 2, 4)
    assert tiny_llama.save_state().tokens == ()  # the memory no longer holds what it said
    assert tiny_llama.create_completion(PROMPT, max_tokens=1).usage.cached_tokens == 0


def test_the_engine_own_changes_keep_the_prefix(tiny_llama: Llama) -> None:
    """A prompt that shares part of the last one reuses it: removing the rest is the engine's."""
    tiny_llama.create_completion(PROMPT, max_tokens=4, temperature=0)
    other = PROMPT.replace("twelve", "thirteen fourteen")
    assert tiny_llama.create_completion(other, max_tokens=4).usage.cached_tokens > 0
    assert tiny_llama.create_completion(PROMPT, max_tokens=4).usage.cached_tokens > 0


def test_a_parallel_slot_ends_cancelled_when_its_memory_changes(tiny_model_path: Path) -> None:
    with Llama(tiny_model_path, n_ctx=512, n_threads=2, parallel=2) as llm:
        scheduler = llm.scheduler
        assert scheduler is not None
        # 5 s of tokens at least: the change below lands while it runs, on a loaded machine
        # too (0.4 s was once all gone before this thread took the lock); ended, it costs none.
        stream = llm.stream_completion(
            PROMPT, max_tokens=100, temperature=0, custom_samplers=(Slow(0.05),)
        )
        next(stream)
        slot = stream.session.slot
        assert slot is not None
        with scheduler.lock:  # between two steps of the engine
            llm.context.remove(1 - slot, 0, -1)  # another slot's memory: nothing to it
            llm.context.remove(slot, 3, 6)
        reasons = [chunk.finish_reason for chunk in stream]
        assert reasons[-1] == "cancelled"
        assert len(reasons) < 30
        assert llm.create_completion(PROMPT, max_tokens=1).usage.cached_tokens == 0


@pytest.mark.parametrize("change", CHANGES)
def test_slots_report_nothing_held_after_a_change_without_touching_the_memory(
    tiny_llama: Llama, change: str
) -> None:
    """slots() and held_tokens() went on reporting the tokens of the last generation after
    context.clear() or remove(); what the memory holds then is not known (no prompt reuses
    it, save_state() records none), and reading the slots changes nothing of it."""
    tiny_llama.create_completion(PROMPT, max_tokens=4, temperature=0)
    held = tiny_llama.held_tokens()
    assert tiny_llama.slots()[0].n_tokens == len(held) > 5
    context = tiny_llama.context
    CHANGES[change](context, 0)
    positions, generation = context.positions(0), context.memory_generation(0)
    assert tiny_llama.slots()[0].n_tokens == 0
    assert tiny_llama.held_tokens() == []
    assert (context.positions(0), context.memory_generation(0)) == (positions, generation)
    # The next generation holds its own tokens again.
    tiny_llama.create_completion(PROMPT, max_tokens=4, temperature=0)
    assert tiny_llama.held_tokens() == held
    assert tiny_llama.slots()[0].n_tokens == len(held)


def test_parallel_slots_report_nothing_held_after_a_change(tiny_model_path: Path) -> None:
    with Llama(tiny_model_path, n_ctx=512, n_threads=2, parallel=2) as llm:
        slot = llm.create_completion(PROMPT, max_tokens=4, temperature=0).choices[0].slot
        assert slot is not None
        held = llm.held_tokens(slot=slot)
        assert llm.slots()[slot].n_tokens == len(held) > 5
        llm.context.remove(slot, 5, -1)
        assert llm.slots()[slot].n_tokens == 0
        assert llm.held_tokens(slot=slot) == []
        assert llm.context.positions(slot) == (0, 4)  # left as the change left it
