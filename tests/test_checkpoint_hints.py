"""Where a text prompt asks a sliding-window model for a checkpoint: the token position where its
last sentence (or line) starts, found as text and checked against the prompt's own tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from llamacrab import Llama
from llamacrab._features.checkpoint_hints import last_sentence_start, suffix_start


@pytest.mark.parametrize(
    ("text", "last"),
    [
        ("The cat sat. The dog ran", "The dog ran"),
        ("Is it? Yes! it is.  ", "it is.  "),  # trailing space is no sentence of its own
        # A tokenizer that prefixes text with a space (the tiny model's) has no tokens that
        # start a line's text after a newline; Gemma's does (the real-model test below).
        ("the cat sat.\nthe dog ran", None),
        ("line one\nline two\n", None),
    ],
)
def test_the_last_sentence_starts_where_its_tokens_do(
    tiny_llama: Llama, text: str, last: str | None
) -> None:
    vocab = tiny_llama.vocab
    tokens = vocab.tokenize(text)
    start = last_sentence_start(vocab, text, tokens)
    if last is None:
        assert start is None
    else:
        assert start is not None
        assert tokens[start:] == vocab.tokenize(last, add_special=False)


@pytest.mark.real_model
def test_gemma_starts_a_line_after_its_newline(gemma_path: Path) -> None:
    with Llama(gemma_path, n_ctx=256, n_threads=1) as llm:
        for text, last in (("line one\nline two\n", "line two\n"),
                           ("A b. Question: which?", " Question: which?"),
                           ("\u732b\u304c\u5ea7\u3063\u305f\u3002\u72ac\u304c\u8d70\u308b",
                            "\u72ac\u304c\u8d70\u308b")):  # fmt: skip
            tokens = llm.tokenize(text)
            start = last_sentence_start(llm.vocab, text, tokens)
            assert start is not None
            assert tokens[start:] == llm.tokenize(last, add_special=False)


def test_no_sentence_boundary_or_a_joined_token_gives_none(tiny_llama: Llama) -> None:
    vocab = tiny_llama.vocab
    assert last_sentence_start(vocab, "one long clause", vocab.tokenize("one long clause")) is None
    assert last_sentence_start(vocab, "ends here. ", vocab.tokenize("ends here. ")) is None
    text = "the cat sat"
    tokens = vocab.tokenize(text)
    assert suffix_start(vocab, text, tokens, 0, False) is None  # not inside the text
    assert suffix_start(vocab, text, tokens, len(text), False) is None
    assert suffix_start(vocab, text, [1, 2, 3], 4, False) is None  # not the prompt's tokens
