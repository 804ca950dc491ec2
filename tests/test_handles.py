"""Handle lifetimes: freed once, children first, in any GC order; closed handles never reach C."""

from __future__ import annotations

import gc
import itertools
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llamacrab import (
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


def make_objects(path: Path) -> tuple[Model, Context, SamplerChain]:
    model = Model.load(path)
    return model, Context(model, ContextParams(n_ctx=64)), SamplerChain(model)


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_objects_returned_from_a_function_die_in_any_order(
    tiny_model_path: Path, order: tuple
) -> None:
    objects = list(make_objects(tiny_model_path))
    context, sampler = objects[1], objects[2]
    assert not context.closed and not sampler.closed
    for index in order:
        objects[index] = None  # type: ignore[call-overload]
        gc.collect()
    del context, sampler
    gc.collect()


def test_closing_a_model_closes_its_children_first(tiny_model_path: Path) -> None:
    model, context, sampler = make_objects(tiny_model_path)
    model.close()
    assert context.closed and sampler.closed and model.closed
    model.close()  # idempotent
    context.close()


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


def test_llama_context_manager_frees_everything(tiny_model_path: Path) -> None:
    with Llama(tiny_model_path, n_ctx=64) as llm:
        context = llm.context
        assert llm.create_completion("the cat", max_tokens=2, temperature=0).usage.prompt_tokens > 0
    assert llm.closed and context.closed
    with pytest.raises(ClosedHandleError):
        llm.create_completion("the cat")


def test_process_exits_cleanly_with_live_handles(tiny_model_path: Path) -> None:
    script = textwrap.dedent(f"""
        from llamacrab import Llama, SamplerChain, Context, ContextParams
        llm = Llama({str(tiny_model_path)!r}, n_ctx=64)
        extra = Context(llm.model, ContextParams(n_ctx=32))
        sampler = SamplerChain(llm.model)
        stream = llm.stream_completion("the cat", max_tokens=50)
        next(stream)
        cycle = [llm, extra]
        cycle.append(cycle)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr.decode()[-2000:]


def test_sampler_options_are_validated(tiny_llama: Llama) -> None:
    with pytest.raises(InvalidParameterError, match="mirostat"):
        SamplingOptions(mirostat=3)
    with pytest.raises(InvalidParameterError, match="unknown samplers"):
        SamplingOptions(order=("top_k", "nope"))
    with pytest.raises(TokenizeError, match="outside the vocabulary"):
        SamplerChain(tiny_llama.model, SamplingOptions(logit_bias={10**6: 1.0}))
