"""Real models through raw lib calls: Gemma 3 270M from PyPI and the generated tiny GGUF."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llamacrab_sys import ffi, lib

from raw import checked, load_model
from support import load_repo_module


def greedy_tokens(ctx: Any, vocab: Any, prompt: list[int], n: int) -> list[int]:
    sampler = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
    lib.llama_sampler_chain_add(sampler, lib.llama_sampler_init_greedy())
    try:
        tokens = ffi.new("llama_token[]", prompt)
        batch = lib.llama_batch_get_one(tokens, len(prompt))
        out: list[int] = []
        last = ffi.new("llama_token[1]")
        for _ in range(n):
            assert checked(lib.safe_llama_decode, ctx, batch) == 0
            last[0] = checked(lib.safe_llama_sampler_sample, sampler, ctx, -1)
            out.append(last[0])
            batch = lib.llama_batch_get_one(last, 1)
        return out
    finally:
        lib.llama_sampler_free(sampler)


def new_context(model: Any, n_ctx: int = 256) -> Any:
    params = lib.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_threads = params.n_threads_batch = 2
    ctx = checked(lib.safe_llama_init_from_model, model, params)
    assert ctx != ffi.NULL
    return ctx


@pytest.mark.real_model
def test_gemma_generates_through_the_example(gemma_path: Path) -> None:
    raw_generate = load_repo_module("examples/raw_generate.py")
    text = raw_generate.generate(gemma_path, "Paris is the capital of", 4)
    assert text.startswith(" France")


@pytest.mark.real_model
def test_gemma_model_info_and_deterministic_greedy_decoding(gemma_path: Path) -> None:
    model = load_model(gemma_path)
    try:
        vocab = lib.llama_model_get_vocab(model)
        assert lib.llama_vocab_n_tokens(vocab) == 262_144
        desc = ffi.new("char[]", 128)
        lib.llama_model_desc(model, desc, 128)
        assert b"gemma3" in ffi.string(desc)
        prompt = [lib.llama_vocab_bos(vocab), 818, 5279, 529, 7001, 563]
        runs = []
        for _ in range(2):
            ctx = new_context(model)
            try:
                runs.append(greedy_tokens(ctx, vocab, prompt, 6))
            finally:
                lib.llama_free(ctx)
        assert runs[0] == runs[1]
        assert all(0 <= t < 262_144 for t in runs[0])
    finally:
        lib.llama_model_free(model)


def test_tiny_generated_model_loads_and_decodes(tiny_model: Any) -> None:
    vocab = lib.llama_model_get_vocab(tiny_model)
    assert lib.llama_vocab_n_tokens(vocab) == 271
    assert lib.llama_model_n_layer(tiny_model) == 2
    assert lib.llama_model_n_embd(tiny_model) == 64
    ctx = new_context(tiny_model, 64)
    try:
        tokens = greedy_tokens(ctx, vocab, [1, 270, 260], 5)
        assert len(tokens) == 5 and all(0 <= t < 271 for t in tokens)
        logits = lib.llama_get_logits_ith(ctx, -1)
        assert logits != ffi.NULL
    finally:
        lib.llama_free(ctx)


def test_the_eog_helper_matches_a_token_by_token_scan(tiny_model: Any) -> None:
    vocab = lib.llama_model_get_vocab(tiny_model)
    n_tokens = lib.llama_vocab_n_tokens(vocab)
    expected = [t for t in range(n_tokens) if lib.llama_vocab_is_eog(vocab, t)]
    out = ffi.new("int32_t[]", 8)
    assert lib.llamacrab_vocab_eog_tokens(vocab, out, 8) == len(expected) > 0
    assert list(out[0 : len(expected)]) == expected
    none = ffi.new("int32_t[]", 1)
    assert lib.llamacrab_vocab_eog_tokens(vocab, none, 0) == len(expected)  # count only


def test_the_gguf_string_walker_stops_at_the_end_of_the_data() -> None:
    import struct

    strings = [b"", b"a", b"hello", bytes(300)]
    data = b"".join(struct.pack("<Q", len(s)) + s for s in strings) + b"tail"
    buffer = ffi.from_buffer("uint8_t[]", data)
    end = len(data) - 4
    skip = lib.llamacrab_gguf_skip_strings
    starts = ffi.new("uint64_t[]", len(strings))
    assert skip(buffer, len(data), 0, len(strings), starts) == end
    assert list(starts) == [8, 16, 25, 38]  # each string's first byte
    assert [data[b : b + len(s)] for b, s in zip(starts, strings, strict=True)] == strings
    assert skip(buffer, len(data), 0, 2, ffi.NULL) == 8 + 9
    past = 2**64 - 1  # SIZE_MAX
    assert skip(buffer, end - 1, 0, len(strings), ffi.NULL) == past
    huge = struct.pack("<Q", 2**63) + b"x"
    assert skip(ffi.from_buffer("uint8_t[]", huge), 9, 0, 1, ffi.NULL) == past
    assert skip(buffer, len(data), len(data) + 5, 1, ffi.NULL) == past
