"""Vocab: wraps ``struct llama_vocab`` (owned by its model): tokenization and detokenization."""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeGuard

import numpy as np

from llamacrab._exceptions import InvalidModelError, NativeError, TokenizeError
from llamacrab._field_types import INT32_MAX, utf8
from llamacrab._native.call import call, ffi, lib
from llamacrab._native.handle import NativeHandle
from llamacrab._native.pretokenizer import may_recurse_per_char, run_bounded

_PIECE_BUFFER = 64
_SPM_SPACE = "\u2581".encode()
_UTF8_LENGTHS = (1,) * 12 + (2, 2, 3, 4)  # by a lead byte's high 4 bits


@dataclass
class VocabFacts:
    """What is slow to learn about a vocabulary, learned once per model: its model keeps them
    and hands them to each Vocab it makes."""

    eog: tuple[int, ...] | None = None
    regex_may_recurse: bool | None = None
    # An SPM vocabulary's bytes with a token to fall back on, and its tokens of one symbol.
    spm_fallback: tuple[frozenset[int], frozenset[bytes]] | None = None
    # Each token's piece in bytes, control tokens as text (the longest a token renders).
    piece_bytes: np.ndarray | None = None


class Vocab:
    """The tokenizer of a model. Valid while its model is open; holding it keeps the model."""

    def __init__(self, model: NativeHandle, facts: VocabFacts, pre_tokenizer: str) -> None:
        # The model handle is passed in (not imported): the vocabulary lives and dies with it.
        self._model = model
        self._facts = facts
        # tokenizer.ggml.pre as llama.cpp read it ("" if missing): its kv_override, if any,
        # which llama_model_meta_val_str would not show.
        self._pre_tokenizer = pre_tokenizer
        self._pointer = lib.llama_model_get_vocab(model.pointer)
        self._n_tokens = int(lib.llama_vocab_n_tokens(self._pointer))

    @property
    def pointer(self) -> Any:
        self._model.pointer  # noqa: B018 - raises ClosedHandleError once the model is closed
        return self._pointer

    @contextmanager
    def in_flight(self) -> Iterator[Any]:
        """The pointer, for native calls: closing the model from another thread waits for
        them (the vocabulary is the model's memory)."""
        with self._model.in_flight():
            yield self._pointer

    def _get(self, getter: Any, *args: Any) -> Any:
        with self.in_flight() as vocab:
            return getter(vocab, *args)

    @property
    def regex_may_recurse(self) -> bool:
        """Whether llama.cpp may split text with std::regex, whose stack grows with the text
        (``pretokenizer``): BPE vocabularies without a custom splitter for every regex."""
        if self._facts.regex_may_recurse is None:
            bpe = self._get(lib.llama_vocab_type) == lib.LLAMA_VOCAB_TYPE_BPE
            self._facts.regex_may_recurse = bpe and may_recurse_per_char(self._pre_tokenizer)
        return self._facts.regex_may_recurse

    @property
    def n_tokens(self) -> int:
        return self._n_tokens

    @property
    def kind(self) -> int:
        """llama.cpp's ``llama_vocab_type``: 1 SPM, 2 BPE, 3 WPM, 4 UGM, 5 RWKV, 6 PLaMo 2."""
        return int(self._get(lib.llama_vocab_type))

    def _special(self, getter: Any) -> int | None:
        token = int(self._get(getter))
        return None if token < 0 else token

    @property
    def bos(self) -> int | None:
        return self._special(lib.llama_vocab_bos)

    @property
    def eos(self) -> int | None:
        return self._special(lib.llama_vocab_eos)

    @property
    def eot(self) -> int | None:
        return self._special(lib.llama_vocab_eot)

    @property
    def nl(self) -> int | None:
        """The newline token llama.cpp records: for SentencePiece vocabularies the byte token
        ``<0x0A>``, which is not necessarily what tokenizing ``"\n"`` gives."""
        return self._special(lib.llama_vocab_nl)

    @property
    def eog_tokens(self) -> tuple[int, ...]:
        """Every token that ends generation (scanned once per vocabulary, in C, then cached)."""
        if self._facts.eog is None:
            out = ffi.new("int32_t[]", 64)
            found = self._get(lib.llamacrab_vocab_eog_tokens, out, len(out))
            if found > len(out):
                out = ffi.new("int32_t[]", found)
                self._get(lib.llamacrab_vocab_eog_tokens, out, found)
            self._facts.eog = tuple(out[0:found])
        return self._facts.eog

    @property
    def suppressed_tokens(self) -> tuple[int, ...]:
        """The tokens the model's makers never want sampled (GGUF
        ``tokenizer.ggml.suppress_tokens``, e.g. from a Hugging Face generation config's
        ``suppress_tokens``); llama.cpp drops ids outside the vocabulary."""
        with self.in_flight() as vocab:
            count = ffi.new("int32_t *")
            tokens = lib.llama_vocab_get_suppress_tokens(vocab, count)
            return () if tokens == ffi.NULL else tuple(tokens[0 : count[0]])

    @property
    def fim_prefix(self) -> int | None:
        return self._special(lib.llama_vocab_fim_pre)

    @property
    def fim_suffix(self) -> int | None:
        return self._special(lib.llama_vocab_fim_suf)

    @property
    def fim_middle(self) -> int | None:
        return self._special(lib.llama_vocab_fim_mid)

    @property
    def fim_repo(self) -> int | None:
        return self._special(lib.llama_vocab_fim_rep)

    @property
    def fim_file_sep(self) -> int | None:
        return self._special(lib.llama_vocab_fim_sep)

    @property
    def sep(self) -> int | None:
        return self._special(lib.llama_vocab_sep)

    @property
    def add_bos(self) -> bool:
        return bool(self._get(lib.llama_vocab_get_add_bos))

    @property
    def add_eos(self) -> bool:
        return bool(self._get(lib.llama_vocab_get_add_eos))

    @property
    def add_sep(self) -> bool:
        return bool(self._get(lib.llama_vocab_get_add_sep))

    def check_usable(self) -> None:
        """Refuse a vocabulary llama.cpp loads but aborts on at the first tokenization: none at
        all (tokenizer.ggml.model "none"), or a BOS / EOS / SEP token it adds to every prompt
        but cannot resolve (GGML_ASSERTs in llama_vocab::impl::tokenize)."""
        kind = self._get(lib.llama_vocab_type)
        if kind == lib.LLAMA_VOCAB_TYPE_NONE:
            raise InvalidModelError("it has no vocabulary (tokenizer.ggml.model is 'none')")
        for key, token in self._added_specials(kind).items():
            if token is None:
                raise InvalidModelError(
                    f"its tokenizer adds a token that it lacks to every prompt: "
                    f"tokenizer.ggml.{key} is missing or out of range"
                )

    def _added_specials(self, kind: int) -> dict[str, int | None]:
        """The special tokens tokenizing with ``add_special`` adds (by the GGUF key naming
        them), by vocabulary type."""
        if kind == lib.LLAMA_VOCAB_TYPE_WPM:  # WordPiece always adds both
            return {"bos_token_id": self.bos, "seperator_token_id": self.sep}
        if kind not in (lib.LLAMA_VOCAB_TYPE_SPM, lib.LLAMA_VOCAB_TYPE_BPE,
                        lib.LLAMA_VOCAB_TYPE_UGM):  # fmt: skip
            return {}  # RWKV, PLaMo-2 and the test tokenizer add none
        added = {"bos_token_id": self.bos} if self.add_bos else {}
        return added | ({"eos_token_id": self.eos} if self.add_eos else {})

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends generation (EOS, EOT and the like)."""
        return bool(self._get(lib.llama_vocab_is_eog, token))

    def check_tokens(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """Tokens as an int32 array, each checked against the vocabulary size (not floats,
        bools or strings: numpy would truncate 1.5 to token 1)."""
        try:
            array = np.asarray(tokens)
        except ValueError:  # ragged
            raise TokenizeError("tokens must be a flat sequence of integers") from None
        if array.size == 0:
            array = array.astype(np.int64)  # [] is a float array
        elif array.dtype.kind in "fO" and not isinstance(tokens, np.ndarray):
            array = self._as_int64(tokens, array)
        if array.dtype.kind not in "iu":
            raise TokenizeError(f"token ids must be integers, not {array.dtype} values")
        if array.ndim != 1:
            raise TokenizeError(f"tokens must be a flat sequence, got shape {array.shape}")
        bad = (array < 0) | (array >= self.n_tokens)
        if bad.any():
            raise TokenizeError(
                f"token {int(array[bad][0])} is outside the vocabulary (0..{self.n_tokens - 1})"
            )
        return array.astype(np.int32)

    def _as_int64(self, items: Sequence[object], array: np.ndarray) -> np.ndarray:
        """Items numpy made floats or objects of: int64 where each is an integer (numpy's
        unsigned mixed with Python's, or ids past 64 bits: a JSON body can hold any, and they
        are outside the vocabulary), else ``array`` as it is, for the caller to refuse."""
        ints = [item for item in items if _is_int(item)]
        if len(ints) != len(items):
            return array
        try:
            return np.array([int(item) for item in ints], dtype=np.int64)
        except OverflowError:
            raise TokenizeError(
                f"a token id is outside the vocabulary (0..{self.n_tokens - 1})"
            ) from None

    def tokenize(
        self, text: str | bytes, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        """Tokens of ``text``; ``add_special`` adds BOS/EOS as the model wants them. Bytes go
        to llama.cpp as they are, UTF-8 or not (byte fallback, or U+FFFD, for what is not)."""
        if isinstance(text, bytes | bytearray):
            data = bytes(text)
        else:
            data = utf8(text, "the text to tokenize", TokenizeError)
        try:
            return self._tokenize(text, data, add_special, parse_special)
        except NativeError as error:
            if (unencodable := self._unencodable(data, error)) is None:
                raise
            raise unencodable from error

    def _tokenize(
        self, text: str | bytes, data: bytes, add_special: bool, parse_special: bool
    ) -> list[int]:
        if len(data) > INT32_MAX - 8:  # llama.cpp counts the text's bytes in an int32
            raise TokenizeError(f"text of {len(data)} bytes is too long to tokenize")
        capacity = len(data) + 8
        guarded = self.regex_may_recurse
        for _ in range(2):  # the first call tells the size needed when it is too small
            out = ffi.new("llama_token[]", capacity)
            if guarded:
                fill = partial(self._tokenize_into, data, out, capacity, add_special, parse_special)
                n = run_bounded(text if isinstance(text, str) else data, fill)
            else:
                n = self._tokenize_into(data, out, capacity, add_special, parse_special)
            if n >= 0:
                return self._known(list(ffi.unpack(out, n)))
            if n == -(2**31):
                raise TokenizeError(f"text of {len(data)} bytes is too long to tokenize")
            capacity = -n
        raise TokenizeError(f"llama_tokenize kept asking for more room for {text[:40]!r}")

    @staticmethod
    def _known(tokens: list[int]) -> list[int]:
        """``tokens``, unless one is -1: RWKV and WordPiece vocabularies without an unknown
        token give that for what no token covers, and a decode would refuse it later."""
        if tokens and min(tokens) < 0:
            raise TokenizeError(
                "cannot tokenize the text: no token of this vocabulary covers part of it, and "
                "it has no unknown token to stand for that"
            )
        return tokens

    def _unencodable(self, data: bytes, error: NativeError) -> TokenizeError | None:
        """Why an SPM vocabulary could not tokenize ``data``, if it has no token for a byte of
        it: llama.cpp cuts text into characters (symbols), merges those that make tokens, and
        encodes a symbol no token covers byte by byte, as the byte's <0xXX> token, else its
        one-byte token, and threw std::out_of_range ("unordered_map::at") for a byte with
        neither. Real vocabularies without every byte token exist: only such text fails."""
        if error.code != lib.LLAMACRAB_STD_EXCEPTION or self.kind != lib.LLAMA_VOCAB_TYPE_SPM:
            return None
        fallbacks, symbols = self._spm_fallback()
        # llama.cpp's SPM tokenizer reads a space as "▁" (U+2581), a token where " " is not.
        culprits = [symbol for symbol in _spm_symbols(data.replace(b" ", _SPM_SPACE))
                    if symbol not in symbols and not fallbacks.issuperset(symbol)]  # fmt: skip
        if not culprits:
            return None
        lacking = [b for symbol in culprits for b in symbol if b not in fallbacks]
        of_char = f" of {culprits[0].decode()!r}" if _is_utf8(culprits[0]) else ""
        n = len(set(lacking)) - 1
        others = f"; the text has {n} other byte{'s' if n > 1 else ''} without one" if n else ""
        return TokenizeError(
            f"cannot tokenize the text: the vocabulary has no <0x{lacking[0]:02X}> byte token (nor "
            f"a one-byte one) for byte 0x{lacking[0]:02X}{of_char}, which it falls back on where "
            f"no token covers a character{others}"
        )

    def _spm_fallback(self) -> tuple[frozenset[int], frozenset[bytes]]:
        """The bytes the vocabulary can encode alone (a <0xXX> token, spelt as llama.cpp spells
        it, upper case, or a one-byte token) and its tokens short enough to be one symbol. Read
        token by token once per model (0.13 s for 250k tokens), after a tokenization failed."""
        if self._facts.spm_fallback is None:
            with self.in_flight() as vocab:
                texts = {ffi.string(lib.llama_vocab_get_text(vocab, token))
                         for token in range(self._n_tokens)}  # fmt: skip
            spelt = {f"<0x{b:02X}>".encode(): b for b in range(256)}
            fallbacks = {spelt.get(text, text[0]) for text in texts
                         if text in spelt or len(text) == 1}  # fmt: skip
            symbols = frozenset(text for text in texts if len(text) <= 4)
            self._facts.spm_fallback = frozenset(fallbacks), symbols
        return self._facts.spm_fallback

    def _tokenize_into(
        self, data: bytes, out: Any, capacity: int, add_special: bool, parse_special: bool
    ) -> int:
        with self.in_flight() as vocab:
            return int(call("llama_tokenize", vocab, data, len(data), out, capacity, add_special,
                            parse_special))  # fmt: skip

    def token_to_bytes(self, token: int, special: bool = False) -> bytes:
        """The raw bytes of one token (may be part of a multi-byte character)."""
        if not 0 <= token < self._n_tokens:  # per-token path: no numpy here
            last = self._n_tokens - 1
            raise TokenizeError(f"token {token} is outside the vocabulary (0..{last})")
        size = _PIECE_BUFFER
        while True:
            buf = ffi.new("char[]", size)
            with self.in_flight() as vocab:
                n = call("llama_token_to_piece", vocab, token, buf, size, 0, special)
            if n >= 0:
                return bytes(ffi.buffer(buf, n))
            size = -n

    def token_to_piece(self, token: int, special: bool = False) -> str:
        """The text of one token. Bytes that are not UTF-8 on their own (part of a character
        split across tokens) appear escaped, as ``\\xf0``, so distinct tokens stay distinct."""
        return self.token_to_bytes(token, special).decode("utf-8", "backslashreplace")

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> str:
        """Text of ``tokens``; ``special`` renders control tokens such as BOS as text."""
        array = self.check_tokens(tokens)
        if array.size == 0:
            return ""
        # llama.cpp adds the pieces' lengths up in an int32: past 2 GiB it wraps, and asked
        # for the room again and again (or cut the text short). Its text is never longer than
        # the pieces together (it only strips spaces), so one buffer of that size holds it.
        size = int(self._piece_bytes()[array].sum()) + 1
        if size > INT32_MAX:
            raise TokenizeError(
                f"the text of these {array.size} tokens would take {size - 1} bytes, more "
                f"than llama.cpp's detokenizer counts ({INT32_MAX - 1}): detokenize fewer at "
                "a time"
            )
        c_tokens = ffi.from_buffer("llama_token[]", array)
        buf = ffi.new("char[]", size)
        with self.in_flight() as vocab:
            n = call("llama_detokenize", vocab, c_tokens, array.size, buf, size, False, special)
        if n < 0:
            raise TokenizeError(f"llama_detokenize asked for {-n} bytes, past its tokens' pieces")
        return bytes(ffi.buffer(buf, n)).decode("utf-8", "replace")

    def _piece_bytes(self) -> np.ndarray:
        """Each token's piece in bytes, control tokens rendered (learned once per model)."""
        if self._facts.piece_bytes is None:
            lengths = np.zeros(self._n_tokens, dtype=np.int64)
            room = ffi.new("char[]", 1)
            with self.in_flight() as vocab:
                for token in range(self._n_tokens):  # in no room, each piece tells its length
                    lengths[token] = -call("llama_token_to_piece", vocab, token, room, 0, 0, True)
            self._facts.piece_bytes = lengths
        return self._facts.piece_bytes

    def decoder(self, special: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, special)


class IncrementalDecoder:
    """Turns a token stream into text without ever emitting half of a multi-byte character."""

    def __init__(self, vocab: Vocab, special: bool = False) -> None:
        self._vocab = vocab
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, tokens: Iterable[int]) -> str:
        raw = b"".join(self._vocab.token_to_bytes(t, self._special) for t in tokens)
        return self._utf8.decode(raw)

    def flush(self) -> str:
        """Whatever bytes are left (an incomplete character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


def _spm_symbols(data: bytes) -> Iterator[bytes]:
    """``data`` cut as llama.cpp's SPM tokenizer cuts it before merging: each symbol as long as
    its first byte's high bits say (unicode_len_utf8), UTF-8 or not."""
    start = 0
    while start < len(data):
        end = start + _UTF8_LENGTHS[data[start] >> 4]
        yield data[start:end]
        start = end


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def _is_int(value: object) -> TypeGuard[int | np.integer]:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)
