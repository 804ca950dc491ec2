"""Repetitions of any count written so that llama.cpp enforces them exactly.

llama.cpp's parser takes ``x{m,n}`` only up to MAX_REPETITION: a larger minimum fails the parse,
a larger maximum means no maximum at all (maxLength 5000 let a string run on). Past it a count
is written in base CHUNK over rules shared by every repetition of ``x``: ``x-1000 ::=
x{1000}``, ``x-1000000 ::= x-1000{1000}``. A minimum is its digits, ``x-1000{3} x{250}``; a
maximum n = d * C + rest (C the largest chunk not past n) is

    x-upto-n ::= x-C{0,d-1} below(C) | x-C{d} upto(rest)

whose alternatives take lengths that never overlap (fewer than d * C, or d * C and more), as
``below(C)`` (fewer than C) has one reading of its own: a text has one reading, so llama.cpp
keeps a few parse stacks per chunk level, not one per way to split the text.
"""

from __future__ import annotations

from collections.abc import Callable

from llamacrab._exceptions import GrammarError
from llamacrab._native.gbnf.bounds import MAX_REPETITION
from llamacrab._native.gbnf.structure import RULE_NAME

# The converter's rule maker: the rule named after a hint whose body is the given one (an
# existing rule of the same base name and body is reused, so repetitions of one shape share).
AddRule = Callable[[str, str], str]
CHUNK = 1000


def repeat(add: AddRule, body: str, low: int, high: int | None, name: str) -> str:
    """A GBNF expression matching ``body`` (GBNF items in sequence) ``low`` to ``high`` (None:
    no maximum) times; ``body`` becomes the rule ``name`` where the counts need chunks."""
    if high is not None and high < low:  # check_grammar refuses {m,n} so; chunks would hide it
        raise GrammarError(
            f"a repetition of {low} to {high} times: the maximum is below the minimum"
        )
    item = body if RULE_NAME.fullmatch(body) else f"( {body} )"
    if fits(low, high):
        if (low, high) == (0, None):
            return f"{item}*"
        return f"{item}{{{low},{'' if high is None else high}}}"
    unit = body if RULE_NAME.fullmatch(body) else add(name, body)
    rest = f"{unit}*" if high is None else _at_most(add, unit, high - low)
    return " ".join(filter(None, (_exactly(add, unit, low), rest)))


def fits(low: int, high: int | None) -> bool:
    """Whether llama.cpp's parser takes the counts ``{low,high}`` as they are."""
    return low <= MAX_REPETITION and (high is None or high <= MAX_REPETITION)


def _chunk(add: AddRule, unit: str, level: int) -> str:
    """The rule matching ``unit`` CHUNK ** level times."""
    inner = unit if level == 1 else _chunk(add, unit, level - 1)
    return add(f"{unit}-{CHUNK**level}", f"{inner}{{{CHUNK}}}")


def _levels(add: AddRule, unit: str, n: int) -> list[tuple[int, str]]:
    """(size, item) of ``unit`` and its chunks up to the largest not past ``n``, largest first."""
    levels = [(1, unit)]
    while levels[-1][0] * CHUNK <= n:
        levels.append((levels[-1][0] * CHUNK, _chunk(add, unit, len(levels))))
    return levels[::-1]


def _exactly(add: AddRule, unit: str, n: int) -> str:
    if n <= MAX_REPETITION:
        return f"{unit}{{{n}}}" if n else ""
    parts = []
    for size, item in _levels(add, unit, n):
        count, n = divmod(n, size)
        parts.append(_times(item, count))
    return " ".join(filter(None, parts))


def _below(add: AddRule, unit: str, level: int) -> str:
    """Fewer than CHUNK ** level of ``unit``: so many chunks of the level under it, then fewer
    than one of those (one reading each)."""
    if level == 1:
        return f"{unit}{{0,{CHUNK - 1}}}"
    chunks = f"{_chunk(add, unit, level - 1)}{{0,{CHUNK - 1}}}"
    return add(f"{unit}-below-{CHUNK**level}", f"{chunks} {_below(add, unit, level - 1)}")


def _at_most(add: AddRule, unit: str, n: int) -> str:
    if n <= MAX_REPETITION:
        return f"{unit}{{0,{n}}}" if n else ""
    levels = _levels(add, unit, n)
    (size, chunk), level = levels[0], len(levels) - 1
    count, rest = divmod(n, size)
    below = _below(add, unit, level)
    fewer = f"{chunk}{{0,{count - 1}}} {below}" if count > 1 else below
    full = " ".join(filter(None, (_times(chunk, count), _at_most(add, unit, rest))))
    return add(f"{unit}-upto-{n}", f"{fewer} | {full}")


def _times(item: str, count: int) -> str:
    return "" if count == 0 else item if count == 1 else f"{item}{{{count}}}"
