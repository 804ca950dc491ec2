"""A grammar's end on a model whose vocabulary has no end-of-generation token: llama.cpp's
grammar allows only an end token where its text is complete, so there it allowed no token at
all, and generation raised GrammarError where a model with one ends (finish_reason "eos",
"stop" through the OpenAI-style APIs). With every end token banned (llama-server's
ignore_eos) a complete grammar ends it too, with "stop". A grammar at a real dead end still
raises."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest

from llamacrab import (
    Batch,
    Context,
    ContextParams,
    GrammarError,
    Llama,
    Model,
    ModelParams,
    SamplerChain,
    SamplingOptions,
)
from llamacrab._native.call import lib
from llamacrab._native.grammar_sampler import GrammarEnd, grammar_sampler, has_border, refused
from llamacrab.compat import Llama as CompatLlama
from llamacrab.compat import LlamaGrammar

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")

CAT = 'root ::= " cat"'  # complete after " cat": nothing may follow
CAT_DOG = 'root ::= "cat" " dog"?'  # may end after "cat", or go on with " dog"
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def endless_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("endless") / "no-end.gguf"
    return Path(tiny.write_tiny_llama(path, no_end_tokens=True, chat_templates={"": TEMPLATE}))


@pytest.fixture(scope="module")
def endless(endless_path: Path) -> Iterator[Llama]:
    with Llama(endless_path, n_ctx=128, n_threads=2) as llm:
        assert llm.vocab.eog_tokens == ()  # nothing for the grammar to allow at its end
        yield llm


def space_banned(llm: Llama) -> dict[int, float]:
    return dict.fromkeys(llm.vocab.tokenize(" ", add_special=False), float("-inf"))


def test_a_complete_grammar_ends_the_generation(endless: Llama) -> None:
    result = endless.create_completion("the", grammar=CAT, max_tokens=16, temperature=0)
    assert (result.text, result.choices[0].finish_reason) == (" cat", "eos")
    sampled = endless.create_completion("the", grammar=CAT, max_tokens=16, seed=3)
    assert (sampled.text, sampled.choices[0].finish_reason) == (" cat", "eos")
    chunks = list(endless.stream_completion("the", grammar=CAT, max_tokens=16, temperature=0))
    assert "".join(chunk.text for chunk in chunks) == " cat"
    assert chunks[-1].finish_reason == "eos"
    chat = endless.create_chat_completion(
        [{"role": "user", "content": "the"}], grammar=CAT, max_tokens=16, temperature=0
    )
    assert (chat.choices[0].message.content, chat.choices[0].finish_reason) == (" cat", "eos")
    # One that may go on does, until nothing may follow.
    longer = endless.create_completion("the", grammar=CAT_DOG, max_tokens=32, temperature=0)
    assert (longer.text, longer.choices[0].finish_reason) == ("cat dog", "eos")


def test_the_compat_api_finishes_with_stop(endless_path: Path) -> None:
    with CompatLlama(str(endless_path), n_ctx=128, n_threads=2, verbose=False) as llm:
        grammar = LlamaGrammar.from_string(CAT, verbose=False)
        whole = llm.create_completion("the", grammar=grammar, max_tokens=16, temperature=0)
        assert whole["choices"][0]["text"] == " cat"
        assert whole["choices"][0]["finish_reason"] == "stop"
        streamed = list(
            llm.create_completion("the", grammar=grammar, max_tokens=16, temperature=0, stream=True)
        )
        assert "".join(chunk["choices"][0]["text"] for chunk in streamed) == " cat"
        assert streamed[-1]["choices"][0]["finish_reason"] == "stop"
        # generate() ends after the text: no end token to yield (token_eos() is -1 here).
        prompt = llm.tokenize(b"the", add_bos=False)
        tokens = list(llm.generate(prompt, temp=0, grammar=grammar))
        assert tokens == llm.tokenize(b" cat", add_bos=False)


def test_a_grammar_that_may_end_ends_where_its_continuation_is_banned(endless: Llama) -> None:
    """With an end token the grammar would allow it after "cat": the end, not an error."""
    result = endless.create_completion(
        "the", grammar=CAT_DOG, logit_bias=space_banned(endless), max_tokens=16, temperature=0
    )
    assert (result.text, result.choices[0].finish_reason) == ("cat", "eos")


def test_a_dead_end_is_still_an_error(endless: Llama) -> None:
    with pytest.raises(GrammarError, match="allows no token here"):
        endless.create_completion(
            "the", grammar=CAT, logit_bias=space_banned(endless), max_tokens=16, temperature=0
        )
    with pytest.raises(GrammarError, match="before min_tokens"):
        endless.create_completion("the", grammar=CAT, min_tokens=8, max_tokens=16)
    # The model goes on working.
    assert endless.create_completion("the", grammar=CAT, max_tokens=16).text == " cat"


def every_end_banned(llm: Llama) -> dict[int, float]:
    """llama-server's ignore_eos: a -inf bias on each end-of-generation token."""
    return dict.fromkeys(llm.vocab.eog_tokens, float("-inf"))


def test_a_complete_grammar_with_every_end_banned_ends_with_stop(gemma: Llama) -> None:
    """Gemma has end tokens; banned (ignore_eos), the complete grammar allowed no token and the
    generation raised GrammarError, where a vocabulary without any ends it. It ends there now,
    with "stop": no end token ended it."""
    banned = every_end_banned(gemma)
    result = gemma.create_completion(
        "The", grammar=CAT, logit_bias=banned, max_tokens=8, temperature=0
    )
    assert (result.text, result.choices[0].finish_reason) == (" cat", "stop")
    sampled = gemma.create_completion("The", grammar=CAT, logit_bias=banned, max_tokens=8, seed=3)
    assert (sampled.text, sampled.choices[0].finish_reason) == (" cat", "stop")
    chunks = list(gemma.stream_completion("The", grammar=CAT, logit_bias=banned, max_tokens=8))
    assert ("".join(chunk.text for chunk in chunks), chunks[-1].finish_reason) == (" cat", "stop")
    # Where the grammar may end or go on, the ban makes it go on, to its end.
    longer = gemma.create_completion(
        "The", grammar=CAT_DOG, logit_bias=banned, max_tokens=8, temperature=0
    )
    assert (longer.text, longer.choices[0].finish_reason) == ("cat dog", "stop")
    # One end token left allowed ends it as the model's end does.
    one_left = every_end_banned(gemma)
    del one_left[gemma.vocab.eos]
    at_eos = gemma.create_completion(
        "The", grammar=CAT, logit_bias=one_left, max_tokens=8, temperature=0
    )
    assert (at_eos.text, at_eos.choices[0].finish_reason) == (" cat", "eos")


def test_with_every_end_banned_a_dead_end_is_still_an_error(gemma: Llama) -> None:
    # Every token that spells a digit (its own, and a byte token's), as the grammar finds them.
    sampler = grammar_sampler(gemma.vocab, "root ::= [0-9]", "root", ())
    everything = np.arange(gemma.vocab.n_tokens, dtype=np.int32)
    digit_tokens = np.flatnonzero(~refused(sampler, everything)).tolist()
    lib.llama_sampler_free(sampler)
    assert len(digit_tokens) == 20
    digits = {**every_end_banned(gemma), **dict.fromkeys(digit_tokens, float("-inf"))}
    with pytest.raises(GrammarError, match="allows no token here"):
        gemma.create_completion(
            "The", grammar="root ::= [0-9]", logit_bias=digits, max_tokens=8, temperature=0
        )
    with pytest.raises(GrammarError, match="logit_bias bans every one, before min_tokens"):
        gemma.create_completion(
            "The", grammar=CAT, logit_bias=every_end_banned(gemma), min_tokens=4, max_tokens=8
        )


def test_a_chain_at_a_complete_grammar_refuses_until_reset(endless_path: Path) -> None:
    """SamplerChain used directly: the same end, as a GrammarError; a lazy grammar too, which
    starts at its trigger word."""
    llm = Llama(endless_path, n_ctx=64, n_threads=2)
    model = llm.model
    with Context(model, ContextParams(n_ctx=64)) as context, Batch(8) as batch:
        batch.set(np.array(model.vocab.tokenize("the", add_special=False), np.int32), 0)
        context.decode(batch)
        chain = SamplerChain(
            model,
            SamplingOptions(grammar='root ::= "cat."', grammar_trigger_words=("cat",), seed=1),
        )
        for _ in range(2):
            for token in model.vocab.tokenize("a cat.", add_special=False):
                chain.accept(token)
            with pytest.raises(GrammarError, match="the grammar is complete"):
                chain.sample(context)
            with pytest.raises(GrammarError, match=r"reset\(\)"):
                chain.sample(context)
            chain.reset()
        assert 0 <= chain.sample(context) < model.vocab.n_tokens  # waiting for "cat" again
        chain.close()
    llm.close()


def test_a_token_with_a_border_does_not_probe_the_end(tmp_path: Path) -> None:
    """At the start of "a" | [^a] .* every token with a text but "aa" is allowed, and the
    grammar followed by "aa" takes "a" then "aa": "aa" itself, though the grammar is not at
    its end. Tokens whose text ends with its own start cannot tell, and are passed over."""
    path = tiny.write_tiny_llama(
        tmp_path / "aa.gguf", no_end_tokens=True, extra_tokens=[("aa", gguf.TokenType.NORMAL)]
    )
    grammar = 'root ::= "a" | [^a] .*'
    with Model.load(path, ModelParams(vocab_only=True)) as model:
        end = GrammarEnd(model.vocab, grammar, "root", ())
        assert not end.may_end()  # nothing read yet
        end.tokens = model.vocab.tokenize("a", add_special=False)
        assert end.may_end()  # "a": complete


def test_borders() -> None:
    assert [has_border(text) for text in ("aa", "abab", "abcab", "<s><s")] == [True] * 4
    assert [has_border(text) for text in ("a", "ab", "aab", "<s>", "日本")] == [False] * 5
