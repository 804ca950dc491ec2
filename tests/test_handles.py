"""Handle lifetimes: freed once, children first, in any GC order; closed handles never reach C."""

from __future__ import annotations

import gc
import itertools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from llamacrab import (
    Batch,
    ClosedHandleError,
    Context,
    ContextParams,
    InvalidParameterError,
    Llama,
    Model,
    SamplerChain,
    SamplingOptions,
    TokenizeError,
)
from llamacrab._native import handle
from llamacrab._native.handle import NativeHandle, address

Frees = list[tuple[str, int]]


@pytest.fixture
def frees(monkeypatch: pytest.MonkeyPatch) -> Frees:
    """Every native free, in order: (kind, address)."""
    seen: Frees = []
    monkeypatch.setattr(handle, "free_observer", lambda kind, at: seen.append((kind, at)))
    return seen


def make_objects(path: Path) -> tuple[Model, Context, SamplerChain]:
    model = Model.load(path)
    return model, Context(model, ContextParams(n_ctx=64)), SamplerChain(model)


def addresses(*handles: NativeHandle) -> dict[int, str]:
    return {address(h._pointer): h.kind for h in handles}


def assert_freed_once_children_first(frees: Frees, expected: dict[int, str], root: int) -> None:
    """Each expected pointer freed exactly once, the root (the model) after all the others."""
    freed = [at for _, at in frees if at in expected]
    assert sorted(freed) == sorted(expected), (frees, expected)
    assert freed[-1] == root, f"the model was freed before a child: {frees}"


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_objects_returned_from_a_function_die_in_any_order(
    tiny_model_path: Path, order: tuple, frees: Frees
) -> None:
    objects = list(make_objects(tiny_model_path))
    expected = addresses(*objects)
    root = address(objects[0]._pointer)
    context, sampler = objects[1], objects[2]
    assert not context.closed and not sampler.closed
    for index in order:
        objects[index] = None  # type: ignore[call-overload]
        gc.collect()
    assert frees == []  # the local names still hold the children, and they their model
    del context, sampler
    gc.collect()
    assert_freed_once_children_first(frees, expected, root)


def test_closing_a_model_closes_its_children_first(tiny_model_path: Path, frees: Frees) -> None:
    model, context, sampler = make_objects(tiny_model_path)
    expected, root = addresses(model, context, sampler), address(model._pointer)
    model.close()
    assert context.closed and sampler.closed and model.closed
    assert_freed_once_children_first(frees, expected, root)
    model.close()  # idempotent
    context.close()
    del model, context, sampler
    gc.collect()
    assert_freed_once_children_first(frees, expected, root)  # nothing freed twice


@pytest.mark.parametrize(
    "options",
    [{}, {"parallel": 2}, {"prompt_cache": "ram"}, {"prompt_cache": "disk"}, {"draft_model": ""}],
    ids=["plain", "parallel", "ram-cache", "disk-cache", "draft"],
)
def test_a_dropped_llama_frees_its_model_at_once_not_at_the_next_collection(
    tiny_model_path: Path, tmp_path: Path, frees: Frees, options: dict
) -> None:
    # A reference cycle anywhere above the model (its Vocab held it, and it its Vocab) kept a
    # dropped model's whole memory until Python's cyclic collector next ran.
    if "draft_model" in options:
        options = {"draft_model": tiny_model_path}
    if options.get("prompt_cache") == "disk":
        options = {"prompt_cache": tmp_path / "cache"}
    llm = Llama(tiny_model_path, n_ctx=64, chat_format="chatml", **options)
    llm.create_completion("the cat", max_tokens=2)
    llm.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=2)
    assert llm.tokenize("the cat") and llm.vocab is llm.model.vocab
    root = address(llm.model._pointer)
    gc.collect()
    gc.disable()
    try:
        del llm
        assert ("model", root) in frees
        gc.set_debug(gc.DEBUG_SAVEALL)  # what only the collector could have freed
        gc.collect()
        cycles = [o for o in gc.garbage if type(o).__module__.startswith("llamacrab")]
        assert cycles == []
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_a_vocab_keeps_its_model_and_shares_what_it_learned(
    tiny_model_path: Path, frees: Frees
) -> None:
    model = Model.load(tiny_model_path)
    root = address(model._pointer)
    eog = model.vocab.eog_tokens  # the Vocab is dropped: the next one comes without the scan
    assert model.vocab._facts.eog == eog
    vocab = model.vocab
    del model
    gc.collect()
    assert frees == [] and vocab.tokenize("the cat")  # its vocabulary holds the model
    del vocab
    assert frees == [("model", root)]


def test_use_after_close_raises_and_never_reaches_c(tiny_model_path: Path) -> None:
    model, context, sampler = make_objects(tiny_model_path)
    vocab = model.vocab
    context.close()
    with pytest.raises(ClosedHandleError, match="context is closed"):
        context.clear()
    with pytest.raises(ClosedHandleError):
        sampler.sample(context)
    model.close()
    for use in (lambda: vocab.tokenize("hi"), lambda: model.n_embd, sampler.reset):
        with pytest.raises(ClosedHandleError):
            use()
    with pytest.raises(ClosedHandleError):
        Context(model)


def test_llama_context_manager_frees_everything(tiny_model_path: Path, frees: Frees) -> None:
    with Llama(tiny_model_path, n_ctx=64) as llm:
        context = llm.context
        expected = addresses(llm.model, context)
        root = address(llm.model._pointer)
        assert llm.create_completion("the cat", max_tokens=2, temperature=0).usage.prompt_tokens > 0
        assert frees == [("sampler", at) for _, at in frees]  # only the request's sampler
    assert llm.closed and context.closed
    assert_freed_once_children_first(frees, expected, root)
    assert len(frees) == len(set(frees))  # every sampler once too
    with pytest.raises(ClosedHandleError):
        llm.create_completion("the cat")


def test_a_closed_batch_raises_and_never_reaches_c(tiny_llama: Llama) -> None:
    context = tiny_llama.context
    batch = Batch(32)
    batch.set(np.array(tiny_llama.tokenize("the cat"), dtype=np.int32), 0)
    with batch:
        context.clear()
        context.decode(batch)  # usable while open
    assert batch.closed
    for use in (lambda: batch.set(np.array([1], dtype=np.int32), 0), lambda: batch.set_one(1, 0),
                lambda: batch.value, lambda: context.decode(batch)):  # fmt: skip
        with pytest.raises(ClosedHandleError, match="batch is closed"):
            use()
    batch.close()  # idempotent


def test_process_exits_cleanly_with_live_handles(tiny_model_path: Path) -> None:
    script = textwrap.dedent(f"""
        import atexit, collections, json
        frees = []
        # Registered before llamacrab is imported: runs after llamacrab's own exit hook.
        atexit.register(lambda: print("FREES", json.dumps(
            [[kind, at, n] for (kind, at), n in collections.Counter(frees).items()])))
        from llamacrab import Llama, SamplerChain, Context, ContextParams
        from llamacrab._native import handle
        handle.free_observer = lambda kind, at: frees.append((kind, at))
        llm = Llama({str(tiny_model_path)!r}, n_ctx=64)
        extra = Context(llm.model, ContextParams(n_ctx=32))
        sampler = SamplerChain(llm.model)
        stream = llm.stream_completion("the cat", max_tokens=50)
        next(stream)
        cycle = [llm, extra]
        cycle.append(cycle)
        print("LIVE", json.dumps([
            ["model", handle.address(llm.model._pointer)],
            ["context", handle.address(llm.context._pointer)],
            ["context", handle.address(extra._pointer)],
            ["sampler", handle.address(sampler._pointer)],
        ]))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120,
                            text=True)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    counts = {(kind, at): n for kind, at, n in json.loads(lines["FREES"])}
    live = [tuple(h) for h in json.loads(lines["LIVE"])]
    assert all(counts.get(h) == 1 for h in live), (live, counts)  # each freed at exit
    assert all(n == 1 for n in counts.values()), counts  # and nothing twice


def test_sampler_options_are_validated(tiny_llama: Llama) -> None:
    with pytest.raises(InvalidParameterError, match="mirostat"):
        SamplingOptions(mirostat=3)
    with pytest.raises(InvalidParameterError, match="unknown samplers"):
        SamplingOptions(order=("top_k", "nope"))
    with pytest.raises(TokenizeError, match="outside the vocabulary"):
        SamplerChain(tiny_llama.model, SamplingOptions(logit_bias={10**6: 1.0}))


def test_handles_refuse_pickling_and_copies_by_name(tiny_llama: Llama) -> None:
    # A copy would share the pointer (closing it would close the original); a pickle would
    # carry an address meaningless in another process.
    import copy
    import pickle

    handles = [tiny_llama.model, tiny_llama.context]
    for native in handles:
        for attempt in (pickle.dumps, copy.copy, copy.deepcopy):
            with pytest.raises(TypeError, match=f"a {native.kind} cannot be pickled or copied"):
                attempt(native)
    with pytest.raises(TypeError, match="cannot be pickled or copied"):
        pickle.dumps(tiny_llama)
    state = pickle.loads(pickle.dumps(tiny_llama.save_state()))  # states are plain data
    tiny_llama.load_state(state)
    assert not any(native.closed for native in handles)
