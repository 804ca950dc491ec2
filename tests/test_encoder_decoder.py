"""Encoder-decoder models (T5): the encoder reads the prompt, the decoder generates from the
model's start token. Greedy tokens equal llama.cpp's own loop (the C API called directly, as
its llama-simple example does); what llama.cpp would abort on is refused first."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_context_guards import run_child

from llamacrab import (
    Batch,
    Context,
    ContextError,
    ContextOverflowError,
    ContextParams,
    DraftModel,
    InvalidParameterError,
    Llama,
    Model,
)

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")
PROMPTS = ("the cat sat", "a dog ran far away", "hello")


@pytest.fixture(scope="module")
def t5_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Weights large enough that the decoder's greedy tokens follow the encoder's input.
    return tiny.write_tiny_t5(tmp_path_factory.mktemp("t5") / "tiny-t5.gguf", scale=1.0)


@pytest.fixture(scope="module")
def t5(t5_path: Path) -> Iterator[Llama]:
    with Llama(t5_path, n_ctx=256, n_threads=1) as llm:
        yield llm


def llama_cpp_greedy(path: Path, prompt: list[int], count: int) -> list[int]:
    """llama-simple's loop in a child process: llama_encode the prompt, then decode from the
    decoder start token, taking the argmax of each step's logits."""
    code = """
        import json, sys
        import numpy as np
        sys.path.insert(0, sys.argv[3])
        from raw import checked, load_model
        from llamacrab_sys import ffi, lib
        prompt, count = json.loads(sys.argv[2]), 0
        model = load_model(sys.argv[1])
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_threads, params.n_threads_batch = 256, 1, 1
        ctx = checked(lib.safe_llama_init_from_model, model, params)
        ids = ffi.new("llama_token[]", prompt)
        assert checked(lib.safe_llama_encode, ctx, lib.llama_batch_get_one(ids, len(ids))) == 0
        token = lib.llama_model_decoder_start_token(model)
        n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
        out = []
        for _ in range(int(sys.argv[4])):
            one = ffi.new("llama_token[]", [token])
            assert checked(lib.safe_llama_decode, ctx, lib.llama_batch_get_one(one, 1)) == 0
            row = checked(lib.safe_llama_get_logits_ith, ctx, -1)
            token = int(np.argmax(np.frombuffer(ffi.buffer(row, 4 * n_vocab), np.float32)))
            out.append(token)
        print(json.dumps(out))
    """
    raw = Path(__file__).parent / "sys"
    args = [str(path), str(prompt), str(raw), str(count)]
    child = run_child(code, *args)
    assert child.returncode == 0, child.stderr[-3000:]
    return [int(t) for t in child.stdout.strip()[1:-1].split(",")]


def generated(llm: Llama, prompt: str, count: int) -> list[int]:
    """The decoder's tokens after the start token: each sampled token is decoded before the
    next, so ``count + 1`` are asked for."""
    llm.create_completion(prompt, max_tokens=count + 1, temperature=0)
    held = llm.held_tokens()
    assert held[0] == llm.model.decoder_start_token == 0
    return held[1:]


@pytest.mark.parametrize("parallel", [None, 1])
def test_greedy_tokens_equal_llama_cpp_s_own_loop(t5_path: Path, parallel: int | None) -> None:
    with Llama(t5_path, n_ctx=256, n_threads=1, parallel=parallel) as llm:
        answers = [generated(llm, prompt, 8) for prompt in PROMPTS]
        for prompt, tokens in zip(PROMPTS, answers, strict=True):
            assert tokens == llama_cpp_greedy(t5_path, llm.tokenize(prompt), 8), prompt
    assert len({tuple(tokens) for tokens in answers}) == len(PROMPTS)  # the input matters


def test_streamed_and_sampled_answers_are_the_whole_answers(t5: Llama) -> None:
    whole = t5.create_completion("the cat sat", max_tokens=6, temperature=0)
    streamed = list(t5.stream_completion("the cat sat", max_tokens=6, temperature=0))
    assert "".join(chunk.text for chunk in streamed) == whole.choices[0].text
    assert whole.usage.prompt_tokens == len(t5.tokenize("the cat sat"))
    assert whole.usage.cached_tokens == 0  # every prompt is read by the encoder again
    seeded = [t5.create_completion("a dog", max_tokens=6, seed=7, temperature=1.5)
              for _ in range(2)]  # fmt: skip
    assert seeded[0].choices[0].text == seeded[1].choices[0].text


def test_a_prompt_past_n_ubatch_is_refused_and_the_model_goes_on(t5_path: Path) -> None:
    with Llama(t5_path, n_ctx=256, n_ubatch=16, n_batch=64, n_threads=1) as llm:
        with pytest.raises(ContextOverflowError, match="n_ubatch of 16"):
            llm.create_completion("a long prompt of many tokens", max_tokens=2)
        assert generated(llm, "hello", 4) == llama_cpp_greedy(t5_path, llm.tokenize("hello"), 4)


def test_what_one_encoder_output_cannot_serve_is_refused(t5_path: Path, t5: Llama) -> None:
    with pytest.raises(ContextError, match="runs one sequence"):  # llama.cpp: an abort
        Llama(t5_path, n_ctx=256, n_threads=1, parallel=2)
    # An embedding server's many sequences: the embeddings are what it is refused for.
    params = ContextParams(n_ctx=256, n_threads=1, embeddings=True, n_seq_max=8)
    with pytest.raises(ContextError, match="embeddings from it are not supported"):
        Context(t5.model, params)
    with pytest.raises(InvalidParameterError, match="encoder-decoder"):
        Llama(t5_path, n_ctx=256, n_threads=1, prompt_lookup=3)
    target_path = tiny.write_tiny_llama(t5_path.parent / "target.gguf")
    with (
        Llama(target_path, n_ctx=64) as target,
        pytest.raises(InvalidParameterError, match="draft model is an encoder-decoder"),
    ):
        target.create_completion("the cat", max_tokens=2, speculative=DraftModel(llama=t5))
    with pytest.raises(InvalidParameterError, match="prompt logprobs"):
        t5.create_completion("hello", max_tokens=2, echo=True, logprobs=1)
    assert generated(t5, "hello", 3) == llama_cpp_greedy(t5_path, t5.tokenize("hello"), 3)


def test_the_context_s_encode_and_decode_guard_llama_cpp_s_asserts(t5_path: Path) -> None:
    # Each refusal stands where llama.cpp would assert: run where an abort cannot take pytest.
    code = """
        import sys
        import numpy as np
        from llamacrab import Batch, Context, ContextParams, LlamaError, Model
        def attempt(what, action):
            try:
                action()
                print(what, "ok")
            except LlamaError as error:
                print(what, type(error).__name__, error)
        with Model.load(sys.argv[1]) as model:
            params = ContextParams(n_ctx=64, n_ubatch=8, n_batch=32, n_threads=1)
            with Context(model, params) as ctx, Batch(32) as batch:
                def run(method, tokens):
                    batch.set(np.arange(5, 5 + tokens, dtype=np.int32), 0)
                    return lambda: method(batch)
                attempt("long", run(ctx.encode, 9))
                attempt("encode", run(ctx.encode, 8))
                attempt("logits", lambda: ctx.logits(-1))
                attempt("decode", run(ctx.decode, 1))
                print("finite", bool(np.isfinite(ctx.logits(-1)).all()))
                attempt("encode again", run(ctx.encode, 6))  # the decoder starts over
                print("decoder memory", ctx.positions(0))
                attempt("decode again", run(ctx.decode, 1))
    """
    child = run_child(code, str(t5_path))
    assert child.returncode == 0, f"exit {child.returncode}\n{child.stderr[-3000:]}"
    lines = child.stdout.splitlines()
    assert lines[0].startswith("long ContextOverflowError the encoder reads its whole input")
    assert lines[1] == "encode ok"
    assert lines[2] == "logits InvalidParameterError the last call was an encode, which " \
        "computes no logits"  # fmt: skip
    assert lines[3:] == ["decode ok", "finite True", "encode again ok", "decoder memory None",
                         "decode again ok"]  # fmt: skip


def test_a_decoder_start_token_outside_the_vocabulary_is_named(t5_path: Path) -> None:
    overrides = {"t5.decoder_start_token_id": 100_000}
    with (
        Llama(t5_path, n_ctx=64, n_threads=1, kv_overrides=overrides) as llm,
        pytest.raises(InvalidParameterError, match=r"decoder_start_token_id\) is 100000"),
    ):
        llm.create_completion("the cat", max_tokens=2)


def test_encode_is_for_encoder_decoder_models(tmp_path: Path) -> None:
    with (
        Model.load(tiny.write_tiny_llama(tmp_path / "tiny.gguf")) as model,
        Context(model, ContextParams(n_ctx=64, n_threads=1)) as ctx,
        Batch(4) as batch,
    ):
        assert not model.encoder_decoder
        batch.set(np.array([5, 6], dtype=np.int32), 0)
        with pytest.raises(InvalidParameterError, match="not one: decode"):
            ctx.encode(batch)
