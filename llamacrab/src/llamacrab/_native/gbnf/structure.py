"""GBNF grammars as llama.cpp's parser structures them, and facts about their rules.

What the grammar checks (``fanout``) need to know before llama.cpp runs a grammar:
its rules of alternatives of items, which rules can match nothing, which characters can start
each, and how long what they match can be. Parsed and computed without recursion but for
groups (which ``bounds`` limits to 128 deep first): rule chains may be thousands deep.
Syntax errors are left to llama.cpp: text this parser does not follow raises ``Unparsed``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

# Characters by bucket: ASCII by code point, everything else in one (conservatively: two
# non-ASCII characters count as possibly the same).
OTHER = 128
ANY = frozenset(range(OTHER + 1))
# Lengths are counted up to this; longer counts the same (see fanout.LONGEST_TOKEN).
LENGTH_CAP = 64

# A rule's name, as llama.cpp reads one.
RULE_NAME = re.compile(r"[A-Za-z0-9-]+")
_INT = re.compile(r"[0-9]+")
_ESCAPES = {"n": 10, "r": 13, "t": 9}
_Value = TypeVar("_Value")


@dataclass
class Item:
    """A terminal (``rule`` None: a literal of ``length`` characters, a class, ``.`` or a
    token) or a reference to a rule (named, or a group's), repeated ``low`` to ``high`` times
    (None: unbounded)."""

    rule: int | None
    low: int = 1
    high: int | None = 1
    first: frozenset[int] = ANY  # a terminal's first character's buckets
    length: int = 1  # a terminal's characters


@dataclass
class Rule:
    alternatives: list[list[Item]] = field(default_factory=list)


class Unparsed(Exception):
    """Text this parser does not follow: llama.cpp judges it."""


@dataclass
class Facts:
    """Per rule: whether it can match nothing, the buckets of the characters its matches can
    start with, and the shortest non-empty and the longest match (capped at LENGTH_CAP)."""

    nullable: list[bool]
    first: list[frozenset[int]]
    shortest: list[int]
    longest: list[int]


def facts(rules: list[Rule]) -> Facts:
    nullable = nullable_rules(rules)
    users = _users(rules)
    nothing: frozenset[int] = frozenset()
    first = _fixpoint(rules, users, [nothing] * len(rules),
                      lambda r, v: _rule_first(rules[r], nullable, v))  # fmt: skip
    shortest_any = _fixpoint(rules, users, [LENGTH_CAP] * len(rules),
                             lambda r, v: _rule_shortest(rules[r], v))  # fmt: skip
    shortest = _fixpoint(
        rules, users, [LENGTH_CAP] * len(rules),
        lambda r, v: _rule_shortest_nonempty(rules[r], shortest_any, v),
    )  # fmt: skip
    longest = _fixpoint(rules, users, [0] * len(rules),
                        lambda r, v: _rule_longest(rules[r], v))  # fmt: skip
    return Facts(nullable, first, shortest, longest)


def item_nullable(item: Item, nullable: list[bool]) -> bool:
    return item.low == 0 or (item.rule is not None and nullable[item.rule])


def item_first(item: Item, f: Facts) -> frozenset[int]:
    return item.first if item.rule is None else f.first[item.rule]


def item_lengths(item: Item, f: Facts) -> tuple[int, int]:
    """The shortest non-empty and the longest match of ``item``, repetitions included."""
    if item.rule is None:
        once_short = once_long = item.length
    else:
        once_short, once_long = f.shortest[item.rule], f.longest[item.rule]
    high = LENGTH_CAP if item.high is None else item.high
    return once_short, min(LENGTH_CAP, once_long * high)


def nullable_rules(rules: list[Rule]) -> list[bool]:
    """Which rules can match nothing: a worklist over the rules that refer to each."""
    users = _users(rules)
    nullable = [False] * len(rules)
    pending = list(range(len(rules)))
    while pending:
        index = pending.pop()
        if nullable[index]:
            continue
        if any(all(item_nullable(i, nullable) for i in s) for s in rules[index].alternatives):
            nullable[index] = True
            pending.extend(users[index])
    return nullable


def _users(rules: list[Rule]) -> list[list[int]]:
    users: list[list[int]] = [[] for _ in rules]
    for index, rule in enumerate(rules):
        for sequence in rule.alternatives:
            for item in sequence:
                if item.rule is not None:
                    users[item.rule].append(index)
    return users


def _fixpoint(
    rules: list[Rule],
    users: list[list[int]],
    start: list[_Value],
    evaluate: Callable[[int, list[_Value]], _Value],
) -> list[_Value]:
    """Values per rule from ``start``, each re-evaluated when one it uses changes, until none
    does: every evaluation here only moves a value one way within a bounded range."""
    values = list(start)
    pending = list(range(len(rules)))
    queued = [True] * len(rules)
    while pending:
        index = pending.pop()
        queued[index] = False
        value = evaluate(index, values)
        if value != values[index]:
            values[index] = value
            for user in users[index]:
                if not queued[user]:
                    queued[user] = True
                    pending.append(user)
    return values


def _rule_first(rule: Rule, nullable: list[bool], first: list[frozenset[int]]) -> frozenset[int]:
    found: set[int] = set()
    for sequence in rule.alternatives:
        for item in sequence:
            found |= item.first if item.rule is None else first[item.rule]
            if not item_nullable(item, nullable):
                break
    return frozenset(found)


def _item_shortest(item: Item, shortest_any: list[int]) -> int:
    once = item.length if item.rule is None else shortest_any[item.rule]
    return min(LENGTH_CAP, once * item.low)


def _rule_shortest(rule: Rule, shortest_any: list[int]) -> int:
    return min(
        (
            min(LENGTH_CAP, sum(_item_shortest(i, shortest_any) for i in s))
            for s in rule.alternatives
        ),
        default=LENGTH_CAP,
    )


def _rule_shortest_nonempty(rule: Rule, shortest_any: list[int], shortest: list[int]) -> int:
    """An alternative's shortest match if not empty; else one item matching something."""
    best = LENGTH_CAP
    for sequence in rule.alternatives:
        total = min(LENGTH_CAP, sum(_item_shortest(i, shortest_any) for i in sequence))
        if total > 0:
            best = min(best, total)
            continue
        for item in sequence:
            once = item.length if item.rule is None else shortest[item.rule]
            best = min(best, max(1, once))
    return best


def _rule_longest(rule: Rule, longest: list[int]) -> int:
    best = 0
    for sequence in rule.alternatives:
        total = 0
        for item in sequence:
            once = item.length if item.rule is None else longest[item.rule]
            total += once * (LENGTH_CAP if item.high is None else item.high)
        best = max(best, min(LENGTH_CAP, total))
    return best


def skip_quoted(text: str, start: int, closing: str) -> int:
    """The index of the closing quote or bracket (or the end): escapes skip a character."""
    i = start + 1
    while i < len(text) and text[i] != closing:
        i += 2 if text[i] == "\\" else 1
    return i


def _decoded(body: str) -> list[int]:
    """A literal's code points (llama.cpp's escapes: \\x.., \\u...., \\U........, n, r, t)."""
    points: list[int] = []
    i = 0
    while i < len(body):
        if body[i] != "\\" or i + 1 >= len(body):
            points.append(ord(body[i]))
            i += 1
            continue
        kind = body[i + 1]
        width = {"x": 2, "u": 4, "U": 8}.get(kind, 0)
        if width:
            digits = body[i + 2 : i + 2 + width]
            try:
                points.append(int(digits, 16))
            except ValueError:
                raise Unparsed from None
            i += 2 + width
        else:
            points.append(_ESCAPES.get(kind, ord(kind)))
            i += 2
    return points


def _buckets(points: list[int]) -> frozenset[int]:
    return frozenset(min(point, OTHER) for point in points)


def _class_buckets(body: str) -> frozenset[int]:
    """The buckets a character class can match; a negated class, conservatively, any."""
    if body.startswith("^"):
        return ANY
    points = _decoded(body)
    found: set[int] = set()
    i = 0
    while i < len(points):
        low = points[i]
        if i + 2 < len(points) and points[i + 1] == ord("-"):
            high = points[i + 2]
            i += 3
        else:
            high = low
            i += 1
        if low < OTHER:
            found.update(range(low, min(high, OTHER - 1) + 1))
        if high >= OTHER:
            found.add(OTHER)
    return frozenset(found)


class Parser:
    """GBNF as llama.cpp's parser reads it, as far as structure goes: rules of alternatives
    of items (literals, classes, tokens and ``.`` are terminals; groups become rules)."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0
        self.rules: list[Rule] = []
        self.names: dict[str, int] = {}

    def parse(self) -> list[Rule]:
        self._space()
        while self.pos < len(self.text):
            name = self._name()
            self._space()
            if not self.text.startswith("::=", self.pos):
                raise Unparsed
            self.pos += 3
            self._space()
            self._alternates(self._named(name), nested=False)
            self._space()
        if any(not rule.alternatives for rule in self.rules):  # referred to, never defined
            raise Unparsed
        return self.rules

    def _named(self, name: str) -> int:
        if name not in self.names:
            self.names[name] = len(self.rules)
            self.rules.append(Rule())
        return self.names[name]

    def _alternates(self, index: int, nested: bool) -> None:
        """Alternatives up to the end of the rule (a newline outside groups) or a ``)``. Groups
        nest at most MAX_GRAMMAR_NESTING deep (checked before), so this recursion is bounded."""
        target = self.rules[index]
        sequence: list[Item] = []
        target.alternatives.append(sequence)
        while True:
            self._space(newlines=nested)
            if self.pos >= len(self.text):
                return
            char = self.text[self.pos]
            if char == "\n" or char == "\r":
                return
            if char == ")":
                if not nested:
                    raise Unparsed
                return
            if char == "|":
                self.pos += 1
                self._space()  # a newline may follow, as llama.cpp reads it
                sequence = []
                target.alternatives.append(sequence)
            elif char in "*+?{":
                self._repetition(sequence)
            elif char == "(":
                self.pos += 1
                group = len(self.rules)
                self.rules.append(Rule())
                self._alternates(group, nested=True)
                if not self.text.startswith(")", self.pos):
                    raise Unparsed
                self.pos += 1
                sequence.append(Item(group))
            elif char in '"[':
                start = self.pos
                self._skip_until('"' if char == '"' else "]")
                body = self.text[start + 1 : self.pos - 1]
                # "", [] and [^] add nothing to the rule in llama.cpp: they match nothing.
                if char == '"' and body:
                    chars = _decoded(body)
                    sequence.append(Item(None, first=_buckets(chars[:1]), length=len(chars)))
                elif char == "[" and body not in ("", "^"):
                    sequence.append(Item(None, first=_class_buckets(body)))
            elif char == ".":
                self.pos += 1
                sequence.append(Item(None))
            elif char in "<!":
                end = self.text.find(">", self.pos)
                if end < 0:
                    raise Unparsed
                self.pos = end + 1
                sequence.append(Item(None))
            else:
                sequence.append(Item(self._named(self._name())))

    def _repetition(self, sequence: list[Item]) -> None:
        if not sequence:
            raise Unparsed
        char = self.text[self.pos]
        self.pos += 1
        high: int | None
        if char == "{":
            self._space(newlines=True)
            low = high = self._int()
            self._space(newlines=True)
            if self.text.startswith(",", self.pos):
                self.pos += 1
                self._space(newlines=True)
                high = self._int() if self._at_digit() else None
                self._space(newlines=True)
            if not self.text.startswith("}", self.pos):
                raise Unparsed
            self.pos += 1
        else:
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
        last = sequence[-1]
        if (last.low, last.high) != (1, 1):
            # llama.cpp repeats what the last repetition produced: a group's worth.
            nested = Rule([[last]])
            self.rules.append(nested)
            last = sequence[-1] = Item(len(self.rules) - 1)
        last.low, last.high = low, high

    def _at_digit(self) -> bool:
        return (
            self.pos < len(self.text)
            and self.text[self.pos].isascii()
            and (self.text[self.pos].isdigit())
        )

    def _int(self) -> int:
        match = _INT.match(self.text, self.pos)
        if match is None:
            raise Unparsed
        self.pos = match.end()
        return int(match.group())

    def _name(self) -> str:
        match = RULE_NAME.match(self.text, self.pos)
        if match is None:
            raise Unparsed
        self.pos = match.end()
        return match.group()

    def _skip_until(self, closing: str) -> None:
        i = skip_quoted(self.text, self.pos, closing)
        if i >= len(self.text):
            raise Unparsed
        self.pos = i + 1

    def _space(self, newlines: bool = True) -> None:
        """Past spaces and comments; newlines only where they do not end a rule."""
        text = self.text
        while self.pos < len(text):
            char = text[self.pos]
            if char == "#":
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end
            elif char in " \t" or (newlines and char in "\r\n"):
                self.pos += 1
            else:
                return
