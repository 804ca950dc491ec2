"""Text a Python str can hold that C cannot take, text that cost quadratic time, and requests
that leave sampling nothing.

Found by a hostile-input hunt: a lone surrogate (JSON's "\\ud800", a name decoded with
surrogateescape) has no UTF-8 and raised UnicodeEncodeError from inside the tokenizer; a run of
characters no token covers tokenized in quadratic time; a grammar whose every token was banned
raised llama.cpp's "Unexpected empty grammar stack" as a NativeError; a tool_choice whose
function was not an object raised AttributeError."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llamacrab import GrammarError, InvalidParameterError, Llama, TokenizeError
from llamacrab._chat.generic_tools import generic_grammar
from llamacrab._chat.options import ChatOptions

LONE = "a\ud800b"


def test_a_lone_surrogate_is_a_tokenize_error_naming_it(tiny_llama: Llama) -> None:
    with pytest.raises(TokenizeError, match=r"not valid Unicode: an unpaired surrogate "
                       r"'\\ud800' at character 1"):  # fmt: skip
        tiny_llama.tokenize(LONE)
    with pytest.raises(TokenizeError, match="unpaired surrogate"):
        tiny_llama.create_completion(LONE, max_tokens=1)
    # A surrogate pair is a character like any other, and the Llama still works.
    assert tiny_llama.tokenize("\U0001f600") == tiny_llama.tokenize("😀")
    assert tiny_llama.create_completion("hi", max_tokens=2, temperature=0).choices[0].text


def test_a_lone_surrogate_in_a_grammar_is_a_grammar_error(tiny_llama: Llama) -> None:
    with pytest.raises(GrammarError, match="the grammar is not valid Unicode"):
        tiny_llama.create_completion("hi", max_tokens=1, grammar=f'root ::= "{LONE}"')


@pytest.fixture
def odd_named_model(tiny_model_path: Path, tmp_path: Path) -> Iterator[str]:
    raw = os.fsencode(tmp_path) + b"/model-\xff\xfe.gguf"  # not UTF-8
    shutil.copyfile(tiny_model_path, raw)
    yield os.fsdecode(raw)  # "...model-\udcff\udcfe.gguf"


def test_a_file_name_that_is_not_utf8_loads(odd_named_model: str) -> None:
    # The path went to C as UTF-8, which a surrogate-escaped name has none of; the bytes the
    # system gave (os.fsencode) name the file.
    with Llama(odd_named_model, n_ctx=64, n_threads=1) as llm:
        assert llm.create_completion("hi", max_tokens=1).choices[0].finish_reason


def test_a_grammar_left_without_a_token_is_a_grammar_error(tiny_llama: Llama) -> None:
    every = range(tiny_llama.vocab.n_tokens)
    for bias in (-float("inf"), -1e39):  # -1e39 is -inf as a float32
        with pytest.raises(GrammarError, match="the grammar allows no token here"):
            tiny_llama.create_completion("hi", max_tokens=3, grammar='root ::= "x"',
                                         logit_bias=dict.fromkeys(every, bias))  # fmt: skip
    # The same Llama samples the grammar when the token is allowed.
    text = tiny_llama.create_completion("hi", max_tokens=3, grammar='root ::= "x"').choices[0]
    assert text.text == "x"


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    "choice",
    [{"type": "function", "function": "f"}, {"function": ["f"]}, {"function": {"name": 5}},
     {"type": "function"}],
)  # fmt: skip
def test_a_tool_choice_without_a_function_object_names_the_shape(choice: dict) -> None:
    with pytest.raises(InvalidParameterError, match=r'needs \{"function": \{"name": \.\.\.\}\}'):
        generic_grammar(TOOLS, choice)
    with pytest.raises(InvalidParameterError, match=r'needs \{"function": \{"name": \.\.\.\}\}'):
        ChatOptions(tools=TOOLS, tool_choice=choice)


def test_a_run_no_token_covers_tokenizes_in_linear_time(tiny_llama: Llama) -> None:
    # SPM's byte fallback reserved one character's bytes more at a time, copying the output
    # for each (patch llama-vocab-spm-byte-fallback-linear): 4x the text took 16x the time,
    # and an 8 MiB request body minutes inside one call nothing can interrupt.
    def seconds(n: int) -> float:
        text = "a" * n  # the tiny vocabulary has no "a": every one falls back to a byte
        runs = []
        for _ in range(3):
            started = time.perf_counter()
            assert len(tiny_llama.tokenize(text, add_special=False)) == n
            runs.append(time.perf_counter() - started)
        return min(runs)

    small, large = seconds(100_000), seconds(400_000)
    assert large < 8 * small, (small, large)


def test_bytes_tokenize_as_they_are_utf8_or_not(tiny_llama: Llama) -> None:
    # llama-cpp-python's tokenize takes bytes, a piece cut mid-character included; the compat
    # layer refused what is not UTF-8 (TokenizeError).
    from llamacrab.compat import Llama as CompatLlama

    assert tiny_llama.tokenize(b"the cat") == tiny_llama.tokenize("the cat")
    cut = "é".encode()[:1]  # half of a two-byte character
    tokens = tiny_llama.tokenize(b"the " + cut, add_special=False)
    assert b"".join(tiny_llama.vocab.token_to_bytes(t) for t in tokens).endswith(cut)
    compat = CompatLlama(model_path=str(tiny_llama.model.path), n_ctx=64, verbose=False)
    try:
        assert compat.tokenize(b"the " + cut, add_bos=False) == tokens
    finally:
        compat.close()
