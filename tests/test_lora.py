"""LoRA adapters: applied, scaled, removed, and never left dangling in a context."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from llamacrab import (
    ClosedHandleError,
    ConcurrentUseError,
    InvalidParameterError,
    Llama,
    LoraAdapter,
    RamCache,
    SavedState,
)
from llamacrab._engine import generation
from llamacrab._engine.lora import LoraPlan

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")

PROMPT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def lora_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.write_tiny_lora(tmp_path_factory.mktemp("lora") / "tiny-lora.gguf")


def prompt_logits(llm: Llama) -> np.ndarray:
    llm.create_completion("the cat sat", max_tokens=0)
    return llm.context.logits()


def test_adapter_changes_the_output_and_removing_it_restores_it(
    tiny_llama: Llama, lora_path: Path
) -> None:
    base = prompt_logits(tiny_llama)
    adapter = tiny_llama.load_lora(lora_path)
    assert adapter.metadata["adapter.type"] == "lora"
    adapted = prompt_logits(tiny_llama)
    assert not np.allclose(base, adapted)
    tiny_llama.set_lora_adapters({adapter: 0.0})
    assert np.allclose(prompt_logits(tiny_llama), base, atol=1e-5)
    tiny_llama.set_lora_adapters({})
    assert np.array_equal(prompt_logits(tiny_llama), base)


def test_closing_an_adapter_removes_it_from_contexts(tiny_llama: Llama, lora_path: Path) -> None:
    base = prompt_logits(tiny_llama)
    adapter = tiny_llama.load_lora(lora_path)
    adapter.close()
    assert tiny_llama.context.lora_adapters == {}
    tiny_llama.reset()
    assert np.array_equal(prompt_logits(tiny_llama), base)
    with pytest.raises(ClosedHandleError):
        tiny_llama.set_lora_adapters({adapter: 1.0})


def test_a_stream_ends_when_its_adapters_change_under_it(
    tiny_llama: Llama, lora_path: Path
) -> None:
    adapter = tiny_llama.load_lora(lora_path)
    stream = tiny_llama.stream_completion(PROMPT, max_tokens=8, min_tokens=8)
    first = next(stream)
    assert first.finish_reason is None
    adapter.close()  # between two steps, from the consuming thread
    assert [chunk.finish_reason for chunk in stream][-1] == "cancelled"
    assert tiny_llama.create_completion(PROMPT, max_tokens=2).usage.cached_tokens == 0


def test_adapter_of_another_model_is_refused(
    tiny_llama: Llama, tiny_model_path: Path, lora_path: Path
) -> None:
    with Llama(tiny_model_path, n_ctx=64) as other:
        foreign = LoraAdapter(other.model, lora_path)
        with pytest.raises(InvalidParameterError, match="another model"):
            tiny_llama.set_lora_adapters({foreign: 1.0})
    assert foreign.closed  # closed with its model


def test_closing_an_adapter_leaves_no_kv_computed_with_it(
    tiny_llama: Llama, lora_path: Path
) -> None:
    base = tiny_llama.create_completion(PROMPT, max_tokens=0)
    base_logits = tiny_llama.context.logits()
    tiny_llama.reset()
    adapter = tiny_llama.load_lora(lora_path)
    tiny_llama.create_completion(PROMPT, max_tokens=0)  # the memory holds PROMPT, adapted
    adapter.close()  # through the context alone: the Llama does not see it
    again = tiny_llama.create_completion(PROMPT, max_tokens=0)
    assert again.usage.cached_tokens == 0 == base.usage.cached_tokens
    assert np.array_equal(tiny_llama.context.logits(), base_logits)


def test_closing_an_adapter_leaves_no_kv_computed_with_it_in_any_slot(
    tiny_model_path: Path, lora_path: Path
) -> None:
    greedy = {"max_tokens": 4, "temperature": 0.0}
    with Llama(tiny_model_path, n_ctx=256, n_batch=32, n_threads=2, parallel=2) as llm:
        base = llm.create_completion(PROMPT, **greedy)
        adapter = llm.load_lora(lora_path)
        llm.create_completion(PROMPT, n=2, max_tokens=0)  # both slots hold PROMPT, adapted
        adapter.close()
        again = llm.create_completion(PROMPT, **greedy)
        assert again.usage.cached_tokens == 0
        assert again.choices[0].tokens == base.choices[0].tokens


def test_prompt_cache_keeps_states_per_adapter_set_and_scale(
    tiny_model_path: Path, lora_path: Path, tmp_path: Path
) -> None:
    cache = RamCache(capacity_bytes=64 << 20)
    with Llama(tiny_model_path, n_ctx=128, n_threads=2, cache=cache) as llm:
        reusable = len(llm.tokenize(PROMPT)) - 1  # the last token is decoded for its logits

        def cached_tokens() -> int:
            llm.reset()  # the memory is empty: only the cache can help
            return llm.create_completion(PROMPT, max_tokens=0).usage.cached_tokens

        adapter = llm.load_lora(lora_path)
        assert cached_tokens() == 0  # stored under the adapter at scale 1
        llm.set_lora_adapters({})
        assert cached_tokens() == 0
        llm.set_lora_adapters({adapter: 0.5})
        assert cached_tokens() == 0
        llm.set_lora_adapters({adapter: 1.0})
        assert cached_tokens() == reusable
        adapter.close()
        assert cached_tokens() == reusable  # stored without adapters above
        copy = tmp_path / "lora.gguf"
        copy.write_bytes(lora_path.read_bytes())
        same = llm.load_lora(copy)  # the same bytes elsewhere: adapters are told apart by file
        assert cached_tokens() == 0
        same.close()
        tiny.write_tiny_lora(copy, seed=2)  # the same path, rewritten
        llm.load_lora(copy)
        assert cached_tokens() == 0


def test_prompt_cache_keeps_states_per_rope_setting(tiny_model_path: Path) -> None:
    cache = RamCache(capacity_bytes=64 << 20)
    with Llama(tiny_model_path, n_ctx=128, n_threads=2, cache=cache) as llm:
        llm.create_completion(PROMPT, max_tokens=0)
        reusable = len(llm.tokenize(PROMPT)) - 1
    with Llama(tiny_model_path, n_ctx=128, n_threads=2, cache=cache, rope_freq_base=500.0) as llm:
        assert llm.create_completion(PROMPT, max_tokens=0).usage.cached_tokens == 0
    with Llama(tiny_model_path, n_ctx=128, n_threads=2, cache=cache) as llm:
        assert llm.create_completion(PROMPT, max_tokens=0).usage.cached_tokens == reusable


def test_adapters_are_not_changed_under_running_generations(
    tiny_model_path: Path, lora_path: Path
) -> None:
    with Llama(tiny_model_path, n_ctx=256, n_threads=2, parallel=2) as llm:
        adapter = llm.load_lora(lora_path)
        scheduler = llm.scheduler
        assert scheduler is not None
        with scheduler.lock:  # the engine waits: the generation stays queued or running
            stream = llm.stream_completion(PROMPT, max_tokens=4)
            with pytest.raises(ConcurrentUseError, match="running on the parallel slots"):
                llm.set_lora_adapters({})
            with pytest.raises(ConcurrentUseError, match="running on the parallel slots"):
                adapter.close()
            assert llm.context.lora_adapters == {adapter: 1.0} and not adapter.closed
        assert [chunk.finish_reason for chunk in stream][-1] in ("length", "eos")
        adapter.close()  # idle now
        assert llm.context.lora_adapters == {}


def test_an_adapter_closed_while_a_request_applies_it_is_never_decoded_with(
    tiny_llama: Llama, lora_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The window: llama.cpp has taken the adapter's pointer for this request, but the context
    # has not yet recorded it, so close() finds nothing to detach and frees the adapter.
    from llamacrab._native import context as context_module

    adapter = tiny_llama.load_lora(lora_path)
    tiny_llama.set_lora_adapters({})  # open, but only this request uses it
    real_call = context_module.call
    applying = threading.Event()
    calls: list[str] = []

    def watched(name: str, *args: object) -> object:
        calls.append(name)
        if name == "llama_set_adapters_lora" and not applying.is_set():
            applying.set()
            time.sleep(0.3)  # close() now runs on the other thread
        return real_call(name, *args)

    monkeypatch.setattr(context_module, "call", watched)
    closer = threading.Thread(target=lambda: (applying.wait(10), adapter.close()))
    closer.start()
    with pytest.raises(ClosedHandleError):
        tiny_llama.create_completion(PROMPT, max_tokens=1, lora={adapter: 1.0})
    closer.join()
    assert "llama_decode" not in calls[calls.index("llama_set_adapters_lora") :]
    monkeypatch.undo()
    assert tiny_llama.create_completion(PROMPT, max_tokens=2).text  # still usable


# -- saved states ------------------------------------------------------------------------------


def test_a_loaded_state_is_reused_only_with_the_adapters_it_was_computed_with(
    tiny_model_path: Path, lora_path: Path
) -> None:
    # A state recorded nothing of its adapters: loaded, it counted as computed with the
    # default set, so one computed without the adapter answered the next default prompt.
    with Llama(tiny_model_path, n_ctx=128, n_threads=2, graph_sampling="off",
               lora=[(lora_path, 1.0)]) as llm:  # fmt: skip
        (adapter,) = llm.adapters
        reusable = len(llm.tokenize(PROMPT)) - 1  # the last token is decoded for its logits
        off = {adapter: 0.0}

        def run(lora: dict[LoraAdapter, float] | None = None) -> tuple[int, np.ndarray]:
            cached = llm.create_completion(PROMPT, max_tokens=0, lora=lora).usage.cached_tokens
            return cached, llm.context.logits()

        def saved(lora: dict[LoraAdapter, float] | None = None) -> SavedState:
            llm.reset()
            run(lora)
            return llm.save_state()

        def restored(state: SavedState, lora: dict[LoraAdapter, float] | None = None) -> int:
            llm.reset()
            llm.load_state(state)
            return run(lora)[0]

        fresh = saved()
        without = saved(off)  # one request's own set: the adapter off
        default_logits, off_logits = run()[1], run(off)[1]  # each decoded afresh
        assert not np.allclose(default_logits, off_logits)
        assert restored(without) == 0  # the default set: decoded again, as if fresh
        assert np.array_equal(llm.context.logits(), default_logits)
        assert restored(without, off) == reusable  # its own set reuses it
        assert np.allclose(llm.context.logits(), off_logits, atol=1e-5)
        assert restored(fresh) == reusable and restored(without, {}) == reusable
        # Saved under the default set, loaded after the defaults changed.
        llm.set_lora_adapters({adapter: 0.5})
        assert restored(fresh) == 0
        answered = llm.context.logits()
        llm.reset()
        assert np.array_equal(answered, run()[1])  # as a fresh prompt under scale 0.5
        # A default scale of 0 is the base model, whichever way it is asked for (before, the
        # loaded state carried the zero-scale entry and no prompt's set ever matched it).
        llm.set_lora_adapters({adapter: 0.0})
        assert restored(fresh) == 0
        at_zero = saved()
        assert restored(at_zero) == reusable and restored(without) == reusable
        assert restored(at_zero, {}) == reusable and restored(at_zero, {adapter: 1.0}) == 0


def test_a_request_goes_to_the_slot_whose_memory_it_can_reuse(
    tiny_model_path: Path, lora_path: Path
) -> None:
    # Slots were picked by shared tokens alone: a longer prefix computed without the adapter
    # won over a shorter one computed with it, and the request reused nothing.
    short = "the cat sat on the mat"
    long = short + " and the dog sat on the cat"
    with Llama(tiny_model_path, n_ctx=512, parallel=2, n_threads=2,
               lora=[(str(lora_path), 1.0)]) as llm:  # fmt: skip
        (adapter,) = llm.adapters
        assert llm.tokenize(long)[: len(llm.tokenize(short))] == llm.tokenize(short)
        llm.create_completion(short, max_tokens=1, temperature=0.0)  # with the adapter
        (holder,) = [slot.id for slot in llm.slots() if slot.n_tokens]
        moved = llm.save_state(slot=holder)
        llm.reset(slot=holder)
        llm.load_state(moved, slot=1 - holder)
        # Without the adapter, the longer prompt: into the empty slot, not over the other.
        llm.create_completion(long, lora={adapter: 0.0}, max_tokens=1, temperature=0.0)
        assert [slot.n_tokens > 0 for slot in llm.slots()] == [True, True]
        # With it again: the slot computed with it, though the other shares more tokens.
        again = llm.create_completion(long, max_tokens=1, temperature=0.0)
        assert again.usage.cached_tokens == len(llm.tokenize(short)) > 1


def test_a_requests_adapter_plan_is_made_once_not_per_free_slot(
    tiny_model_path: Path, lora_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine thread made it for every free slot it weighed, then again to prepare one:
    # for an aLoRA adapter a search of the prompt each time.
    made: list[int] = []
    plan = generation.lora_plan

    def counted(*args: object) -> LoraPlan:
        made.append(1)
        return plan(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(generation, "lora_plan", counted)
    with Llama(tiny_model_path, n_ctx=512, parallel=4, n_threads=2,
               lora=[(str(lora_path), 1.0)]) as llm:  # fmt: skip
        (adapter,) = llm.adapters
        made.clear()
        for lora in (None, {adapter: 0.5}):
            llm.create_completion("the cat sat", lora=lora, max_tokens=1, temperature=0.0)
        assert len(made) == 2


def test_a_slot_saved_after_the_adapters_changed_records_the_ones_it_was_computed_with(
    tiny_model_path: Path, lora_path: Path
) -> None:
    with Llama(tiny_model_path, n_ctx=256, n_threads=2, parallel=2,
               lora=[(lora_path, 1.0)]) as llm:  # fmt: skip
        (adapter,) = llm.adapters
        reusable = len(llm.tokenize(PROMPT)) - 1
        llm.create_completion(PROMPT, max_tokens=0)
        (slot,) = [s.id for s in llm.slots() if s.n_tokens]
        llm.set_lora_adapters({adapter: 0.5})
        stale = llm.save_state(slot=slot)  # the memory of scale 1, saved under 0.5

        def restored() -> int:
            llm.reset()
            llm.load_state(stale, slot=0)
            return llm.create_completion(PROMPT, max_tokens=0).usage.cached_tokens

        assert restored() == 0
        llm.set_lora_adapters({adapter: 1.0})
        assert restored() == reusable


def test_a_loaded_state_is_not_reused_under_another_control_vector(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    vector = tiny.write_tiny_control_vector(tmp_path / "cvec.gguf")
    with Llama(tiny_model_path, n_ctx=128, n_threads=2) as llm:
        reusable = len(llm.tokenize(PROMPT)) - 1
        llm.create_completion(PROMPT, max_tokens=0)
        plain = llm.save_state()

        def restored() -> int:
            llm.load_state(plain)
            return llm.create_completion(PROMPT, max_tokens=0).usage.cached_tokens

        llm.set_control_vector([vector])
        assert restored() == 0
        llm.set_control_vector(None)
        assert restored() == reusable
