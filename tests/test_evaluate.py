"""``Llama.evaluate``: tokens decoded after what the memory holds, their raw logits returned
(llama-cpp-python's ``eval`` and ``scores``, for scoring and perplexity)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from llamacrab import (
    ConcurrentUseError,
    ContextOverflowError,
    DecodeAbortedError,
    InvalidParameterError,
    Llama,
    RamCache,
    TokenizeError,
)
from llamacrab._features import completion
from llamacrab._native.batch import Batch
from llamacrab._native.host_limits import Limit

from support import Slow, load_repo_module, record_decodes

tiny = load_repo_module("scripts/make_tiny_gguf.py")

TEXT = "The quick brown fox jumps over the lazy dog. " * 10  # 102 tokens: two chunks of rows


def _log_softmax(rows: np.ndarray) -> np.ndarray:
    wide = rows.astype(np.float64)
    peak = wide.max(axis=-1, keepdims=True)
    return wide - peak - np.log(np.exp(wide - peak).sum(axis=-1, keepdims=True))


def test_the_last_logits_are_those_a_prompt_leaves(gemma: Llama) -> None:
    tokens = gemma.tokenize("The capital of France is")
    gemma.reset()
    gemma.create_completion(tokens, max_tokens=0)  # the same decode: the prompt in one chunk
    expected = gemma.context.logits(-1).copy()
    gemma.reset()
    logits = gemma.evaluate(tokens)
    assert logits.shape == (gemma.vocab.n_tokens,) and logits.dtype == np.float32
    assert np.array_equal(logits, expected)
    assert gemma.held_tokens() == tokens


def test_every_row_rates_the_next_token_across_chunks(gemma: Llama) -> None:
    # The rows a prompt's logprobs are read from (the same chunks: 64 rows of Gemma's 262,144
    # logits each), row i rating token i + 1.
    tokens = gemma.tokenize(TEXT)
    gemma.reset()
    rows = gemma.evaluate(tokens, all_logits=True)
    assert rows.shape == (len(tokens), gemma.vocab.n_tokens)
    echoed = gemma.create_completion(tokens, max_tokens=0, echo=True, logprobs=1)
    logprobs = echoed.choices[0].logprobs
    assert logprobs is not None
    rated = _log_softmax(rows)[np.arange(len(tokens) - 1), tokens[1:]]
    assert np.allclose(rated, np.array(logprobs.token_logprobs[1:], dtype=float), atol=1e-6)


def test_evaluations_continue_the_memory_and_completions_reuse_it(gemma: Llama) -> None:
    prompt = gemma.tokenize("Count: one, two, three,")
    gemma.reset()
    logits = gemma.evaluate(prompt)
    greedy = []
    for _ in range(6):  # the hand-written loop decodes as a completion does: one at a time
        greedy.append(int(np.argmax(logits)))
        logits = gemma.evaluate(greedy[-1:])
    assert gemma.held_tokens() == prompt + greedy
    gemma.reset()
    completion = gemma.create_completion(prompt, max_tokens=6, temperature=0).choices[0]
    assert list(completion.tokens) == greedy
    gemma.reset()
    gemma.evaluate(prompt + greedy[:3])
    again = gemma.create_completion(prompt + greedy[:3], max_tokens=3, temperature=0)
    assert again.usage.cached_tokens == len(prompt) + 2  # all but the last, decoded again
    assert list(again.choices[0].tokens) == greedy[3:]


def test_after_rewinds_to_the_first_held_tokens(tiny_llama: Llama) -> None:
    # On the tiny model (F32) a decode's rows move with the batch's shape by < 1e-7.
    kept, dropped, new = [1, 5, 6, 7], [8, 9], [10, 11]
    tiny_llama.evaluate(kept + dropped)
    rewound = tiny_llama.evaluate(new, all_logits=True, after=len(kept))
    assert tiny_llama.held_tokens() == kept + new
    tiny_llama.reset()
    tiny_llama.evaluate(kept)
    assert np.allclose(tiny_llama.evaluate(new, all_logits=True), rewound, rtol=0, atol=1e-5)
    with pytest.raises(InvalidParameterError, match="after"):
        tiny_llama.evaluate(new, after=len(kept + new) + 1)
    assert tiny_llama.held_tokens() == kept + new
    # Rows asked for are computed even where the memory, or a prompt cache, holds their
    # tokens already (a red team found ConcurrentUseError there).
    again = tiny_llama.evaluate(new, all_logits=True, after=len(kept))
    assert np.allclose(again, rewound, rtol=0, atol=1e-5)
    tiny_llama.cache = RamCache(capacity_bytes=16 << 20)
    tiny_llama.create_completion(kept + new, max_tokens=1)
    tiny_llama.reset()
    cached = tiny_llama.evaluate(kept + new, all_logits=True)
    assert np.allclose(cached[len(kept) :], rewound, rtol=0, atol=1e-5)
    tiny_llama.cache = None


def test_bad_input_is_named_and_the_memory_stays(gemma: Llama) -> None:
    held = gemma.tokenize("Keep me")
    gemma.reset()
    gemma.evaluate(held)
    with pytest.raises(InvalidParameterError, match="at least one token"):
        gemma.evaluate([])
    with pytest.raises(TokenizeError, match="vocabulary"):
        gemma.evaluate([gemma.vocab.n_tokens])
    with pytest.raises(ContextOverflowError):
        gemma.evaluate([held[-1]] * gemma.context.n_ctx)
    assert gemma.held_tokens() == held
    assert gemma.evaluate(gemma.tokenize(" now", add_special=False)).shape == (
        gemma.vocab.n_tokens,
    )


def test_a_cancel_stops_it_and_the_llama_goes_on(
    gemma: Llama, monkeypatch: pytest.MonkeyPatch
) -> None:
    gemma.reset()

    def cancel_first(batch: Batch) -> None:
        monkeypatch.undo()  # once
        gemma.cancel()

    record_decodes(monkeypatch, cancel_first)
    with pytest.raises(DecodeAbortedError, match="cancelled"):
        gemma.evaluate(gemma.tokenize(TEXT))
    assert gemma.evaluate(gemma.tokenize("Hello")).shape == (gemma.vocab.n_tokens,)


def test_what_cannot_continue_a_memory_is_refused(tiny_model_path: Path, tmp_path: Path) -> None:
    t5 = tiny.write_tiny_t5(tmp_path / "t5.gguf")
    encoder = tiny.write_tiny_t5(tmp_path / "t5encoder.gguf", decoder=False)
    refusals = [
        (Llama(tiny_model_path, n_ctx=128, parallel=2), r"on parallel slots needs slot=i"),
        (Llama(t5, n_ctx=128), "encoder-decoder"),
        (Llama(encoder, n_ctx=128, embeddings=True), "computes no logits"),
    ]
    for llm, reason in refusals:
        with llm, pytest.raises(InvalidParameterError, match=reason):
            llm.evaluate([1, 2, 3])


def test_rows_past_the_memory_left_are_refused_before_any_decode(
    gemma: Llama, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 9 rows (BOS and 8 words) of Gemma's 262,144 logits are 9 MiB.
    monkeypatch.setattr(completion, "host_memory_left", lambda: Limit(8 << 20, "a test's"))
    gemma.reset()
    with pytest.raises(InvalidParameterError, match=r"9 tokens take 9 MiB, more than this "
                       r"process may still use \(a test's 8 MiB\)"):  # fmt: skip
        gemma.evaluate(gemma.tokenize("one two three four five six seven eight"),
                       all_logits=True)  # fmt: skip
    assert gemma.held_tokens() == []
    assert gemma.evaluate([2]).shape == (gemma.vocab.n_tokens,)  # one row fits


def test_a_change_of_adapters_starts_over(tiny_model_path: Path, tmp_path: Path) -> None:
    # What the memory held was computed with other weights: nothing of it is continued.
    lora = tiny.write_tiny_lora(tmp_path / "lora.gguf")
    with (
        Llama(tiny_model_path, n_ctx=128, lora=[lora]) as adapted,
        Llama(tiny_model_path, n_ctx=128) as base,
    ):
        adapter = next(iter(adapted.lora_adapters))
        adapted.evaluate([1, 5, 6, 7])
        adapted.set_lora_adapters({adapter: 0.0})
        assert adapted.held_tokens() == []
        rows = adapted.evaluate([8, 9], all_logits=True)
        assert np.allclose(rows, base.evaluate([8, 9], all_logits=True), rtol=0, atol=1e-5)


def test_a_parallel_slot_evaluates_while_it_is_idle(tiny_model_path: Path) -> None:
    prompt = [1, 5, 6, 7]
    with (
        Llama(tiny_model_path, n_ctx=256, parallel=2) as slots,
        Llama(tiny_model_path, n_ctx=128) as one,
    ):
        rows = slots.evaluate(prompt, all_logits=True, slot=1)
        assert slots.held_tokens(slot=1) == prompt and slots.held_tokens(slot=0) == []
        assert np.allclose(rows, one.evaluate(prompt, all_logits=True), rtol=0, atol=1e-5)
        last = slots.evaluate([8], slot=1)
        assert np.allclose(last, one.evaluate([8]), rtol=0, atol=1e-5)
        reused = slots.create_completion([*prompt, 8, 9], max_tokens=1)
        assert reused.choices[0].slot == 1 and reused.usage.cached_tokens == len(prompt) + 1
        stream = slots.stream_completion("the cat", max_tokens=60, min_tokens=60,
                                         custom_samplers=(Slow(),))  # fmt: skip
        busy = next(iter(stream)).slot
        assert busy is not None
        with pytest.raises(ConcurrentUseError, match=f"slot {busy} is generating"):
            slots.evaluate([1], slot=busy)
        stream.close()
        with pytest.raises(InvalidParameterError, match="slot 2"):
            slots.evaluate([1], slot=2)
        with pytest.raises(InvalidParameterError, match="slot 1 does not exist"):
            one.evaluate([1], slot=1)
