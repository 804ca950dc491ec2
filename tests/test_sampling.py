"""Sampler chains: every libllama sampler configurable, grammar and logit bias enforced in C."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from llamacrab import (
    CustomSampler,
    EndGeneration,
    GrammarError,
    InvalidParameterError,
    Llama,
    SamplingOptions,
)

VARIANTS = [
    {},
    {"temperature": 0.0},
    {"top_k": 5, "top_p": 0.5, "min_p": 0.1, "typical_p": 0.9},
    {"repeat_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.5},
    {"dry_multiplier": 0.8},
    {"xtc_probability": 0.5, "xtc_threshold": 0.05},
    {"top_n_sigma": 1.5},
    {"dynatemp_range": 0.5},
    {"mirostat": 1},
    {"mirostat": 2},
    {"adaptive_p_target": 0.5},
    {"order": ("temperature", "top_k")},
]


@pytest.mark.parametrize("options", VARIANTS)
def test_every_sampler_configuration_generates(tiny_llama: Llama, options: dict) -> None:
    result = tiny_llama.create_completion("the cat sat", max_tokens=4, seed=1, **options)
    assert result.usage.completion_tokens >= 1
    assert all(0 <= t < tiny_llama.vocab.n_tokens for t in result.choices[0].tokens)


def test_infill_sampler_runs(tiny_llama: Llama) -> None:
    # Without FIM tokens and with noise logits, llama.cpp's infill sampler ends at once: what
    # matters here is that the chain accepts it and generation finishes normally.
    result = tiny_llama.create_completion("the cat", max_tokens=4, seed=1, infill=True)
    assert result.choices[0].finish_reason in ("eos", "length")


def test_grammar_constrains_the_output(tiny_llama: Llama) -> None:
    grammar = 'root ::= " the" (" cat" | " dog") " sat"'
    for seed in range(5):
        result = tiny_llama.create_completion("hello", max_tokens=30, grammar=grammar, seed=seed)
        assert result.text in (" the cat sat", " the dog sat")
        assert result.choices[0].finish_reason == "eos"  # nothing but the end is allowed after


def test_invalid_grammar(tiny_llama: Llama) -> None:
    with pytest.raises(GrammarError, match="invalid grammar"):
        tiny_llama.create_completion("hello", grammar="root ::= (")
    assert (
        tiny_llama.create_completion("hello", max_tokens=1, min_tokens=1).usage.completion_tokens
        == 1
    )


def test_logit_bias_is_applied_natively(tiny_llama: Llama) -> None:
    dog = tiny_llama.tokenize(" dog", add_special=False)[-1]
    options = SamplingOptions(temperature=0.0, logit_bias={dog: 100.0})
    result = tiny_llama.create_completion("the", max_tokens=3, sampling=options)
    assert result.choices[0].tokens == (dog, dog, dog)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"logit_bias": {"5": 1.0}}, "keys are token ids, not '5'"),
        ({"logit_bias": {True: 1.0}}, "keys are token ids, not True"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias of token 5 is nan"),
        ({"logit_bias": {5: "1"}}, "logit_bias of token 5 is '1'"),
        ({"top_k": 2**31}, "top_k must be an integer in -2147483648..2147483647"),
        ({"dry_allowed_length": 10**30}, "dry_allowed_length must be an integer in"),
        # A ring of 2^31 - 1 tokens: 8 GB zero-filled, or std::bad_alloc escaping (SIGABRT)
        ({"penalty_last_n": 2**31 - 1, "repeat_penalty": 1.1}, r"in -1\.\.1048576"),
        ({"dry_penalty_last_n": 2**31 - 1, "dry_multiplier": 0.8}, r"in -1\.\.1048576"),
        ({"typical_p": None}, "typical_p must be a number, not None"),
        ({"min_p": {"a": 1}}, "min_p must be a number"),
        ({"temperature": float("nan")}, "temperature is NaN"),
        ({"logprobs": [1]}, "logprobs must be an integer or None"),
        ({"stop": 5}, "stop must be a string or a list of items each a string, not 5"),
        ({"n": 10**6}, r"n must be an integer in 1\.\.128"),
        ({"best_of": "2"}, "best_of must be an integer"),
        ({"n": None, "best_of": 0}, "best_of must be an integer in 1"),  # (n=None is 1)
        ({"seed": "1"}, "seed must be an integer"),
    ],
)
def test_sampler_settings_that_c_cannot_take_are_refused(
    tiny_llama: Llama, options: dict, match: str
) -> None:
    # Before: TypeError or OverflowError from cffi, or a NaN logit sampled from.
    with pytest.raises(InvalidParameterError, match=match):
        tiny_llama.create_completion("the", max_tokens=2, **options)
    # numpy numbers are ids and biases too; -inf bans
    (first,) = tiny_llama.create_completion("the", max_tokens=1, temperature=0.0).choices[0].tokens
    banned = {np.int32(first): np.float32(-np.inf)}
    again = tiny_llama.create_completion("the", max_tokens=1, temperature=0.0, logit_bias=banned)
    assert again.choices[0].tokens != (first,)


class OnlyToken(CustomSampler):
    """Allows a single token: proves a Python sampler runs inside the native chain."""

    name = "only-token"

    def __init__(self, token: int) -> None:
        self.token = token
        self.applied = 0
        self.accepted: list[int] = []

    def apply(self, candidates: np.ndarray) -> None:
        self.applied += 1
        candidates["logit"][candidates["id"] != self.token] = -np.inf

    def accept(self, token: int) -> None:
        self.accepted.append(token)


def test_custom_python_sampler_runs_in_the_chain(tiny_llama: Llama) -> None:
    dog = tiny_llama.tokenize(" dog", add_special=False)[-1]
    sampler = OnlyToken(dog)
    result = tiny_llama.create_completion("the", max_tokens=4, custom_samplers=(sampler,))
    assert result.choices[0].tokens == (dog,) * 4
    assert sampler.applied == 4 and sampler.accepted == [dog] * 4
    assert live_python_samplers() == 0  # freed with its chain


class FailsAt(CustomSampler):
    """Raises ``error`` in ``where`` ("apply" or "accept") at its ``at``-th call there, or
    ends the generation there when ``error`` is EndGeneration."""

    def __init__(self, at: int, error: BaseException, where: str = "apply") -> None:
        self.at, self.error, self.where = at, error, where
        self.calls = {"apply": 0, "accept": 0}

    def _count(self, where: str) -> None:
        self.calls[where] += 1
        if where == self.where and self.calls[where] == self.at:
            raise self.error

    def apply(self, candidates: np.ndarray) -> None:
        self._count("apply")

    def accept(self, token: int) -> None:
        self._count("accept")


@pytest.mark.parametrize("where", ["apply", "accept"])
def test_a_python_samplers_exception_reaches_the_caller(tiny_model_path: Path, where: str) -> None:
    greedy = {"temperature": 0.0, "max_tokens": 6}
    for parallel in (None, 2):
        with Llama(tiny_model_path, n_ctx=128, n_threads=2, parallel=parallel) as llm:
            expected = llm.create_completion("the cat", **greedy).text
            failing = FailsAt(3, KeyError("sampler failed"), where)
            with pytest.raises(KeyError, match="sampler failed"):
                llm.create_completion("the cat", custom_samplers=(failing,), **greedy)
            assert failing.calls[where] == 3  # no token sampled after the failure
            again = FailsAt(2, ValueError("again"), where)
            stream = llm.stream_completion("the cat", custom_samplers=(again,), **greedy)
            with pytest.raises(ValueError, match="again"):
                list(stream)
            assert llm.create_completion("the cat", **greedy).text == expected
        assert live_python_samplers() == 0


def test_end_generation_stops_before_the_token(tiny_llama: Llama) -> None:
    expected = tiny_llama.create_completion("the", max_tokens=6, temperature=0.0)
    ender = FailsAt(4, EndGeneration())
    result = tiny_llama.create_completion(
        "the", max_tokens=6, temperature=0.0, custom_samplers=(ender,)
    )
    choice = result.choices[0]
    assert choice.finish_reason == "stop" and choice.tokens == expected.choices[0].tokens[:3]
    # Even where a grammar forbids ending (no end-of-generation token could be forced).
    grammar = 'root ::= (" the" | " cat" | " dog")+ " sat"'
    ender = FailsAt(3, EndGeneration())
    result = tiny_llama.create_completion(
        "hello", max_tokens=30, grammar=grammar, seed=1, custom_samplers=(ender,)
    )
    assert result.choices[0].finish_reason == "stop" and len(result.choices[0].tokens) == 2


def live_python_samplers() -> int:
    from llamacrab_sys import _python_sampler

    return len(_python_sampler._live)


class PassThrough(CustomSampler):
    """Changes nothing; its presence makes llama.cpp's chain pick instead of numpy."""

    name = "pass-through"

    def apply(self, candidates: np.ndarray) -> None:
        pass


def test_numpy_greedy_picks_what_the_native_chain_picks(tiny_llama: Llama) -> None:
    """Plain greedy (logit_bias + greedy) picks in numpy: the same token as llama.cpp's chain
    over rows full of ties, positive, negative and -inf biases, and extra banned tokens; the
    logits row is left as it was."""
    from llamacrab._native.call import ffi, lib
    from llamacrab._native.greedy import BiasedArgmax
    from llamacrab._native.sampler import SamplerChain

    n_vocab = tiny_llama.vocab.n_tokens
    rng = np.random.default_rng(7)
    entry = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
    for trial in range(200):
        logits = np.round(rng.normal(0, 2, n_vocab)).astype(np.float32)  # many equal maxima
        tokens = rng.choice(n_vocab, size=int(rng.integers(0, 6)), replace=False)
        values = rng.choice([-np.inf, -3.0, 0.5, 2.0, 40.0], size=tokens.size)
        bias = {int(t): float(v) for t, v in zip(tokens, values, strict=True)}
        banned = rng.choice(n_vocab, size=3, replace=False).astype(np.int32)
        native_bias = {**bias, **dict.fromkeys(banned.tolist(), float("-inf"))}
        if trial % 2:  # without extra bans
            banned, native_bias = None, bias
        row = logits.copy()
        picked = BiasedArgmax(n_vocab, bias).pick(ffi.from_buffer("float[]", row), banned)
        assert np.array_equal(row, logits)
        candidates = np.zeros(n_vocab, dtype=entry)
        candidates["id"], candidates["logit"] = np.arange(n_vocab), logits
        data = ffi.from_buffer("llama_token_data[]", candidates)
        array = ffi.new("llama_token_data_array *", {"data": data, "size": n_vocab, "selected": -1})
        options = SamplingOptions(temperature=0, logit_bias=native_bias)
        with SamplerChain(tiny_llama.model, options) as chain, chain.in_flight() as pointer:
            lib.llama_sampler_apply(pointer, array)
        assert picked == int(candidates["id"][array.selected]), trial


def test_numpy_greedy_generates_what_the_native_chain_generates(tiny_llama: Llama) -> None:
    """Whole generations: logit_bias, and min_tokens' end-of-generation ban, the same
    through numpy's pick and through the C chain (a pass-through Python sampler forces it)."""
    eos = tiny_llama.vocab.eog_tokens[0]
    dog = tiny_llama.tokenize(" dog", add_special=False)[-1]
    cases = [
        {"logit_bias": {dog: 1.5, eos: float("-inf")}, "max_tokens": 24},
        {"logit_bias": {eos: 50.0}, "min_tokens": 3, "max_tokens": 8},
    ]
    for case in cases:
        numpy_side = tiny_llama.create_completion("the cat", temperature=0, **case)
        native_side = tiny_llama.create_completion(
            "the cat", temperature=0, custom_samplers=(PassThrough(),), **case
        )
        assert numpy_side.choices[0].tokens == native_side.choices[0].tokens
        assert numpy_side.choices[0].finish_reason == native_side.choices[0].finish_reason
    assert numpy_side.usage.completion_tokens == 3  # the ban held, then the biased end won
    assert numpy_side.choices[0].finish_reason == "eos"


TOP_K_CHAINS = [
    {},  # llama.cpp's defaults: top_k 40, top_p 0.95, min_p 0.05, temperature 0.8
    {"top_k": 5, "top_p": 0.9, "min_p": 0.02},
    {"top_k": 100, "temperature": 1.5, "typical_p": 0.9},
    {"top_k": 20, "dynatemp_range": 0.5, "xtc_probability": 0.5, "xtc_threshold": 0.05},
    {"top_k": 4096},  # the whole tiny vocabulary
    # logit_bias before top_k: lifted into the top_k, banned, pushed down from the top
    {"top_k": 8, "logit_bias": {7: 2.0, 30: 1.0, 2: float("-inf"), 50: -3.0}},
    {"top_k": 3, "temperature": 2.0, "logit_bias": dict.fromkeys(range(40, 100), 4.0)},
]


@pytest.mark.parametrize("options", TOP_K_CHAINS)
def test_a_chain_starting_with_top_k_samples_what_the_whole_chain_samples(
    tiny_llama: Llama, options: dict
) -> None:
    """Such a chain is handed only the top_k largest logits, picked in one pass in C: the same
    seed gives the same tokens as the same chain handed every candidate (a pass-through Python
    sampler first forces that)."""
    assert SamplingOptions(**options).top_k_first
    # Both from empty memory: a reused prefix would decode in another batch shape, whose
    # arithmetic differs in the last bits on a GPU, enough to move a sampled token.
    fast = tiny_llama.create_completion("the cat", max_tokens=24, seed=5, **options)
    tiny_llama.reset()
    whole = tiny_llama.create_completion(
        "the cat", max_tokens=24, seed=5, custom_samplers=(PassThrough(),), **options
    )
    assert fast.choices[0].tokens == whole.choices[0].tokens
    assert len(set(fast.choices[0].tokens)) > 1  # sampled, not one token over and over


def test_min_tokens_bans_the_end_inside_a_top_k_first_chain(tiny_llama: Llama) -> None:
    """min_tokens' end-of-generation ban leaves the end tokens out of the top_k candidates
    picked in C, with no Python sampler in the chain: the same seed gives the same tokens as
    the whole chain behind the ban as a Python sampler."""
    from llamacrab._native.sampler import Samplers

    eos = tiny_llama.vocab.eos
    assert eos is not None
    samplers = Samplers(tiny_llama.model, SamplingOptions(), min_tokens=3)
    assert samplers.main.takes_banned  # no Python sampler: the fast path
    samplers.close()
    cases = [
        {"top_k": 8, "logit_bias": {eos: 50.0}, "min_tokens": 4, "max_tokens": 10},
        {"top_k": 40, "temperature": 1.5, "min_tokens": 16, "max_tokens": 16},
    ]
    for case in cases:
        fast = tiny_llama.create_completion("the cat", seed=9, **case)
        whole = tiny_llama.create_completion(
            "the cat", seed=9, custom_samplers=(PassThrough(),), **case
        )
        assert fast.choices[0].tokens == whole.choices[0].tokens, case
        assert not set(fast.choices[0].tokens[: case["min_tokens"]]) & set(
            tiny_llama.vocab.eog_tokens
        )
    # The first case: the ban held for 4 tokens, then the biased end token won.
    assert fast.usage.completion_tokens == 16
    first = tiny_llama.create_completion("the cat", seed=9, **cases[0])
    assert first.usage.completion_tokens == 4 and first.choices[0].finish_reason == "eos"


@pytest.mark.real_model
def test_top_k_first_on_a_real_vocabulary(gemma: Llama) -> None:
    """262,144 candidates, of which top_k 40 reach the rest of llama.cpp's default chain;
    with min_tokens, Gemma's end tokens left out of them."""
    prompt = "Write a short story about a crab who finds a lighthouse."
    for seed, min_tokens in ((1, 0), (2, 0), (3, 32)):
        gemma.reset()  # both from empty memory: the same batch shapes, the same arithmetic
        fast = gemma.create_completion(prompt, max_tokens=32, seed=seed, min_tokens=min_tokens)
        gemma.reset()
        whole = gemma.create_completion(
            prompt, max_tokens=32, seed=seed, min_tokens=min_tokens,
            custom_samplers=(PassThrough(),),
        )  # fmt: skip
        assert fast.choices[0].tokens == whole.choices[0].tokens


def test_which_chains_start_with_top_k() -> None:
    assert SamplingOptions().top_k_first
    assert SamplingOptions(order=("top_p", "top_k"), top_p=1.0).top_k_first  # top_p does nothing
    assert SamplingOptions(logit_bias={1: 1.0}).top_k_first  # the biased tokens go along
    for other in [
        {"temperature": 0},  # greedy: argmax in numpy
        {"logit_bias": dict.fromkeys(range(65), 1.0)},  # beyond MAX_BIAS_FIRST
        {"repeat_penalty": 1.1},
        {"dry_multiplier": 0.8},
        {"top_n_sigma": 1.0},
        {"top_k": 0},
        {"top_k": 5000},  # beyond MAX_TOP_K_FIRST
        {"mirostat": 2},
        {"grammar": 'root ::= "a"'},
        {"order": ("temperature", "top_k")},
        {"order": ("top_p", "min_p")},
    ]:
        assert not SamplingOptions(**other).top_k_first, other


@pytest.mark.parametrize(
    "penalty",
    [
        {"presence_penalty": 50.0},
        {"presence_penalty": 50.0, "penalty_last_n": -1},
        {"repeat_penalty": 3.0},
        {"dry_multiplier": 5.0},
    ],
    ids=["presence", "presence over the context", "repeat", "dry"],
)
def test_penalties_apply_to_a_greedy_pick_as_llama_cpp_applies_them(
    gemma: Llama, penalty: dict[str, float]
) -> None:
    # Found by review: at temperature 0 only logit_bias ran before the pick (llama.cpp's chain,
    # llama-server's and llama-cpp-python's run the penalties first), and a window of -1 (DRY's
    # default) reached llama.cpp as 0, which turns the penalty off.
    prompt = "one two three four one two three four one two three four one two three four one"

    def text(**options: float) -> str:
        return gemma.create_completion(prompt, max_tokens=10, **options).choices[0].text

    plain = text(temperature=0)
    greedy = text(temperature=0, **penalty)
    assert greedy != plain  # the penalty changed the pick
    assert greedy == text(temperature=0.7, top_k=1, seed=3, **penalty)  # as the full chain picks


@pytest.mark.parametrize(
    "option",
    [{"typical_p": 0.5}, {"xtc_probability": 1.0, "xtc_threshold": 0.1}],
    ids=["typical", "xtc"],
)
def test_a_greedy_pick_sees_the_candidates_llama_cpp_leaves_it(
    gemma: Llama, option: dict[str, float]
) -> None:
    # Found by review: typical and XTC ran alone before the pick, on every candidate, where
    # llama.cpp's chain runs top_k, top_p and min_p first (the greedy pick differed from the
    # chain's at a temperature that leaves it no choice).
    prompt = "Write a short story about a cat who lives in a lighthouse."

    def tokens(**options: float) -> list[int]:
        completion = gemma.create_completion(prompt, max_tokens=24, seed=7, **options, **option)
        return completion.choices[0].tokens

    assert tokens(temperature=0) == tokens(temperature=1e-5)


def test_mirostat_at_temperature_0_is_the_plain_argmax_as_in_llama_cpp(gemma: Llama) -> None:
    # Found by review: the penalties ran before a greedy pick with mirostat set, where
    # llama.cpp's mirostat chain is its temperature alone (at 0: the argmax).
    prompt = "one two three four one two three four one two three four one"

    def text(**options: float) -> str:
        return (
            gemma.create_completion(prompt, max_tokens=8, temperature=0, **options).choices[0].text
        )

    assert text(mirostat=2, presence_penalty=50.0) == text()
