"""Check a GGUF model's vocabulary (tokens and token types) before llama_vocab::load reads it:
distinct tokens, the depth of a tokenizer's trie, byte tokens, and RWKV's and PLaMo-2's tables.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from llamacrab._native.gguf import plamo2
from llamacrab._native.gguf_reader import (
    INT32,
    STRING,
    TOKEN_TYPES,
    TOKENS,
    GgufArray,
    Reader,
    StringTable,
)

_NORMAL_TOKEN, _USER_DEFINED_TOKEN, _UNUSED_TOKEN, _BYTE_TOKEN = 1, 4, 5, 6  # LLAMA_TOKEN_TYPE_*
# llama.cpp's naive_trie (src/llama-vocab.cpp) inserts a token, frees it and matches it (UGM's
# user-defined tokens) one nested call per byte: ~180 bytes of stack a byte (x86-64 Release
# build: a 256 KiB thread died loading a 1,455-byte token, a 1 MiB one at 5,971, the 8 MiB main
# thread near 45,000, a SIGSEGV). 512 bytes take ~90 KiB, within musl's 128 KiB default thread
# stack; the longest tokens of real trie vocabularies are 128 bytes (RWKV World) and 48 (XLM-R's
# t5 vocabulary). BPE vocabularies, which hold tokens of 1,024 bytes (GPT-NeoX), build no trie.
MAX_TRIE_TOKEN_BYTES = 512
# The tokenizers that build such a trie, and the token types they put in it (None: every token).
_TRIE_TOKEN_TYPES = {"rwkv": None, "t5": (_NORMAL_TOKEN, _USER_DEFINED_TOKEN, _UNUSED_TOKEN)}
# The tokenizers whose token_to_byte reads a byte token's value from its text, as substr(3, 2)
# (SPM, UGM and BPE): a text shorter than 3 bytes throws at load, another one gives a wrong byte.
_SPELT_BYTE_MODELS = ("llama", "t5", "gpt2", "hybriddna", "whitespace", "gemma4")
_BYTE_SPELLING = re.compile(rb"<0x[0-9A-Fa-f]{2}>")
_UGM_LOAD_UNKNOWN = 2  # the unknown token t5's load tokenizes with before reading the file's


def check_vocabulary(reader: Reader, metadata: dict[str, Any]) -> None:
    """What llama_vocab::load asserts on, divides by, overflows the stack with, spends minutes
    on or throws C++ library errors for (std::out_of_range as the message) while loading the
    vocabulary."""
    model = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get(TOKENS)
    if model in ("none", "no_vocab") or not isinstance(tokens, GgufArray):
        return  # no vocabulary is read (the Vocab handle refuses the model), or llama.cpp throws
    words = tokens.strings
    if tokens.item_kind != STRING or words is None:
        return  # llama.cpp throws
    if not words:  # the "test" tokenizer divides by the vocabulary size
        raise reader.fail(f"{TOKENS} is empty")
    repeated = words.first_repeated()
    if repeated is not None:
        raise reader.fail(
            f"{TOKENS} holds {words.kept(repeated).decode('utf-8', 'replace')!r} twice: "
            "llama.cpp needs distinct tokens"
        )
    types = _token_types(metadata, len(words))
    _check_trie_depth(reader, model, words, types)
    if model == "plamo2":  # its table's cost is cubic in a token's length
        in_table = None if types is None else types != _BYTE_TOKEN
        if problem := plamo2.table_problem(words.region, words.starts, in_table):
            raise reader.fail(problem)
    if model == "t5" and len(words) <= _UGM_LOAD_UNKNOWN:  # std::out_of_range at load
        raise reader.fail(
            f"a t5 (UGM) vocabulary of {len(words)} tokens: llama.cpp loads it with token "
            f"{_UGM_LOAD_UNKNOWN} as the unknown token, so it needs at least "
            f"{_UGM_LOAD_UNKNOWN + 1}"
        )
    byte_tokens = np.flatnonzero(types == _BYTE_TOKEN) if types is not None else ()
    if model == "bert" and len(byte_tokens):  # token_to_byte aborts for WordPiece
        raise reader.fail(
            f"a bert (WordPiece) vocabulary has byte tokens (type 6) in {TOKEN_TYPES}"
        )
    if model in _SPELT_BYTE_MODELS:
        _check_byte_spelling(reader, words, byte_tokens)
    if model == "rwkv":
        _check_rwkv_bytes(reader, words)


def _token_types(metadata: dict[str, Any], n_tokens: int) -> np.ndarray | None:
    """Each token's type as llama.cpp reads them, or None where it reads none (every token is
    normal) or throws (not an int32 array, or shorter than the tokens)."""
    types = metadata.get(TOKEN_TYPES)
    if not isinstance(types, GgufArray) or types.item_kind != INT32:
        return None
    if types.values is None or len(types.values) < n_tokens:
        return None
    return np.fromiter(types.values, dtype=np.int32, count=n_tokens)


def _check_trie_depth(
    reader: Reader, model: Any, words: StringTable, types: np.ndarray | None
) -> None:
    """No token of a trie vocabulary longer than MAX_TRIE_TOKEN_BYTES as the trie holds it
    (cut at a NUL; RWKV's unescaped), looked at only where the stored token is longer."""
    if model not in _TRIE_TOKEN_TYPES:
        return
    in_trie = _TRIE_TOKEN_TYPES[model]
    ends = np.append(words.starts[1:] - np.uint64(8), np.uint64(len(words.region)))
    for i in np.flatnonzero(ends - words.starts > MAX_TRIE_TOKEN_BYTES).tolist():
        if in_trie is not None and types is not None and types[i] not in in_trie:
            continue
        kept = words.kept(i)
        # An RWKV escape is at most 4 bytes for 1: a longer token is longer unescaped too.
        unescape = model == "rwkv" and len(kept) <= 4 * MAX_TRIE_TOKEN_BYTES + 3
        length = len(_rwkv_unescape(kept)) if unescape else len(kept)
        if length > MAX_TRIE_TOKEN_BYTES:
            raise reader.fail(
                f"token {i} of the {model} vocabulary is {length} bytes long (at most "
                f"{MAX_TRIE_TOKEN_BYTES}): llama.cpp's tokenizer goes one nested call deeper "
                "per byte of a token and would overflow the stack"
            )


def _check_byte_spelling(reader: Reader, words: StringTable, byte_tokens: Any) -> None:
    """Every byte token (type 6) spelt <0xXX>, where llama.cpp reads its byte."""
    for i in byte_tokens:
        text = words.kept(int(i))
        if not _BYTE_SPELLING.fullmatch(text):
            raise reader.fail(
                f"token {i} is a byte token (type 6 in {TOKEN_TYPES}) spelt "
                f"{text.decode('utf-8', 'replace')!r}: llama.cpp reads a byte token's value "
                "from its text, which must be <0xXX>"
            )


def _rwkv_unescape(word: bytes) -> bytes:
    """A token as llama.cpp's RWKV tokenizer reads it (llama_unescape_rwkv_token), after it
    is cut at a NUL and an empty one renamed (StringTable.kept)."""
    out, escaping, hex_left, acc = bytearray(), False, 0, 0
    for c in word:
        if hex_left:
            acc = ((acc << 4) + ((c - 87) if c >= 97 else (c - 48))) & 0xFF
            hex_left -= 1
            if not hex_left:
                out.append(acc)
                acc = 0
        elif escaping:
            escaping = False
            if c == 120:  # \xNN
                hex_left = 2
            else:
                out.append({116: 9, 110: 10, 114: 13}.get(c, c))  # \t \n \r, else itself
        elif c == 92:
            escaping = True
        else:
            out.append(c)
    return bytes(out)


def _check_rwkv_bytes(reader: Reader, words: StringTable) -> None:
    """llama.cpp's RWKV tokenizer never advances (it appends tokens until memory runs out)
    when text starts like some token but no token matches at its first byte: every byte that
    begins a token must be a token of its own (real RWKV vocabularies hold all 256)."""
    texts = [_rwkv_unescape(words.kept(i)) for i in range(len(words))]
    missing = {t[0] for t in texts if t} - {t[0] for t in texts if len(t) == 1}
    if missing:
        raise reader.fail(
            f"an rwkv vocabulary has tokens starting with byte {min(missing):#04x} but not that "
            "byte as a token: llama.cpp's tokenizer would loop without end"
        )
