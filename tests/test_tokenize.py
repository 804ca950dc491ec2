"""Tokenization round trips and incremental detokenization on the real Gemma vocabulary."""

from __future__ import annotations

import numpy as np
import pytest

from llamacrab import Llama, TokenizeError

TEXTS = [
    "Olá, coração! Ação, informação e pão-de-ló à beça.",
    "東京は日本の首都です。北京是中国的首都。",
    "Emoji: 👩‍👩‍👧‍👦 🇵🇹 🤖🦀 🦩 ok, and rarer: 𓀀 ꙮ \U0001d518\U0001d52b\U0001d526",
    "Combining: e\u0301 a\u0308 n\u0303 — Zalgo: Z\u0351\u034b\u0364a\u0364l\u0357g\u0350o",
    "Ελληνικά, русский, العربية, עברית, हिन्दी",
]

pytestmark = pytest.mark.real_model


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(gemma: Llama, text: str) -> None:
    tokens = gemma.tokenize(text, add_special=False)
    assert tokens and gemma.detokenize(tokens) == text


def test_add_special_prepends_bos(gemma: Llama) -> None:
    tokens = gemma.tokenize("hello")
    assert tokens[0] == gemma.vocab.bos
    assert gemma.tokenize("hello", add_special=False) == tokens[1:]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_decoding_never_emits_half_a_character(gemma: Llama, text: str) -> None:
    decoder = gemma.vocab.decoder()
    pieces = [decoder.feed([t]) for t in gemma.tokenize(text, add_special=False)]
    pieces.append(decoder.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_emoji_spans_several_tokens(gemma: Llama) -> None:
    # The premise of the test above: some character really is split across tokens.
    tokens = gemma.tokenize("🦩𓀀", add_special=False)
    raw = [gemma.vocab.token_to_bytes(t) for t in tokens]
    assert len(raw) == 8 and all(len(piece) == 1 for piece in raw)


def test_long_text_buffer_is_sized_by_asking_c(gemma: Llama) -> None:
    text = "word " * 5000
    assert gemma.detokenize(gemma.tokenize(text, add_special=False)) == text


def test_out_of_range_tokens(gemma: Llama) -> None:
    with pytest.raises(TokenizeError, match="outside the vocabulary"):
        gemma.detokenize([5, 262_144])
    with pytest.raises(TokenizeError):
        gemma.vocab.token_to_piece(-1)


def test_token_ids_of_any_integer_kind_are_taken_and_nothing_else(tiny_llama: Llama) -> None:
    vocab = tiny_llama.vocab
    taken = [[np.uint64(5), 3], np.array([5, 3], dtype=np.uint16), (np.int8(5), 3), [5, 3]]
    for tokens in taken:  # numpy makes floats of numpy's unsigned mixed with Python's ints
        assert vocab.check_tokens(tokens).tolist() == [5, 3]
    outside = [[2**63, 1], [np.int64(1), 2**70], [-1]]  # past int64: a JSON body can send it
    for tokens in outside:
        with pytest.raises(TokenizeError, match="outside the vocabulary"):
            vocab.check_tokens(tokens)
    for tokens in ([1.5], np.array([1.0]), [True], ["a"], [None], [1, "2"]):
        with pytest.raises(TokenizeError, match="token ids must be integers"):
            vocab.check_tokens(tokens)  # type: ignore[arg-type]
