"""Completion options: logprobs, min_tokens, suffix, n and best_of, max_tokens=None."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from llamacrab import InvalidParameterError, Llama
from llamacrab._engine.logprobs import token_logprobs


def test_logprobs_come_from_the_pre_sampling_distribution(tiny_llama: Llama) -> None:
    result = tiny_llama.create_completion("the cat", max_tokens=4, temperature=0, logprobs=3)
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and len(logprobs.token_logprobs) == 4
    entries = zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True)
    for piece, value, top in entries:
        assert value <= 0 and len(top) == 3
        # Greedy picks the most likely token: its logprob is the best of the alternatives.
        assert math.isclose(value, max(top.values()), rel_tol=1e-6) and piece in top
    assert logprobs.text_offset[0] == 0
    assert list(logprobs.text_offset) == sorted(logprobs.text_offset)


def test_logprob_matches_a_numpy_log_softmax(tiny_llama: Llama) -> None:
    tiny_llama.reset()
    tokens = tiny_llama.tokenize("the cat sat")
    result = tiny_llama.create_completion(tokens, max_tokens=1, temperature=0, logprobs=0)
    tiny_llama.reset()
    tiny_llama.create_completion(tokens, max_tokens=0)
    logits = tiny_llama.context.logits().astype(np.float64)
    expected = -np.log(np.exp(logits - logits.max()).sum())  # log-softmax of the argmax
    assert result.choices[0].logprobs is not None
    assert math.isclose(result.choices[0].logprobs.token_logprobs[0], expected, abs_tol=1e-4)


def test_two_tokens_spelling_one_text_are_one_alternative(tiny_llama: Llama) -> None:
    """The tiny vocabulary spells " " twice (a byte token and a word piece): the likelier is
    the alternative, and the ids, texts and bytes of the alternatives stay aligned (the
    server's completion_probabilities zips them)."""
    vocab = tiny_llama.vocab
    space = [i for i in range(vocab.n_tokens) if vocab.token_to_piece(i) == " "]
    assert len(space) == 2
    logits = np.full(vocab.n_tokens, -10.0, dtype=np.float32)
    logits[space[1]], logits[space[0]], logits[50] = 5.0, 4.0, 3.0
    context = SimpleNamespace(logits=lambda index: logits, model=tiny_llama.model)
    _, top, ids, _ = token_logprobs(context, space[1], 3)  # type: ignore[arg-type]
    assert ids == (space[1], 50) and list(top) == [" ", vocab.token_to_piece(50)]


def test_no_logprobs_unless_asked(tiny_llama: Llama) -> None:
    assert tiny_llama.create_completion("the cat", max_tokens=2).choices[0].logprobs is None


def test_min_tokens_forbids_ending_early(tiny_llama: Llama) -> None:
    eos = tiny_llama.vocab.eos
    assert eos is not None
    end_now = {"logit_bias": {eos: 50.0}, "temperature": 0.0}
    first = tiny_llama.create_completion("the", max_tokens=8, **end_now)
    assert first.choices[0].finish_reason == "eos" and first.usage.completion_tokens == 0
    result = tiny_llama.create_completion("the", max_tokens=8, min_tokens=5, **end_now)
    assert result.usage.completion_tokens == 5 and result.choices[0].finish_reason == "eos"


def test_suffix_is_appended(tiny_llama: Llama) -> None:
    result = tiny_llama.create_completion("the", max_tokens=2, suffix=" [END]", temperature=0)
    assert result.text.endswith(" [END]")


def test_n_and_best_of(tiny_llama: Llama) -> None:
    result = tiny_llama.create_completion("the cat", max_tokens=6, n=3, seed=3, temperature=1.5)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert len({c.text for c in result.choices}) > 1
    assert result.usage.completion_tokens == sum(len(c.tokens) for c in result.choices)
    best = tiny_llama.create_completion("the cat", max_tokens=6, n=1, best_of=4, seed=3,
                                        temperature=1.5, logprobs=0)  # fmt: skip
    candidates = tiny_llama.create_completion("the cat", max_tokens=6, n=4, seed=3,
                                              temperature=1.5, logprobs=0)  # fmt: skip
    totals = [sum(c.logprobs.token_logprobs) for c in candidates.choices if c.logprobs]
    assert best.text == candidates.choices[int(np.argmax(totals))].text
    with pytest.raises(InvalidParameterError, match="best_of"):
        tiny_llama.create_completion("the", n=3, best_of=2)


def test_max_tokens_none_runs_to_the_end_of_the_context(tiny_llama: Llama) -> None:
    eos = tiny_llama.vocab.eos
    assert eos is not None
    result = tiny_llama.create_completion(
        "the cat", max_tokens=None, logit_bias={eos: -math.inf}, temperature=0
    )
    assert result.choices[0].finish_reason == "length"
    assert result.usage.total_tokens >= tiny_llama.context.n_ctx - 1
