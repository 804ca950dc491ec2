"""What llama.cpp's PLaMo-2 tokenizer costs to build from a GGUF vocabulary, counted before it
is built: validate_gguf refuses a ``plamo2`` vocabulary past the bounds here.

``llm_tokenizer_plamo2::build`` (src/llama-vocab.cpp) keys a hash map by every suffix of every
token (byte tokens aside); then, in two passes over those suffixes, it rebuilds every prefix of
each one a character at a time and looks it up. A token of c characters (code points as llama.cpp
decodes them) and e bytes (as it re-encodes them) costs c(c+1)/2 lookups and about c²·e/6 bytes
copied a pass (less where tokens share suffixes): cubic in its length, in one native call that
nothing interrupts. A 2,000-byte token took 12 s and 170 MB to load, 5,000 bytes more than 120 s
and 775 MB.
"""

from __future__ import annotations

import numpy as np

# Σ c(c+1)/2 over the tokens: each lookup misses the cache once a real vocabulary's table is
# built (~1 µs each on the 2-core machine measured, where XLM-R's 250k SentencePiece tokens,
# 5.5M lookups, took 9.6 s to load as a PLaMo-2 vocabulary and Gemma 4's 262k, 6.1M, 8.7 s).
# A 100k-token vocabulary of XLM-R's lengths counts ~2.2M.
MAX_LOOKUPS = 1 << 23
# Σ c²·e over the tokens: one ASCII token of 645 bytes (0.39 s to load) or 447 Japanese
# characters (0.41 s) reaches it; real vocabularies count 9.4M (Llama's 32k tokens) to 134M
# (XLM-R's 250k).
MAX_COPIES = 1 << 28
_CHUNK = 1 << 20  # bytes of the vocabulary decoded at once: bounds the arrays below


def table_problem(region: bytes, starts: np.ndarray, in_table: np.ndarray | None) -> str | None:
    """Why llama.cpp's table for these tokens would cost too much to build, or None.
    ``region`` and ``starts``: the tokens as a StringTable holds them; ``in_table``: which
    tokens the table holds (None: all of them)."""
    chars, size, exact = _token_lengths(region, starts)
    if in_table is not None:
        chars, size = np.where(in_table, chars, 0), np.where(in_table, size, 0)
    chars = chars.astype(np.float64)  # sums past int64 when lower bounds are huge
    copies = chars * chars * size
    largest, longest = int(np.argmax(copies)), int(np.argmax(chars))
    at_least = "" if exact else "at least "
    if (total := float(copies.sum())) > MAX_COPIES:
        return (
            f"the plamo2 vocabulary would cost llama.cpp {at_least}{int(total):,} byte "
            f"copies to index when it loads (each token's characters² times its bytes, "
            f"summed; at most {MAX_COPIES:,}), cubic in a token's length: token {largest} alone "
            f"({int(chars[largest]):,} characters) counts {int(copies[largest]):,}"
        )
    if (lookups := float((chars * (chars + 1) / 2).sum())) > MAX_LOOKUPS:
        return (
            f"the plamo2 vocabulary would cost llama.cpp {at_least}{int(lookups):,} table "
            f"lookups to index when it loads (c(c + 1)/2 for a token of c characters, summed; "
            f"at most {MAX_LOOKUPS:,}): {len(starts):,} tokens, the longest token "
            f"{longest} ({int(chars[longest]):,} characters)"
        )
    return None


def _token_lengths(region: bytes, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    """Each token's characters and bytes as llama.cpp's PLaMo-2 tokenizer holds it, and whether
    they are exact: a token longer than _CHUNK bytes up to its first NUL (far past any bound)
    counts a quarter of its bytes (each character is at most 4) as both, at most _CHUNK."""
    begin = starts.astype(np.int64)
    end = np.append(begin[1:] - 8, len(region))  # 8 bytes of length before each string
    chars, size = np.zeros(len(begin), np.int64), np.zeros(len(begin), np.int64)
    exact, lo = True, 0
    while lo < len(begin):
        hi = max(lo + 1, int(np.searchsorted(begin, begin[lo] + _CHUNK)))
        if hi - lo > 1 and end[hi - 1] - begin[lo] > 2 * _CHUNK:
            hi -= 1  # a long last token goes alone
        stop = end[hi - 1]
        if end[lo] - begin[lo] > _CHUNK:  # alone: decoded up to its NUL, if that is short
            nul = region.find(b"\0", begin[lo], end[lo])
            stop = end[lo] if nul < 0 else nul
            if stop - begin[lo] > _CHUNK:
                chars[lo] = size[lo] = min(-(-(stop - begin[lo]) // 4), _CHUNK)
                exact, lo = False, hi
                continue
        window = np.frombuffer(region, np.uint8, int(stop - begin[lo]), int(begin[lo]))
        ends = np.minimum(end[lo:hi], stop) - begin[lo]
        chars[lo:hi], size[lo:hi] = _decoded(window, begin[lo:hi] - begin[lo], ends)
        lo = hi
    empty = np.flatnonzero(size == 0)  # llama.cpp names an empty token [EMPTY_<index>]
    chars[empty] = size[empty] = len("[EMPTY_]") + _digits(empty)
    return chars, size, exact


def _decoded(window: np.ndarray, begin: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, ...]:
    """Characters and bytes of the tokens at [begin, end) of ``window``, each cut at its first
    NUL, as unicode_cpts_from_utf8 decodes and unicode_cpt_to_utf8 re-encodes them: a lead byte
    followed by as many continuation bytes as its high bits say is one character, of as many
    bytes; any other byte from 0x80 is one U+FFFD, of 3."""
    inside = _spans(len(window), begin, end)
    nul = np.flatnonzero(inside & (window == 0))
    kept_end = end
    if len(nul):  # each token's first NUL at or after its start, if before its end
        first = nul[np.minimum(np.searchsorted(nul, begin), len(nul) - 1)]
        kept_end = np.minimum(end, np.where(first >= begin, first, end))
        inside = _spans(len(window), begin, kept_end)
    follows = inside & ((window & 0xC0) == 0x80)
    next1, next2, next3 = _ahead(follows, 1), _ahead(follows, 2), _ahead(follows, 3)
    two = inside & ((window & 0xE0) == 0xC0) & next1
    three = inside & ((window & 0xF0) == 0xE0) & next1 & next2
    four = inside & ((window & 0xF8) == 0xF0) & next1 & next2 & next3
    in_character = two | three | four | _behind(two | three | four, 1)
    in_character |= _behind(three | four, 2) | _behind(four, 3)
    stray = inside & (window >= 0x80) & ~in_character
    absorbed = two.astype(np.int8) + 2 * three.astype(np.int8) + 3 * four.astype(np.int8)
    kept = kept_end - begin
    return kept - _sums(absorbed, begin), kept + 2 * _sums(stray, begin)


def _spans(length: int, begin: np.ndarray, end: np.ndarray) -> np.ndarray:
    """A mask of ``length`` bytes, true inside every [begin, end) (disjoint, begin sorted)."""
    marks = np.zeros(length + 1, np.int8)
    marks[begin] += 1
    marks[end] -= 1
    return np.cumsum(marks[:-1], dtype=np.int8).astype(bool)


def _ahead(mask: np.ndarray, by: int) -> np.ndarray:
    """Whether the byte ``by`` places later is set in ``mask``."""
    out = np.zeros_like(mask)
    out[:-by] = mask[by:]
    return out


def _behind(mask: np.ndarray, by: int) -> np.ndarray:
    """Whether the byte ``by`` places earlier is set in ``mask``."""
    out = np.zeros_like(mask)
    out[by:] = mask[:-by]
    return out


def _sums(values: np.ndarray, begin: np.ndarray) -> np.ndarray:
    """Sums of ``values`` from each of ``begin`` to the next (zero outside the tokens)."""
    return np.add.reduceat(np.append(values, 0), begin, dtype=np.int64)


def _digits(numbers: np.ndarray) -> np.ndarray:
    """How many decimal digits each of ``numbers`` (< 10**9) is written with."""
    return 1 + np.searchsorted(10 ** np.arange(1, 10), numbers, side="right")
