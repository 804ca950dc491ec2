"""A SamplerChain misused through the public API: a Python sampler that rewrites token ids, a
context of another model, tokens the vocabulary or the grammar refuse, a bias (or a Python
sampler) that leaves no token to pick. Each used to read or write outside a buffer, abort in
llama.cpp or output an arbitrary token; each now raises, and the chain (and the context) go on
working. The cases that crashed run in a child process, so a regression fails the test instead
of the test run."""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import httpx
import numpy as np
import pytest
from live_server import LiveServer
from test_crash_proof import assert_clean_exit, run_child
from test_sampling import OnlyToken

from llamacrab import (
    CustomSampler,
    GrammarError,
    InvalidParameterError,
    Llama,
    SamplerChain,
    SamplingOptions,
)
from llamacrab.compat import Llama as CompatLlama
from llamacrab.compat import LogitsProcessorList
from llamacrab.server import ServerSettings

# argv[1]: the tiny model. A context with logits for one output, and helpers the cases share.
_PRELUDE = """
    import sys
    import numpy as np
    from llamacrab import (
        Batch, Context, ContextParams, CustomSampler, GrammarError, InvalidParameterError, Model,
        ModelParams, SamplerChain, SamplingOptions, TokenizeError,
    )

    model = Model.load(sys.argv[1])
    n_vocab = model.vocab.n_tokens

    def decoded(graph_sampling="off"):
        context = Context(model, ContextParams(n_ctx=64, graph_sampling=graph_sampling))
        with Batch(8) as batch:
            batch.set(np.array([1, 260], np.int32), 0)
            context.decode(batch)
        return context

    def refused(error, action, *words):
        try:
            action()
        except error as caught:
            assert all(word in str(caught) for word in words), caught
            return str(caught)
        raise AssertionError(f"no {error.__name__}")

    def piece(token):
        return model.vocab.token_to_piece(token)

    context = decoded()
"""

_REWRITTEN_IDS = """
    class RewriteIds(CustomSampler):
        def __init__(self, value):
            self.value = value

        def apply(self, candidates):
            candidates["id"][:] = self.value

    greedy = SamplerChain(model, SamplingOptions(temperature=0)).sample(context)
    for value in (2**30, n_vocab, -5):
        for temperature in (0.0, 0.8):
            options = SamplingOptions(
                temperature=temperature, seed=1, custom_samplers=(RewriteIds(value),)
            )
            token = SamplerChain(model, options).sample(context)
            assert 0 <= token < n_vocab, (value, token)
            assert temperature > 0 or token == greedy, (value, token)  # the logits were kept
    print("done")
"""


def runs_to_the_end(code: str, *args: str) -> None:
    """``code`` after the prelude, in a child that must exit cleanly having printed "done"."""
    child = run_child(_PRELUDE + code, *args)
    assert_clean_exit(child)
    assert child.stdout.split() == ["done"]


def test_a_python_sampler_that_rewrites_token_ids_changes_nothing(tiny_model_path: Path) -> None:
    # The ids a Python sampler wrote were copied back into llama.cpp's candidates: the picked
    # "token" 2**30 indexed the logits row (SIGSEGV); n_vocab or -5 read past its ends.
    runs_to_the_end(_REWRITTEN_IDS, str(tiny_model_path))


_ANOTHER_VOCABULARY = """
    big = Model.load(sys.argv[2], ModelParams(vocab_only=True))  # 262,144 tokens
    for options in (
        {"temperature": 0},  # the pick in numpy read 262,144 floats of a 271-float row
        {"temperature": 0, "logit_bias": {262143: 3e38}},  # and wrote one past it
        {"top_k": 40, "seed": 1},  # top_k-first, in C
        {"temperature": 0.8, "top_k": 0, "seed": 1},  # the whole chain, in C
    ):
        chain = SamplerChain(big, SamplingOptions(**options))
        refused(InvalidParameterError, lambda: chain.sample(context), "262144", str(n_vocab))
    # Another Model of the same vocabulary (here the same file, vocab_only) is fine.
    same = Model.load(sys.argv[1], ModelParams(vocab_only=True))
    for options in ({"temperature": 0}, {"temperature": 0.8, "seed": 1}):
        expected = SamplerChain(model, SamplingOptions(**options)).sample(context)
        assert SamplerChain(same, SamplingOptions(**options)).sample(context) == expected
    print("done")
"""


@pytest.mark.real_model
def test_a_chain_refuses_a_context_of_another_vocabulary(
    tiny_model_path: Path, gemma_path: Path
) -> None:
    runs_to_the_end(_ANOTHER_VOCABULARY, str(tiny_model_path), str(gemma_path))


_ATTACH_ANOTHER_VOCABULARY = """
    big = Model.load(sys.argv[2], ModelParams(vocab_only=True))
    graph = decoded("on")
    chain = SamplerChain(big, SamplingOptions(temperature=0, logit_bias={262000: 1.0}))
    refused(InvalidParameterError, lambda: chain.attach(graph, 0), "262144")
    assert not chain.in_graph and graph.graph_sampler(0) is None
    with Batch(8) as batch:  # the decode aborted in ggml's logit_bias (GGML_ASSERT)
        batch.set(np.array([261], np.int32), 2)
        graph.decode(batch)
    print("done")
"""


@pytest.mark.real_model
def test_attach_refuses_a_chain_of_another_vocabulary(
    tiny_model_path: Path, gemma_path: Path
) -> None:
    runs_to_the_end(_ATTACH_ANOTHER_VOCABULARY, str(tiny_model_path), str(gemma_path))


_ATTACH_TOP_K_PAST_THE_VOCABULARY = """
    graph = Context(model, ContextParams(n_ctx=64, graph_sampling="on"))
    chain = SamplerChain(model, SamplingOptions(top_k=1000, seed=1))
    assert chain.attach(graph, 0) is False  # ggml's top_k asserts k <= n (an abort)
    assert not chain.in_graph and graph.graph_sampler(0) is None
    with Batch(8) as batch:
        batch.set(np.array([1, 260], np.int32), 0)
        graph.decode(batch)
    assert 0 <= chain.sample(graph) < n_vocab  # still a whole chain for the CPU
    print("done")
"""


def test_attach_declines_a_top_k_larger_than_the_vocabulary(tiny_model_path: Path) -> None:
    runs_to_the_end(_ATTACH_TOP_K_PAST_THE_VOCABULARY, str(tiny_model_path))


_GRAMMAR_REFUSES = """
    b = model.vocab.tokenize("b", add_special=False)[-1]
    chain = SamplerChain(model, SamplingOptions(grammar='root ::= "a"+', temperature=0))
    refused(GrammarError, lambda: chain.accept(b), "does not allow", str(b))
    token = chain.sample(context)  # aborted: the refused accept had emptied the grammar
    assert piece(token) == "a", piece(token)

    # sample accepts the token already: accepting it again is a token too many
    once = SamplerChain(model, SamplingOptions(grammar='root ::= "a"', temperature=0))
    token = once.sample(context)
    refused(GrammarError, lambda: once.accept(token), "does not allow", str(token))
    assert model.vocab.is_eog(once.sample(context))  # unchanged: "a" was read, only the end
    print("done")
"""


def test_a_token_the_grammar_refuses_leaves_the_chain_as_it_was(tiny_model_path: Path) -> None:
    runs_to_the_end(_GRAMMAR_REFUSES, str(tiny_model_path))


_GRAMMAR_DEAD_ENDS = """
    # A lazy grammar is not consulted before its trigger: the trigger's text itself is what
    # the grammar refuses, found while llama.cpp accepts the token that completes it.
    lazy = SamplerChain(model, SamplingOptions(
        grammar='root ::= "x"', grammar_trigger_words=("cat",), temperature=0
    ))
    cat = model.vocab.tokenize(" cat", add_special=False)
    refused(GrammarError, lambda: [lazy.accept(token) for token in cat], "does not allow")
    refused(GrammarError, lambda: lazy.sample(context), "reset()")
    refused(GrammarError, lambda: lazy.accept(cat[0]), "reset()")
    lazy.reset()
    assert 0 <= lazy.sample(context) < n_vocab

    # Every token the grammar allows is banned: llama.cpp accepts a token anyway, and throws.
    x = model.vocab.tokenize("x", add_special=False)[-1]
    banned = SamplerChain(model, SamplingOptions(
        grammar='root ::= "x"', logit_bias={x: float("-inf")}, temperature=0
    ))
    for _ in range(2):
        refused(GrammarError, lambda: banned.sample(context), "allows no token")
        refused(GrammarError, lambda: banned.sample(context), "reset()")
        banned.reset()
    print("done")
"""


def test_a_grammar_at_a_dead_end_refuses_until_reset(tiny_model_path: Path) -> None:
    # llama.cpp empties the grammar's parse stacks before it throws; its next use aborted.
    runs_to_the_end(_GRAMMAR_DEAD_ENDS, str(tiny_model_path))


_ACCEPT_OUTSIDE_THE_VOCABULARY = """
    for options in (
        {"adaptive_p_target": 0.5},  # accept(-1) aborted in llama_sampler_adaptive_p_accept
        {"temperature": 0},
        {"repeat_penalty": 1.5, "grammar": "root ::= [a-z ]*"},
    ):
        chain = SamplerChain(model, SamplingOptions(seed=1, **options))
        for token in (-1, n_vocab, 10**6, 2**31 - 1, -(2**31), 2**40):
            refused(TokenizeError, lambda: chain.accept(token), str(token), "vocabulary")
        for token in ("a", 1.5, True, None):
            refused(InvalidParameterError, lambda: chain.accept(token), "token id")
        chain.accept(np.int32(260))  # a numpy integer is a token id too
        assert 0 <= chain.sample(context) < n_vocab
    print("done")
"""


def test_accept_refuses_what_is_not_a_token_of_the_vocabulary(tiny_model_path: Path) -> None:
    runs_to_the_end(_ACCEPT_OUTSIDE_THE_VOCABULARY, str(tiny_model_path))


# Each way a token is picked: the greedy pick in numpy, and llama.cpp's chains ending in dist
# (the defaults: top_k 40, top_p, min_p; the whole vocabulary; mirostat), on the CPU and inside
# the compute graph (where the graph runs them).
_PICKS = [
    {"temperature": 0},
    {"temperature": 0.8},
    {"temperature": 0.8, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
    {"temperature": 0.8, "mirostat": 2},
]


@pytest.mark.parametrize("graph", ["off", "on"])
@pytest.mark.parametrize("options", _PICKS, ids=["greedy", "defaults", "whole", "mirostat"])
def test_a_logit_bias_that_bans_every_token_is_refused(
    tiny_model_path: Path, graph: str, options: dict[str, float]
) -> None:
    """The greedy pick found no finite logit and emitted token 0, banned like the rest; at a
    temperature, llama.cpp's dist sampler picked one of the -inf tokens, output as text."""
    with Llama(tiny_model_path, n_ctx=128, n_threads=2, graph_sampling=graph, seed=1) as llama:
        complete = partial(llama.create_completion, "the cat", max_tokens=3, **options)
        n_vocab = llama.vocab.n_tokens
        eos = llama.vocab.eog_tokens[0]
        everything = dict.fromkeys(range(n_vocab), float("-inf"))
        with pytest.raises(InvalidParameterError, match="no token left to pick: logit_bias"):
            complete(logit_bias=everything)
        with pytest.raises(InvalidParameterError, match="no token left"):  # min_tokens' ban too
            complete(logit_bias={**everything, eos: 0.0}, min_tokens=1)
        # One token left (a bias past float32's range bans too, as llama.cpp adds it): only it.
        result = complete(logit_bias={**dict.fromkeys(range(n_vocab), -1e39), 100: 0.0})
        assert result.choices[0].tokens == (100, 100, 100)


def test_a_grammar_whose_every_token_is_banned_is_refused(tiny_llama: Llama) -> None:
    # Every logit at -inf, dist fell back to the last candidate, token 270 ".", which the
    # grammar took: generated at a temperature (at 0, the grammar refused token 0).
    n_vocab = tiny_llama.vocab.n_tokens
    for temperature in (0.0, 0.8):
        with pytest.raises(GrammarError, match="allows no token"):
            tiny_llama.create_completion(
                "the cat", max_tokens=3, temperature=temperature, top_k=0, top_p=1.0, min_p=0.0,
                grammar='root ::= "."+', logit_bias=dict.fromkeys(range(n_vocab), float("-inf")),
            )  # fmt: skip


def test_a_very_wide_grammar_is_refused_naming_both_causes(tiny_llama: Llama) -> None:
    # Found by review: a grammar holding one parse stack per way it reads the text, nothing
    # recursive in it, was told it was "an ambiguous grammar: a rule that can start over inside
    # itself". A flat alternation of 20,000 is refused before llama.cpp starts it; here each of
    # 100 ways past a "1" opens a 100-way choice of its own: 10,000 stacks after that token.
    ways = " | ".join('"1" choice "."' for _ in range(100))
    choices = " | ".join(f'"z{i}"' for i in range(100))
    nested = f"root ::= {ways}\nchoice ::= {choices}"
    one = tiny_llama.tokenize("1", add_special=False)[-1]
    with pytest.raises(GrammarError) as refused:
        tiny_llama.create_completion(
            "the cat", max_tokens=4, temperature=0, grammar=nested, logit_bias={one: 50}
        )
    message = str(refused.value)
    assert "the grammar holds 10000 parse stacks after a token; the limit is 1024" in message
    assert "one way the grammar can read the text so far" in message
    assert "a rule that can start over inside itself" in message
    assert "a very wide alternation" in message and "ambiguous" not in message
    flat = "root ::= " + " | ".join(f'"{i}"' for i in range(20_000))
    with pytest.raises(GrammarError, match="can begin more than 1024 ways") as refused:
        tiny_llama.create_completion("the cat", max_tokens=4, temperature=0, grammar=flat)
    assert "ambiguous" not in str(refused.value)
    tokens = tiny_llama.create_completion("the cat", max_tokens=3, temperature=0).choices[0].tokens
    assert len(tokens) == 3  # the Llama goes on
    narrow = 'root ::= "1" | "2"'
    text = tiny_llama.create_completion("the cat", max_tokens=3, grammar=narrow).choices[0].text
    assert text in ("1", "2")


class _Unusable(CustomSampler):
    """Sets every logit (or ``token``'s alone) to ``value``."""

    name = "unusable"

    def __init__(self, value: float, token: int | None = None) -> None:
        self.value, self.token = value, token

    def apply(self, candidates: np.ndarray) -> None:
        candidates["logit"][slice(None) if self.token is None else self.token] = self.value


class _Unnamed(_Unusable):
    name = CustomSampler.name  # the default: errors name the class


# What a Python sampler (or logits processor) may leave, and what the error then says.
_UNUSABLE = [
    (math.nan, None, "set the logit of token 0 to NaN"),
    (-math.inf, None, "no token left to pick: the Python sampler '{}' set every logit to -inf"),
    (math.inf, 5, r"set the logit of token 5 to \+inf"),
]


@pytest.mark.parametrize("options", _PICKS, ids=["greedy", "defaults", "whole", "mirostat"])
def test_a_python_sampler_that_leaves_no_usable_logit_is_refused(
    tiny_model_path: Path, options: dict[str, float]
) -> None:
    """Each chain picked some token anyway, output as text: token 0 greedy, 30 with the
    defaults, 270 (the last) over the whole vocabulary, 158 with mirostat; a +inf on token 5
    (softmax makes it NaN) gave 270, not 5. The Llama stays usable."""
    with Llama(tiny_model_path, n_ctx=128, n_threads=2) as llama:
        complete = partial(llama.create_completion, "the cat", max_tokens=3, seed=1, **options)
        expected = complete().choices[0].tokens
        for value, token, words in _UNUSABLE:
            with pytest.raises(InvalidParameterError, match=words.format("unusable")):
                complete(custom_samplers=(_Unusable(value, token),))
        with pytest.raises(InvalidParameterError, match="the Python sampler '_Unnamed'"):
            complete(custom_samplers=(_Unnamed(-math.inf),))
        # -inf bans: a sampler that leaves one token gets it.
        assert complete(custom_samplers=(OnlyToken(100),)).choices[0].tokens == (100,) * 3
        assert complete().choices[0].tokens == expected


class _Bans(CustomSampler):
    """Bans (-inf) the tokens of range ``banned``."""

    def __init__(self, banned: range) -> None:
        self.banned = banned

    def apply(self, candidates: np.ndarray) -> None:
        candidates["logit"][self.banned.start : self.banned.stop] = -math.inf


@pytest.mark.parametrize("python_bans_low", [True, False], ids=["python-low", "python-high"])
@pytest.mark.parametrize("options", _PICKS, ids=["greedy", "defaults", "whole", "mirostat"])
def test_bans_split_between_a_python_sampler_and_logit_bias_leave_no_token(
    tiny_llama: Llama, options: dict[str, float], python_bans_low: bool
) -> None:
    """Each bans half the vocabulary, together all of it: the chain picked a token anyway
    when the Python sampler had banned it (token 0 greedy, 30 with the defaults), since
    only logit_bias's bans were known."""
    n_vocab = tiny_llama.vocab.n_tokens
    low, high = range(n_vocab // 2), range(n_vocab // 2, n_vocab)
    python, biased = (low, high) if python_bans_low else (high, low)
    bias = dict.fromkeys(biased, -math.inf)
    complete = partial(tiny_llama.create_completion, "the cat", seed=1,
                       custom_samplers=(_Bans(python),), **options)  # fmt: skip
    with pytest.raises(InvalidParameterError, match="no token left to pick"):
        complete(max_tokens=3, logit_bias=bias)
    # One token left by both is picked.
    del bias[biased[0]]
    assert complete(max_tokens=2, logit_bias=bias).choices[0].tokens == (biased[0],) * 2


class _BansRewritingIds(_Bans):
    """As _Bans, and writes the ids backwards (they are not copied back)."""

    name = "rewriter"

    def apply(self, candidates: np.ndarray) -> None:
        super().apply(candidates)
        candidates["id"] = candidates["id"][::-1].copy()


def test_split_bans_are_found_whatever_ids_the_python_sampler_wrote(tiny_llama: Llama) -> None:
    """Its bans were looked up through the ids it left: rewritten, they were missed."""
    n_vocab = tiny_llama.vocab.n_tokens
    bias = dict.fromkeys(range(n_vocab // 2, n_vocab), -math.inf)
    sampler = _BansRewritingIds(range(n_vocab // 2))
    with pytest.raises(InvalidParameterError, match="logit_bias and the Python sampler 'rewriter'"):
        tiny_llama.create_completion("the cat", max_tokens=3, temperature=0, logit_bias=bias,
                                     custom_samplers=(sampler,))  # fmt: skip


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_logits_processor_that_leaves_no_usable_logit_is_refused(
    tiny_model_path: Path, temperature: float
) -> None:
    """llama-cpp-python's form: the same tokens were output as text, with the model's
    log-probabilities for them."""
    llm = CompatLlama(str(tiny_model_path), n_ctx=128, n_threads=2, verbose=False)
    try:
        complete = partial(llm.create_completion, "the cat", max_tokens=3, logprobs=1,
                           temperature=temperature, seed=1)  # fmt: skip
        expected = complete()["choices"][0]["text"]
        for value, token, words in _UNUSABLE:

            def unusable(ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
                scores[slice(None) if token is None else token] = value  # noqa: B023
                return scores

            processors = LogitsProcessorList([unusable])
            with pytest.raises(InvalidParameterError, match=words.format("logits_processor")):
                complete(logits_processor=processors)
            with pytest.raises(InvalidParameterError, match=words.format("logits_processor")):
                list(complete(logits_processor=processors, stream=True))
        assert complete()["choices"][0]["text"] == expected
    finally:
        llm.close()


def test_the_server_answers_400_to_a_bias_that_bans_every_token(
    tiny_llama: Llama, tiny_model_path: Path
) -> None:
    n_vocab = tiny_llama.vocab.n_tokens
    eos = tiny_llama.vocab.eog_tokens[0]
    body = {"prompt": "the cat", "temperature": 0.8, "max_tokens": 3}
    server = LiveServer(ServerSettings(model=str(tiny_model_path)), tiny_llama)
    try:
        for path, extra in (
            ("/completion", {"logit_bias": [[t, False] for t in range(n_vocab)]}),  # llama-server
            ("/completion", {"logit_bias": [[t, False] for t in range(n_vocab) if t != eos],
                             "ignore_eos": True}),
            ("/v1/completions", {"logit_bias": dict.fromkeys(map(str, range(n_vocab)), -1e39)}),
            ("/v1/completions", {"logit_bias": dict.fromkeys(map(str, range(n_vocab)), -1e39),
                                 "stream": True}),
        ):  # fmt: skip
            answer = httpx.post(server.url + path, json={**body, **extra})
            assert answer.status_code == 400, answer.text
            assert "no token left to pick: logit_bias" in answer.text
    finally:
        server.close()


# Each overflowed float32 in llama.cpp's arithmetic: a logit of +inf (or NaN), NaN
# probabilities, and the last sampler's fallback to its last candidate (token 270), generated.
@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"logit_bias": {100: 1e39}}, r"logit_bias of token 100 is 1e\+39; a number up to 3\.4e38"),
        ({"logit_bias": {100: math.inf}}, "logit_bias of token 100 is inf"),
        ({"logit_bias": {100: 3e38}}, r"a logit_bias of 3e\+38, temperature 0\.8: a logit"),
        ({"temperature": 1e-44}, "temperature 1e-44: .* at least 3e-31, or 0 for greedy"),
        ({"temperature": math.inf}, "temperature is inf: it must be a finite number"),
        ({"presence_penalty": -1e39}, r"presence_penalty is -1e\+39"),
        ({"frequency_penalty": -1e39}, r"frequency_penalty is -1e\+39"),
        ({"frequency_penalty": -1e37}, r"frequency_penalty -1e\+37, temperature 0\.8"),
        ({"repeat_penalty": 1e39}, r"repeat_penalty is 1e\+39"),
        ({"repeat_penalty": 0.0}, r"repeat_penalty must be > 0 \(1 disables it\), not 0\.0"),
        ({"repeat_penalty": 1e-40}, "repeat_penalty 1e-40, temperature 0.8"),
        ({"dry_multiplier": -1e39}, r"dry_multiplier is -1e\+39"),
        ({"dry_multiplier": -0.5}, r"dry_multiplier must be >= 0 \(0 disables DRY\)"),
        ({"dry_multiplier": 0.8, "dry_base": 1e39}, r"dry_base is 1e\+39"),
        ({"dynatemp_range": 1e39}, r"dynatemp_range is 1e\+39"),
        ({"dynatemp_range": 0.5, "dynatemp_exponent": 1e39}, r"dynatemp_exponent is 1e\+39"),
        ({"top_n_sigma": 1e39}, r"top_n_sigma is 1e\+39"),
        ({"xtc_probability": 1.0, "xtc_threshold": -1e39}, r"xtc_threshold is -1e\+39"),
        ({"mirostat": 2, "mirostat_tau": 1e39}, r"mirostat_tau is 1e\+39"),
        ({"mirostat": 1, "mirostat_eta": 1e39}, r"mirostat_eta is 1e\+39"),
        ({"adaptive_p_target": 1e39}, r"adaptive_p_target is 1e\+39"),
        ({"adaptive_p_target": 0.5, "adaptive_p_decay": -1e39}, r"adaptive_p_decay is -1e\+39"),
    ],
)
def test_sampling_values_that_overflow_a_float32_are_refused(
    tiny_llama: Llama, options: dict[str, object], match: str
) -> None:
    with pytest.raises(InvalidParameterError, match=match):
        tiny_llama.create_completion("the cat", max_tokens=4, seed=1, **{**_WHOLE, **options})


_WHOLE = {"temperature": 0.8, "top_k": 0, "top_p": 1.0, "min_p": 0.0}  # every token a candidate


@pytest.mark.parametrize("ban", [-math.inf, -1e39, -3e38])
def test_a_bias_of_minus_infinity_or_past_float32_still_bans(tiny_llama: Llama, ban: float) -> None:
    """-1e39 is -inf as a float32: a ban, as -inf is; -3e38 (finite) makes the token unlikely."""
    complete = partial(tiny_llama.create_completion, "the cat", max_tokens=8, seed=1, **_WHOLE)
    picked = set(complete().choices[0].tokens)
    tokens = complete(logit_bias=dict.fromkeys(picked, ban)).choices[0].tokens
    assert len(tokens) == 8 and not picked & set(tokens), (picked, tokens)


def test_the_server_answers_400_to_a_sampling_value_past_float32(tiny_model_path: Path) -> None:
    settings = ServerSettings(model=str(tiny_model_path), chat_template="chatml", n_ctx=128,
                              n_threads=2)  # fmt: skip
    server = LiveServer(settings)
    server.wait_until_loaded()
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    prompt = {"prompt": "the cat", "max_tokens": 3}
    try:
        for path, body, match in (
            ("/v1/chat/completions", {**chat, "logit_bias": {"100": 1e39}}, "logit_bias"),
            ("/v1/completions", {**prompt, "temperature": 1e-44}, "temperature 1e-44"),
            ("/v1/completions", {**prompt, "stream": True, "repeat_penalty": 0}, "repeat_penalty"),
            ("/completion", {**prompt, "logit_bias": [[100, 1e39]]}, "logit_bias"),
            ("/completion", {**prompt, "presence_penalty": -1e39}, "presence_penalty"),
            ("/completion", {**prompt, "dry_multiplier": -1e39}, "dry_multiplier"),
        ):
            answer = httpx.post(server.url + path, json=body)
            assert answer.status_code == 400, (path, answer.text)
            assert match in answer.text, (path, answer.text)
    finally:
        server.close()


def test_a_temperature_at_the_bound_still_samples(tiny_llama: Llama) -> None:
    """1e-30 divides a logit of up to 1e8 within float32: sampled, it is the greedy pick."""
    complete = partial(tiny_llama.create_completion, "the cat", max_tokens=4, **_WHOLE)
    greedy = complete(temperature=0).choices[0].tokens
    assert complete(temperature=1e-30, seed=1).choices[0].tokens == greedy


@pytest.mark.real_model
@pytest.mark.parametrize("graph_sampling", ["off", "on"])
def test_a_dynamic_temperature_too_small_for_the_logits_is_greedy(
    gemma_path: Path, graph_sampling: str, bound: list[bool]
) -> None:
    """No setting is refused for it: with dynatemp_range >= temperature a peaked distribution
    (one token biased by +100) gets a tiny dynamic temperature, which took the largest logit
    past float32's range: NaN probabilities, and an arbitrary token ("atthaneDCTask" on the
    CPU; in the graph, with an exponent of 10, the vocabulary's last token). Such a
    temperature is now 0, greedy (llamacrab-sys patch llama-sampler-dynatemp-overflow)."""
    with Llama(gemma_path, n_ctx=256, n_threads=2, graph_sampling=graph_sampling) as llm:
        paris = llm.vocab.tokenize(" Paris", add_special=False)[-1]
        prompt = partial(llm.create_completion, "The capital of France is", max_tokens=3)
        peaked = partial(prompt, **{**_WHOLE, "logit_bias": {paris: 100.0}})
        greedy = peaked(temperature=0).choices[0].tokens
        assert greedy == (paris,) * 3
        for exponent in (1.0, 10.0):
            del bound[:]
            dynamic = peaked(seed=1, temperature=0.5, dynatemp_range=0.5,
                             dynatemp_exponent=exponent)  # fmt: skip
            assert dynamic.choices[0].tokens == greedy, exponent
            assert bound == [graph_sampling == "on"]  # the patch's graph half, there
        # Where the temperature fits the logits it still samples.
        unbiased = partial(prompt, **{**_WHOLE, "temperature": 1.5, "dynatemp_range": 0.5})
        draws = {unbiased(seed=seed).choices[0].tokens for seed in range(3)}
        assert draws - {prompt(temperature=0).choices[0].tokens}, draws


def test_a_bias_of_an_integer_past_a_floats_range_is_refused_by_name() -> None:
    # Found by review: -10**400 passed the check (an int compares with -inf) and the chain's
    # build raised cffi's bare OverflowError.
    for bias in (-(10**400), 10**400):
        with pytest.raises(InvalidParameterError, match="logit_bias of token 1 is"):
            SamplingOptions(logit_bias={1: bias})


_GRAMMAR_PICKS_AN_END_TOKEN = """
    import math
    from llamacrab import Llama
    # The last sampler picked an end-of-generation token the grammar does not allow yet, and
    # the grammar's accept aborted the process (llama-grammar.cpp, GGML_ABORT): the infill
    # sampler puts its end token in when no text is likely enough, ...
    letters = 'root ::= [a-j] "!"'
    infill = SamplingOptions(grammar=letters, infill=True, top_k=0, top_p=1.0, min_p=0.0, seed=1)
    refused(GrammarError, lambda: SamplerChain(model, infill).sample(context),
            "the infill sampler ends the text")
    # ... and with every candidate at -inf an end token is as good a pick as any.
    starts_a = [t for t in range(n_vocab) if piece(t).startswith("a")]
    ban = {t: -math.inf for t in starts_a}
    grammar = 'root ::= "a" "!"'
    chain = SamplerChain(model, SamplingOptions(grammar=grammar, top_k=3, seed=1, logit_bias=ban))
    refused(GrammarError, lambda: chain.sample(context), "the grammar allows no token here")
    llm = Llama(sys.argv[1], n_ctx=64)
    refused(GrammarError, lambda: llm.create_completion(
        "the cat", max_tokens=4, grammar=grammar, logit_bias=ban, top_k=3, seed=1
    ), "the grammar allows no token here")
    unbanned = SamplerChain(model, SamplingOptions(grammar=grammar, top_k=3, seed=1))
    assert piece(unbanned.sample(context)).startswith("a")
    print("done")
"""


def test_an_end_token_the_grammar_does_not_allow_yet_is_never_accepted(
    tiny_model_path: Path,
) -> None:
    runs_to_the_end(_GRAMMAR_PICKS_AN_END_TOKEN, str(tiny_model_path))


_GIVEN_TO_A_GRAPH = """
    graph = decoded("on")
    chain = SamplerChain(model, SamplingOptions(top_k=0, top_p=0.9, min_p=0.0, seed=1))
    assert graph.set_graph_sampler(0, chain) and chain.in_graph
    # llama.cpp initializes a chain for one graph once: a second time aborted
    # (GGML_ASSERT "llama_sampler_chain_backend_init() called twice").
    refused(InvalidParameterError, lambda: graph.set_graph_sampler(0, chain), "already")
    refused(InvalidParameterError, lambda: chain.attach(graph, 0), "already")
    # On the CPU it skips the samplers it runs in the graph: nothing selected, an abort.
    refused(InvalidParameterError, lambda: chain.sample(context), "no token sampled")
    # ggml's top_k asserted k <= n_vocab at the next decode.
    wide = SamplerChain(model, SamplingOptions(top_k=n_vocab + 1, seed=1))
    refused(InvalidParameterError, lambda: graph.set_graph_sampler(0, wide), "compute graph")
    with Batch(8) as batch:
        batch.set(np.array([261], np.int32), 2)
        graph.decode(batch)
    assert 0 <= chain.sample(graph) < n_vocab
    print("done")
"""


def test_set_graph_sampler_takes_only_what_attach_would(tiny_model_path: Path) -> None:
    runs_to_the_end(_GIVEN_TO_A_GRAPH, str(tiny_model_path))


_TWO_THREADS = """
    import threading
    from llamacrab import ConcurrentUseError
    # Two threads accepting into one chain died of SIGSEGV; a reset during an accept left a
    # grammar's parse stack on an END element (an abort in llama-grammar.cpp).
    inside, release = threading.Event(), threading.Event()

    class Waits(CustomSampler):
        def apply(self, candidates):
            inside.set()
            release.wait(30)

    options = SamplingOptions(seed=1, grammar="root ::= [a-z]*", repeat_penalty=1.1,
                              custom_samplers=(Waits(),))  # fmt: skip
    chain = SamplerChain(model, options)
    worker = threading.Thread(target=chain.sample, args=(context,))
    worker.start()
    assert inside.wait(30)
    for action in (lambda: chain.accept(260), chain.reset, lambda: chain.accept_prompt([260])):
        refused(ConcurrentUseError, action, "in use by another thread")
    release.set()
    worker.join()
    chain.reset()
    assert 0 <= chain.sample(context) < n_vocab
    print("done")
"""


def test_one_chain_is_used_by_one_thread_at_a_time(tiny_model_path: Path) -> None:
    runs_to_the_end(_TWO_THREADS, str(tiny_model_path))


@pytest.mark.real_model
def test_the_infill_sampler_gets_a_bounded_number_of_candidates(gemma: Llama) -> None:
    """It compares every candidate's piece with every other's in one call: on Gemma 3's
    262,144 tokens (top_k 0) a single pick ran for more than a minute (by its scale, an hour)."""
    for options in ({"top_k": 0}, {"top_k": 5000}, {"top_k": 40, "order": ("top_p", "min_p")}):
        with pytest.raises(InvalidParameterError, match="infill sampler would compare"):
            SamplerChain(gemma.model, SamplingOptions(infill=True, **options))  # type: ignore[arg-type]
    SamplerChain(gemma.model, SamplingOptions(infill=True, top_k=4096)).close()


def test_a_dry_allowed_length_that_overflows_its_arithmetic_is_refused() -> None:
    # DRY computes a repeat's length minus it in int32: INT32_MIN overflowed (UB).
    with pytest.raises(InvalidParameterError, match="dry_allowed_length"):
        SamplingOptions(dry_multiplier=0.8, dry_allowed_length=-(2**31))
    assert SamplingOptions(dry_allowed_length=-5).dry_allowed_length == -5
