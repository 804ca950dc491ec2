"""The size of a GBNF grammar once llama.cpp's parser has expanded its repetitions.

llama.cpp stores each rule as a vector of elements: one per character of a literal, one per
entry of a character class (two for a range), one per token, ``.``, rule reference, ``|`` and
rule end. A repetition copies the elements of the item before it: ``S{m,n}`` writes S m times
into its rule and generates n - m rules holding S once more each (``S{m,}``, ``*`` and ``+``:
one such rule). Its own threshold counts repetitions of rules (at most 2000), not elements, so
``"aaaa…"{2000}`` from a 64 KB grammar built 128 million elements: 8.9 s and 2.6 GB in the
parse alone (250 KB: 55 s, 8.5 GB). A group is a rule of its own: repeating it copies one
reference. Measured on Gemma 3's vocabulary, the parse of 2M elements takes 0.05 s and 30 MB
(a literal repeated) to 0.3 s and 95 MB (repetitions of one character: 4 elements per rule
generated); 16M elements, 0.5 s and 270 MB.
"""

from __future__ import annotations

import re

from llamacrab._exceptions import GrammarError

# Elements llama.cpp's parser may build from one grammar. Our JSON Schemas build ~8,000 per
# distinct string shape of maxLength 2000 (a rule repeated; longer ones over shared chunks of
# 1000) and ~20,000 for a pattern's class{1,2000}; llama.cpp's example grammars under 500.
MAX_GRAMMAR_ELEMENTS = 2_000_000
# llama.cpp's MAX_REPETITION_THRESHOLD: a larger minimum count fails its parser (a vague
# "failed to parse grammar"), a larger maximum means no maximum.
MAX_REPETITION = 2000
# One character as llama.cpp's parse_char reads it (an escape included).
_CHAR = re.compile(r"\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)|.", re.DOTALL)


def literal_elements(body: str) -> int:
    """Elements of the literal ``"body"``: one per character."""
    return len(_CHAR.findall(body))


def class_elements(body: str) -> int:
    """Elements of the class ``[body]``: one per character, the end of a range included
    (``a-z``: two); a leading ``^`` adds none."""
    chars = _CHAR.findall(body[1:] if body.startswith("^") else body)
    elements = i = 0
    while i < len(chars):
        if i + 2 < len(chars) and chars[i + 1] == "-":  # a range: its "-" is no element
            elements, i = elements + 2, i + 3
        else:
            elements, i = elements + 1, i + 1
    return elements


class Expansion:
    """Counts elements as the items of a grammar are read in order, and refuses the grammar
    at the first repetition that takes the count past MAX_GRAMMAR_ELEMENTS."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.total = 0
        # Per open group (the rule at the bottom): elements of the item a repetition copies.
        self.last = [0]

    def item(self, elements: int) -> None:
        self.total += elements
        self.last[-1] = elements

    def rule(self) -> None:
        """A rule starts (``name ::=``): its end adds one element."""
        self.total += 1
        self.last = [0]

    def alternative(self) -> None:
        self.item(1)  # the ALT element; nothing before it to repeat
        self.last[-1] = 0

    def open_group(self) -> None:
        self.total += 1  # the group rule's end
        self.last.append(0)

    def close_group(self) -> None:
        if len(self.last) > 1:
            self.last.pop()
        self.item(1)  # its rule's reference

    def repeat(self, low: int, high: int | None, start: int, end: int) -> None:
        """``text[start:end]`` repeats the last item ``low`` to ``high`` (None: no maximum)
        times: llama.cpp writes it ``low`` times and adds a rule per optional copy (the item,
        a reference to the next, an ALT, an END), or one for no maximum. A repetition of a
        repetition copies all it wrote, so nested counts multiply."""
        size = self.last[-1]
        if high is not None and high > MAX_REPETITION:
            high = None
        optional = 1 if high is None else max(0, high - low)
        written = low * size + (optional > 0)
        self.total += written - size + optional * (size + 3)
        self.last[-1] = written
        if self.total > MAX_GRAMMAR_ELEMENTS:
            line = self.text.count("\n", 0, start) + 1
            raise GrammarError(
                f"the repetition {self.text[start:end].strip()} on line {line}, of an item of "
                f"{size} elements (characters of a literal, entries of a class), expands the "
                f"grammar to about {self.total} elements in llama.cpp's parser; the limit is "
                f"{MAX_GRAMMAR_ELEMENTS} (a rule or group repeated copies one element)"
            )
