"""GBNF repetitions past llama.cpp's count limit, rewritten so that llama.cpp enforces them.

llama.cpp's parser reads a maximum above MAX_REPETITION as no maximum at all (``[a-z]{0,5000}``
let text run on) and refuses a minimum above it. Such a repetition is written over chunk rules
instead (``repetition.repeat``: exact, one reading per text), the rules appended to the
grammar under names no word of it has. Comments are dropped (a repeated item becomes
a rule body, where one would hide what follows it); the rest of the text is kept as it is. Text
that is not GBNF is left as it is for llama.cpp to refuse, and an unchanged text is returned
when no count needs it.
"""

from __future__ import annotations

import re

from llamacrab._native.gbnf.bounds import (
    check_grammar_size,
    repetition_counts,
    token_reference_end,
)
from llamacrab._native.gbnf.repetition import fits, repeat
from llamacrab._native.gbnf.structure import RULE_NAME, skip_quoted

_RULE_START = re.compile(r"[ \t]*::=")
# Counts of four digits or more: the only texts worth scanning (a count past 2000 has them).
_LONG_NUMBER = re.compile(r"[0-9]{4}")


def exact_repetitions(text: str) -> str:
    """``text`` with every repetition llama.cpp would not enforce as written made exact."""
    check_grammar_size(text)
    if not _LONG_NUMBER.search(text):
        return text
    exact = _Rewrite(text).run()
    check_grammar_size(exact, "the grammar with its counts past 2000 written out")
    return exact


class _Rewrite:
    def __init__(self, text: str) -> None:
        self.text = text
        self.out: list[str] = []
        # Per open group (the rule at the bottom): where in ``out`` the item a repetition
        # would repeat starts (None: none, as after ``|``), and where each group opened.
        self.last: list[int | None] = [None]
        self.groups: list[int] = []
        self.rules: dict[str, str] = {}  # appended rules, by name
        self.named: dict[str, str] = {}  # body: its appended rule
        self.words = set(RULE_NAME.findall(text))  # no appended rule takes a name among them
        self.changed = False

    def run(self) -> str:
        text, i = self.text, 0
        while i < len(text):
            i = self._step(text, i)
        if not self.changed:
            return text
        rules = "".join(f"\n{name} ::= {body}" for name, body in self.rules.items())
        return "".join(self.out) + "\n" + rules

    def _step(self, text: str, i: int) -> int:
        """Copy (or rewrite) what starts at ``i``; the index past it."""
        char = text[i]
        if char == "#":  # a comment runs to the end of the line
            end = text.find("\n", i)
            return len(text) if end < 0 else end
        if char in '"[':
            return self._item(skip_quoted(text, i, '"' if char == '"' else "]") + 1, i)
        if char == "<" or text.startswith("!<", i):
            return self._item(token_reference_end(text, i + (char == "!")) + 1, i)
        if char == ".":
            return self._item(i + 1, i)
        if name := RULE_NAME.match(text, i):
            if _RULE_START.match(text, name.end()):  # a rule's definition starts
                self.last, self.groups = [None], []
                self.out.append(name.group())
                return name.end()
            return self._item(name.end(), i)
        if char == "(":
            self.groups.append(len(self.out))
            self.last.append(None)
        elif char == ")" and self.groups:
            self.last.pop()
            self.last[-1] = self.groups.pop()  # the group is the item now
        elif char == "|" or (char == "\n" and not self.groups):  # a line ends a rule's items
            self.last[-1] = None
        elif char == "{":
            return self._repetition(text, i)
        self.out.append(char)
        return i + 1

    def _item(self, end: int, start: int) -> int:
        self.last[-1] = len(self.out)
        self.out.append(self.text[start:end])
        return end

    def _repetition(self, text: str, i: int) -> int:
        low, high, end = repetition_counts(text, i)
        start = self.last[-1]
        unclosed = text[end - 1] != "}"  # llama.cpp refuses it: it is not repaired here
        if low is None or fits(low, high) or start is None or unclosed:
            self.out.append(text[i:end])
            return end
        item = "".join(self.out[start:]).strip()
        del self.out[start:]
        hint = f"repeat-{len(self.named) + 1}"
        self.out.append(repeat(self._add, item, low, high, hint) + " ")
        self.changed = True
        return end

    def _add(self, hint: str, body: str) -> str:
        """The appended rule ``hint`` (or ``hint-2``, ...) for ``body``; one per body."""
        known = self.named.get(body)
        if known is not None:
            return known
        name, n = hint, 1
        while name in self.rules or name in self.words:
            n += 1
            name = f"{hint}-{n}"
        self.rules[name] = body
        self.named[body] = name
        return name
