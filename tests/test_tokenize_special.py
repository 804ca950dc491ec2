"""Splitting a text at special tokens, which llamacrab-sys's llama-vocab-special-partition-linear
patch made linear: the tokens of tricky texts are those the unpatched llama.cpp gave (taken from
it when the patch was written), and those of generated texts, with and without the whitespace
strip after a special token, those of a Python model of the unpatched algorithm; so the patch
changed the cost and nothing else."""

from __future__ import annotations

import random
from pathlib import Path

import gguf
import pytest

from llamacrab import Llama, Model, ModelParams

from support import load_repo_module

# (text, parse_special, Gemma 3's tokens): special tokens glued to each other, cut short,
# nested in their own text, after and before whitespace; user-defined whitespace tokens ("\n\n",
# "\t\t") are split out with parse_special off too.
GEMMA_CASES = [
    # <start_of_turn> < start _ of _ turn
    ("<start_of_turn><start_of_turn", True, [105, 236820, 3041, 236779, 1340, 236779, 887]),
    # <start_of_turn> user \n hi <end_of_turn> \n <start_of_turn> model \n
    (
        "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
        True,
        [105, 2364, 107, 2202, 106, 107, 105, 4368, 107],
    ),
    # < <end_of_turn> > x <end_of_turn> <end_of_turn> " " <end_of_turn> \t \n
    (
        "<<end_of_turn>>x<end_of_turn><end_of_turn> <end_of_turn>\t\n",
        True,
        [236820, 106, 236813, 236781, 106, 106, 236743, 106, 255968, 107],
    ),
    # < end _ of _ <end_of_turn> turn >< end _ of _ turn
    (
        "<end_of_<end_of_turn>turn><end_of_turn",
        True,
        [236820, 643, 236779, 1340, 236779, 106, 887, 1798, 643, 236779, 1340, 236779, 887],
    ),
    # 日本 <start_of_image> 🦀 <unused12> <unused1> \n\n\n < unused 1
    (
        "日本<start_of_image>🦀<unused12><unused1>\n\n\n<unused1",
        True,
        [10956, 255999, 248714, 18, 7, 109, 236820, 63634, 236770],
    ),
    # < end _ of _ turn > x: a control token is text with parse_special off
    ("<end_of_turn>x", False, [236820, 643, 236779, 1340, 236779, 887, 236813, 236781]),
    # a \n\n b \n\n\n "  " c \t\t d " " \n
    (
        "a\n\nb\n\n\n  c\t\td \n",
        False,
        [236746, 108, 236763, 109, 138, 236755, 255969, 236753, 236743, 107],
    ),
]


@pytest.mark.parametrize(("text", "parse_special", "tokens"), GEMMA_CASES)
def test_special_tokens_split_as_llama_cpp_did(
    gemma: Llama, text: str, parse_special: bool, tokens: list[int]
) -> None:
    assert gemma.tokenize(text, add_special=False, parse_special=parse_special) == tokens


@pytest.mark.parametrize(
    ("unit", "parse_special", "tokens"),
    [
        ("<end_of_turn>x", True, [106, 236781]),
        ("a\n", False, [236746, 107]),  # "\n" is a user-defined token: split out regardless
    ],
)
def test_thousands_of_special_tokens_in_one_text(
    gemma: Llama, unit: str, parse_special: bool, tokens: list[int]
) -> None:
    # Every split after the first continues in the fragment the one before left.
    text = unit * 5000
    assert gemma.tokenize(text, add_special=False, parse_special=parse_special) == tokens * 5000


def test_special_tokens_sharing_a_prefix(tmp_path: Path) -> None:
    path = load_repo_module("scripts/make_tiny_gguf.py").write_tiny_llama(
        tmp_path / "tiny-fim.gguf", fim=True
    )
    with Model.load(path, ModelParams(vocab_only=True)) as model:
        vocab = model.vocab
        text = "<|fim_prefix|><|fim_suffix|<|fim_middle|>the cat<|fim_pad|><|fim_pad|></s><s"
        tokens = vocab.tokenize(text, add_special=False, parse_special=True)
    # <|fim_prefix|> (271), "<|fim_suffix|" in bytes, <|fim_middle|> (273), the cat,
    # <|fim_pad|> (274) twice, </s> (2), "<s" in bytes
    assert tokens == [
        271, 259, 63, 127, 105, 108, 112, 98, 118, 120, 105, 105, 108, 123, 127,
        273, 259, 119, 107, 104, 259, 102, 100, 119, 274, 274, 2, 259, 63, 118,
    ]  # fmt: skip


# The unpatched partition, modelled in Python (tokenizer_st_partition at the pin): each special
# token, longest first, splits every text fragment left at each of its matches; a token with
# RSTRIP drops the whitespace (C's isspace) after it. parse_special off leaves control and
# unknown tokens in the text. Compared with the patched library on generated texts.
UD, CONTROL = int(gguf.TokenType.USER_DEFINED), int(gguf.TokenType.CONTROL)
SPECIAL_TYPES = {UD, CONTROL, int(gguf.TokenType.UNKNOWN)}
EXTRA_TOKENS = [
    ("x", UD), ("é!", UD), ("日本", UD), ("aa", UD), ("aaa", CONTROL), ("bab", UD), ("\t\t", UD),
    ("<s>x", CONTROL), ("</s>", CONTROL), ("<|endoftext|>", CONTROL),
]  # fmt: skip
PIECES = [
    b"<s>", b"</s>", b"<unk>", b"<pad>", b"<|fim_pad|>", b"<|fim_prefix|>", b" ", b"  ", b"\t",
    b"\n", b"a", b"b", b"<", b">", b"|", b"<|fim_", b"s>", "日".encode(), "本".encode(),
    "é".encode(), b"!", b"x", b"\x80", b"\xff", b"\xc3",
]  # fmt: skip
C_SPACE = b" \t\n\r\v\f"
# llama.cpp's phi3 quirk (general.name "phi3..."): every special token strips the whitespace
# after it but these.
PHI3_NO_RSTRIP = {"<unk>", "<s>", "<|endoftext|>"}

Fragment = tuple[int, int] | int  # (offset, length) of text still to tokenize, or a token


def unpatched_partition(
    text: bytes, special: list[tuple[int, bytes, bool, bool]], parse_special: bool
) -> list[Fragment]:
    """``special``: (id, text, is_control_or_unknown, rstrip) in llama.cpp's order."""
    fragments: list[Fragment] = [(0, len(text))]
    for token, token_text, control, rstrip in special:
        if control and not parse_special:
            continue
        split: list[Fragment] = []
        for fragment in fragments:
            if isinstance(fragment, int):
                split.append(fragment)
                continue
            offset, length = fragment
            while length > 0:
                match = text.find(token_text, offset, offset + length)
                if match < 0:
                    split.append((offset, length))
                    break
                if match > offset:
                    split.append((offset, match - offset))
                split.append(token)
                end = offset + length
                offset = match + len(token_text)
                while rstrip and offset < end and text[offset] in C_SPACE:
                    offset += 1
                length = end - offset
        fragments = split
    return fragments


@pytest.mark.parametrize("name", ["llamacrab-tiny", "phi3-tiny"])
def test_special_tokens_split_as_the_unpatched_algorithm(tmp_path: Path, name: str) -> None:
    tiny = load_repo_module("scripts/make_tiny_gguf.py")
    path = tiny.write_tiny_llama(
        tmp_path / f"{name}.gguf", fim=True, no_end_tokens=True, extra_tokens=EXTRA_TOKENS,
        name=name,
    )  # fmt: skip
    texts, _, types = tiny.vocabulary(fim=True, no_end_tokens=True, extra_tokens=EXTRA_TOKENS)
    phi3 = name.startswith("phi3")
    special = [
        (token, text.encode(), kind != UD, phi3 and text not in PHI3_NO_RSTRIP)
        for token, (text, kind) in enumerate(zip(texts, types, strict=True))
        if kind in SPECIAL_TYPES
    ]
    special.sort(key=lambda entry: -len(entry[1]))  # longest first, as llama.cpp sorts them
    rng = random.Random(0)
    with Model.load(path, ModelParams(vocab_only=True)) as model:
        vocab = model.vocab

        def expected(text: bytes, parse_special: bool) -> list[int]:
            tokens: list[int] = []
            for fragment in unpatched_partition(text, special, parse_special):
                if isinstance(fragment, int):
                    tokens.append(fragment)
                else:  # its own text holds no special token left to split out
                    offset, length = fragment
                    piece = text[offset : offset + length]
                    tokens += vocab.tokenize(piece, add_special=False, parse_special=False)
            return tokens

        assert vocab.tokenize(b"</s>  a", add_special=False, parse_special=True) == (
            expected(b"</s>  a", True)
        )
        for _ in range(300):
            text = b"".join(rng.choice(PIECES) for _ in range(rng.randint(1, 25)))
            for parse_special in (True, False):
                tokens = vocab.tokenize(text, add_special=False, parse_special=parse_special)
                assert tokens == expected(text, parse_special), (text, parse_special)
