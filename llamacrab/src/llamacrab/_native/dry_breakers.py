"""DRY sequence breakers as llama.cpp processes them, found through an index of the vocabulary.

For each breaker, llama_sampler_init_dry (get_overlapping_token_sequences) keeps every token
whose text contains it, as a breaker on its own, and every token whose text ends with its first
L bytes (each 1 <= L < its length), followed by the tokens of the rest (at most 20). It finds
them by detokenizing the whole vocabulary once per breaker and tokenizing the rest once per
token that matches, in one native call: up to 0.4 s per breaker on Gemma 3's 262k tokens, 4-5 s
for 16 of 40 bytes. Here each model's token texts are read once; the tokens that contain a
breaker are found with numpy over the texts joined, those that end with a prefix by binary
search over the tokens ordered by their last bytes reversed, and each rest is tokenized once.
The result is the same (head, tail) pairs, in the order llama.cpp inserts them."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from llamacrab._native.call import call_helper, ffi
from llamacrab._native.fork import reset_in_child
from llamacrab._native.model import Model
from llamacrab._native.vocab import Vocab

# The tokens of a rest llama.cpp keeps (MAX_SEQ_LEN in llama_sampler_init_dry).
MAX_TAIL_TOKENS = 20
# The bytes of a breaker llama.cpp keeps (MAX_CHAR_LEN), cut wherever they end.
MAX_BREAKER_BYTES = 40
# The last bytes of each token that its sort key holds (a uint64): a longer prefix is checked
# against the few tokens whose key matches.
_KEY_BYTES = 8


@dataclass(frozen=True)
class ProcessedBreakers:
    """Breaker i is the token ``heads[i]`` followed by the next ``tail_lengths[i]`` tokens of
    ``tails`` (int32 arrays): llamacrab_dry_from_tokens's arguments."""

    heads: np.ndarray
    tail_lengths: np.ndarray
    tails: np.ndarray


class TokenTexts:
    """Each token's text as get_overlapping_token_sequences reads it: llama_detokenize of the
    token alone, special tokens rendered. 7 MB for Gemma 3's 262k tokens, 2 MB of it the texts;
    built in 0.1 s."""

    def __init__(self, vocab: Vocab) -> None:
        self._joined, self._ends = _read_texts(vocab)
        self._bytes = np.frombuffer(self._joined, dtype=np.uint8)
        keys = self._last_bytes_reversed()
        self._order = np.argsort(keys, kind="stable").astype(np.int32)
        self._sorted_keys = keys[self._order]

    def _last_bytes_reversed(self) -> np.ndarray:
        """Each text's last _KEY_BYTES bytes, last first, as a big-endian uint64 (zeros past
        its start): sorted, the texts that end with the same bytes are neighbours."""
        lengths = np.diff(self._ends, prepend=0)
        keys = np.zeros(len(self._ends), dtype=np.uint64)
        for back in range(_KEY_BYTES):
            long_enough = lengths > back
            byte = np.zeros(len(keys), dtype=np.uint64)
            byte[long_enough] = self._bytes[self._ends[long_enough] - 1 - back]
            keys |= byte << np.uint64(8 * (_KEY_BYTES - 1 - back))
        return keys

    def _text(self, token: int) -> bytes:
        return self._joined[self._ends[token - 1] if token else 0 : self._ends[token]]

    def containing(self, needle: bytes) -> np.ndarray:
        """The tokens (ascending) whose text contains ``needle``."""
        data = self._bytes
        if len(needle) > len(data):
            return np.zeros(0, dtype=np.int32)
        at = np.flatnonzero(data[: len(data) - len(needle) + 1] == needle[0])
        for offset in range(1, len(needle)):
            at = at[data[at + offset] == needle[offset]]
        tokens = np.searchsorted(self._ends, at, side="right")  # the text each match starts in
        return np.unique(tokens[at + len(needle) <= self._ends[tokens]]).astype(np.int32)

    def ending_with(self, prefix: bytes) -> np.ndarray:
        """The tokens whose text ends with ``prefix`` (no NUL in it: the key's zeros past a
        text's start would match one)."""
        head = prefix[::-1][:_KEY_BYTES]
        low = int.from_bytes(head.ljust(_KEY_BYTES, b"\0"), "big")
        high = low | ((1 << 8 * (_KEY_BYTES - len(head))) - 1)
        first = np.searchsorted(self._sorted_keys, np.uint64(low), side="left")
        last = np.searchsorted(self._sorted_keys, np.uint64(high), side="right")
        tokens = self._order[first:last]
        if len(prefix) > _KEY_BYTES:
            tokens = tokens[[self._text(t).endswith(prefix) for t in tokens.tolist()]]
        return tokens


def _read_texts(vocab: Vocab) -> tuple[bytes, np.ndarray]:
    """(every token's text joined, where each ends) in one native call."""
    ends = np.zeros(vocab.n_tokens, dtype=np.int64)
    capacity = 16 * len(ends)
    while True:
        out = ffi.new("char[]", max(capacity, 1))
        with vocab.in_flight() as pointer:
            size = call_helper("llamacrab_vocab_token_texts", pointer, out, capacity,
                               ffi.from_buffer("int64_t[]", ends))  # fmt: skip
        if size <= capacity:
            return ffi.buffer(out, size)[:], ends
        capacity = size


def processed_breakers(
    texts: TokenTexts, vocab: Vocab, breakers: Sequence[bytes]
) -> ProcessedBreakers:
    """What llama_sampler_init_dry keeps of ``breakers`` (UTF-8 without NUL), in its order:
    breaker by breaker, token by token, and for one token its longest overlap first; but each
    (head, tail) pair once. llama.cpp adds a token that contains a breaker again for each
    breaker it contains, and all of a breaker's pairs again for each copy of it, where
    llama_sampler_dry_apply reads the pairs as a set: a head's longest tail that matches, and
    whether any of its tails is empty. 16 breakers of " " made 2.2M pairs on Gemma 3, 137k
    without the copies."""
    tails: dict[tuple[int, ...], int] = {(): 0}  # each distinct tail: its index
    parts: list[tuple[int, np.ndarray, int, int]] = []  # breaker, tokens, rank in a token, tail
    # As llama.cpp reads them (its first MAX_BREAKER_BYTES bytes), each once, empty ones skipped.
    distinct = dict.fromkeys(b[:MAX_BREAKER_BYTES] for b in breakers if b)
    for index, breaker in enumerate(distinct):
        inside = texts.containing(breaker)
        parts.append((index, inside, 0, 0))
        for overlap in range(len(breaker) - 1, 0, -1):
            tokens = np.setdiff1d(texts.ending_with(breaker[:overlap]), inside)
            if tokens.size:
                rest = vocab.tokenize(breaker[overlap:], add_special=False, parse_special=False)
                tail = tails.setdefault(tuple(rest[:MAX_TAIL_TOKENS]), len(tails))
                parts.append((index, tokens, len(breaker) - overlap, tail))
    if not parts:
        return ProcessedBreakers(*(np.zeros(0, dtype=np.int32) for _ in range(3)))

    def column(field: int) -> np.ndarray:
        return np.concatenate([np.full(len(p[1]), p[field], dtype=np.int64) for p in parts])

    tokens = np.concatenate([p[1] for p in parts]).astype(np.int64)
    breaker_of, rank, tail_of = column(0), column(2), column(3)
    order = np.lexsort((rank, tokens, breaker_of))
    tokens, tail_of = tokens[order], tail_of[order]
    # Keep a (token, tail) pair the first time it comes.
    _, first = np.unique(tokens * len(tails) + tail_of, return_index=True)
    keep = np.sort(first)
    return _flattened(tokens[keep], tail_of[keep], list(tails))


def _flattened(
    heads: np.ndarray, tail_of: np.ndarray, tails: list[tuple[int, ...]]
) -> ProcessedBreakers:
    """The tail of each head (``tails[tail_of[i]]``) one after another."""
    tail_sizes = np.array([len(t) for t in tails], dtype=np.int64)
    tail_starts = np.cumsum(tail_sizes) - tail_sizes
    all_tails = np.array([token for t in tails for token in t], dtype=np.int32)
    lengths = tail_sizes[tail_of]
    starts = np.cumsum(lengths) - lengths
    picks = np.repeat(tail_starts[tail_of] - starts, lengths) + np.arange(int(lengths.sum()))
    return ProcessedBreakers(
        heads.astype(np.int32), lengths.astype(np.int32), all_tails[picks].astype(np.int32)
    )


class _Slot:
    """One model's index, built once by the first thread that needs it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.texts: TokenTexts | None = None


_lock = threading.Lock()
reset_in_child(_lock)  # a thread holding it at fork() is not in the child
# By model, weakly: freed with it, and never keeping it alive.
_slots: weakref.WeakKeyDictionary[Model, _Slot] = weakref.WeakKeyDictionary()


def token_texts(model: Model) -> TokenTexts:
    with _lock:
        slot = _slots.setdefault(model, _Slot())
    with slot.lock:
        if slot.texts is None:
            slot.texts = TokenTexts(model.vocab)
        return slot.texts
