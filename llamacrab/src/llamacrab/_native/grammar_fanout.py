"""How many parse stacks a GBNF grammar can keep open at once, before llama.cpp runs it.

llama.cpp's grammar sampler keeps one stack per way the text so far can continue. Where a
sequence holds optional items in a row (``x?``, ``x*``, an item with an empty alternative, a
repetition of such an item), every one of them may be skipped, so a position opens a stack for
every item it can reach; where those items accept the same characters, each character of a
candidate token multiplies the ways again. The reliability suite's ``root ::= (r0){1000}``
with such an ``r0`` held the engine for minutes on a 4k vocabulary. This module parses the
grammar (without recursion: rule chains may be thousands deep), finds which rules can match
nothing, and counts the stacks one position can open: the items reachable from it through
skippable ones, each counted by the stacks its own start opens. Past MAX_GRAMMAR_FANOUT the
grammar is refused. Below it, ambiguous runs still cost: on Gemma 3's 262k vocabulary (long
tokens) ``root ::= ([a-z]?){24}`` took 22 s for 2 tokens (``[a-z]{0,24}``, the same language,
0.2 s); refusing those would need the character sets that overlap, not done yet.
Syntax errors are left to llama.cpp; a grammar this parser cannot follow is not refused here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from llamacrab._exceptions import GrammarError

# Stacks one position may open. Our JSON Schemas open ~11, plus ~2 per optional property (an
# object of 90 optional properties: 178; 100 of them exceed MAX_GRAMMAR_RULES first).
MAX_GRAMMAR_FANOUT = 256

_NAME = re.compile(r"[A-Za-z0-9-]+")
_INT = re.compile(r"[0-9]+")


@dataclass
class _Item:
    rule: int | None  # a rule (named, or a group's), or None: a terminal
    low: int = 1  # repetitions: at least, at most (None: unbounded)
    high: int | None = 1


@dataclass
class _Rule:
    alternatives: list[list[_Item]] = field(default_factory=list)


class _Unparsed(Exception):
    """Text this parser does not follow: llama.cpp judges it."""


def check_grammar_fanout(text: str) -> None:
    """Raise GrammarError if one position of ``text``'s grammar can open more than
    MAX_GRAMMAR_FANOUT parse stacks."""
    try:
        rules = _Parser(text).parse()
    except _Unparsed:
        return
    nullable = _nullable(rules)
    reach = _entry_reach(rules, nullable)
    if reach is None:  # left recursion: llama.cpp refuses it
        return
    worst = 0
    for rule in rules:
        for sequence in rule.alternatives:
            worst = max(worst, _sequence_fanout(sequence, nullable, reach))
    if worst > MAX_GRAMMAR_FANOUT:
        raise GrammarError(
            f"the grammar can hold {worst} ways to continue at one position (optional items "
            f"in a row, or a repetition of an optional item); the limit is {MAX_GRAMMAR_FANOUT}"
        )


def _item_reach(item: _Item, nullable: list[bool], reach: list[int]) -> int:
    """Stacks opened by entering ``item``: every copy of a skippable item is reachable."""
    own = 1 if item.rule is None else reach[item.rule]
    if item.rule is not None and nullable[item.rule]:
        copies = item.high if item.high is not None else item.low + 1
        return own * max(copies, 1)
    return own


def _item_nullable(item: _Item, nullable: list[bool]) -> bool:
    return item.low == 0 or (item.rule is not None and nullable[item.rule])


def _sequence_fanout(sequence: list[_Item], nullable: list[bool], reach: list[int]) -> int:
    """The most stacks any position of ``sequence`` opens: the items from it up to and
    including the first that cannot be skipped. The most is at the start of a run of
    skippable items, so one pass summing each run suffices."""
    worst = total = 0
    for item in sequence:
        total += _item_reach(item, nullable, reach)
        worst = max(worst, total)
        if not _item_nullable(item, nullable):
            total = 0
    return worst


def _nullable(rules: list[_Rule]) -> list[bool]:
    """Which rules can match nothing: a worklist over the rules that refer to each."""
    users: list[list[int]] = [[] for _ in rules]
    for index, rule in enumerate(rules):
        for sequence in rule.alternatives:
            for item in sequence:
                if item.rule is not None:
                    users[item.rule].append(index)
    nullable = [False] * len(rules)
    pending = list(range(len(rules)))
    while pending:
        index = pending.pop()
        if nullable[index]:
            continue
        if any(all(_item_nullable(i, nullable) for i in s) for s in rules[index].alternatives):
            nullable[index] = True
            pending.extend(users[index])
    return nullable


def _entry_reach(rules: list[_Rule], nullable: list[bool]) -> list[int] | None:
    """Stacks opened by entering each rule, rules reached first computed first (iteratively,
    in an order where a rule comes after those its start reaches); None on a cycle."""
    starts: list[set[int]] = []
    for rule in rules:
        reached: set[int] = set()
        for sequence in rule.alternatives:
            for item in sequence:
                if item.rule is not None:
                    reached.add(item.rule)
                if not _item_nullable(item, nullable):
                    break
        starts.append(reached)
    waiting_on = [len(s) for s in starts]
    users: list[list[int]] = [[] for _ in rules]
    for index, reached in enumerate(starts):
        for other in reached:
            users[other].append(index)
    ready = [i for i, n in enumerate(waiting_on) if n == 0]
    reach = [0] * len(rules)
    done = 0
    while ready:
        index = ready.pop()
        done += 1
        total = 0
        for sequence in rules[index].alternatives:
            for item in sequence:
                total += _item_reach(item, nullable, reach)
                if not _item_nullable(item, nullable):
                    break
        reach[index] = min(total, MAX_GRAMMAR_FANOUT + 1)  # past the limit, the size is moot
        for user in users[index]:
            waiting_on[user] -= 1
            if waiting_on[user] == 0:
                ready.append(user)
    return reach if done == len(rules) else None


class _Parser:
    """GBNF as llama.cpp's parser reads it, as far as structure goes: rules of alternatives
    of items (literals, classes, tokens and ``.`` are terminals; groups become rules)."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0
        self.rules: list[_Rule] = []
        self.names: dict[str, int] = {}

    def parse(self) -> list[_Rule]:
        self._space()
        while self.pos < len(self.text):
            name = self._name()
            self._space()
            if not self.text.startswith("::=", self.pos):
                raise _Unparsed
            self.pos += 3
            self._space()
            self._alternates(self._named(name), nested=False)
            self._space()
        if any(not rule.alternatives for rule in self.rules):  # referred to, never defined
            raise _Unparsed
        return self.rules

    def _named(self, name: str) -> int:
        if name not in self.names:
            self.names[name] = len(self.rules)
            self.rules.append(_Rule())
        return self.names[name]

    def _alternates(self, index: int, nested: bool) -> None:
        """Alternatives up to the end of the rule (a newline outside groups) or a ``)``. Groups
        nest at most MAX_GRAMMAR_NESTING deep (checked before), so this recursion is bounded."""
        target = self.rules[index]
        sequence: list[_Item] = []
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
                    raise _Unparsed
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
                self.rules.append(_Rule())
                self._alternates(group, nested=True)
                if not self.text.startswith(")", self.pos):
                    raise _Unparsed
                self.pos += 1
                sequence.append(_Item(group))
            elif char in '"[':
                start = self.pos
                self._skip_until('"' if char == '"' else "]")
                # "", [] and [^] add nothing to the rule in llama.cpp: they match nothing.
                if self.text[start : self.pos] not in ('""', "[]", "[^]"):
                    sequence.append(_Item(None))
            elif char == ".":
                self.pos += 1
                sequence.append(_Item(None))
            elif char in "<!":
                end = self.text.find(">", self.pos)
                if end < 0:
                    raise _Unparsed
                self.pos = end + 1
                sequence.append(_Item(None))
            else:
                sequence.append(_Item(self._named(self._name())))

    def _repetition(self, sequence: list[_Item]) -> None:
        if not sequence:
            raise _Unparsed
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
                raise _Unparsed
            self.pos += 1
        else:
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
        last = sequence[-1]
        if (last.low, last.high) != (1, 1):
            # llama.cpp repeats what the last repetition produced: a group's worth.
            nested = _Rule([[last]])
            self.rules.append(nested)
            last = sequence[-1] = _Item(len(self.rules) - 1)
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
            raise _Unparsed
        self.pos = match.end()
        return int(match.group())

    def _name(self) -> str:
        match = _NAME.match(self.text, self.pos)
        if match is None:
            raise _Unparsed
        self.pos = match.end()
        return match.group()

    def _skip_until(self, closing: str) -> None:
        i = self.pos + 1
        while i < len(self.text) and self.text[i] != closing:
            i += 2 if self.text[i] == "\\" else 1
        if i >= len(self.text):
            raise _Unparsed
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
