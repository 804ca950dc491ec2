"""A documented subset of regular expressions, translated to GBNF for JSON string ``pattern``s.

Supported: literal characters, ``.``, character classes ``[...]`` and ``[^...]`` with ranges,
``\\d \\w \\s`` (and ``\\D \\W \\S`` outside classes), escaped punctuation, groups ``(...)`` and
``(?:...)``, alternation ``|``, quantifiers ``* + ? {m} {m,} {m,n}`` (a trailing ``?`` making them
lazy is accepted: it matches the same strings; counts past llama.cpp's limit over chunk rules,
``repetition``), and ``^``/``$`` at the ends. The grammar makes
the whole string match (which also satisfies JSON Schema's unanchored search). Characters a
JSON string must escape (``"``, ``\\``, control characters) cannot be matched. Anything else
(lookarounds, backreferences, named groups, flags) raises GrammarError.

A string's minLength/maxLength beside a pattern hold where the pattern allows no other length
(``[A-Z]{2}[0-9]{4}``), where it is one character repeated (``[a-z0-9_]+``: the counts are cut
to the lengths), and refuse a pattern no string of those lengths matches; elsewhere they are not
enforced (as llama-server enforces none beside a pattern).
"""

from __future__ import annotations

from dataclasses import dataclass

from llamacrab._exceptions import GrammarError
from llamacrab._field_types import decimal
from llamacrab._native.gbnf.repetition import AddRule, fits, repeat

_ANY = r'[^"\\\x00-\x1f]'
_CLASSES = {"d": "0-9", "w": "a-zA-Z0-9_", "s": " "}  # a tab would need escaping in JSON
_NEGATED = {
    "D": r'[^0-9"\\\x00-\x1f]',
    "W": r'[^a-zA-Z0-9_"\\\x00-\x1f]',
    "S": r'[^ \t"\\\x00-\x1f]',
}
_META = set("\\^$.|?*+()[]{}/-")


def _char_literal(char: str, pattern: str) -> str:
    if char in '"\\' or ord(char) < 0x20:
        raise GrammarError(f"pattern {pattern!r}: {char!r} cannot appear unescaped in JSON")
    return '"' + char + '"'


def _class_char(char: str, pattern: str) -> str:
    if char in '"\\' or ord(char) < 0x20:
        raise GrammarError(f"pattern {pattern!r}: {char!r} cannot appear unescaped in JSON")
    return "\\" + char if char in "]^-[" else char


MAX_PATTERN_NESTING = 32  # parsed recursively, like the GBNF it becomes


@dataclass(frozen=True)
class _Piece:
    """A part of the pattern: its GBNF and the lengths it matches (``high`` None: any). One
    character repeated keeps that character's GBNF and its counts, which lengths can cut."""

    gbnf: str
    low: int
    high: int | None
    repeated: tuple[str, int, int | None] | None = None  # (one character, low, high)


def _single(gbnf: str) -> _Piece:
    return _Piece(gbnf, 1, 1)


class _Parser:
    def __init__(self, pattern: str, add: AddRule) -> None:
        self.pattern = pattern
        self.add = add
        self.text = pattern.removeprefix("^")
        if self.text.endswith("$") and not self.text.endswith("\\$"):
            self.text = self.text[:-1]
        self.i = 0
        self.depth = 0

    def fail(self, what: str) -> GrammarError:
        return GrammarError(f"pattern {self.pattern!r}: {what} is not supported")

    def peek(self) -> str:
        """The next character, or "" at the end (never tested with `in` on a string alone)."""
        return self.text[self.i] if self.i < len(self.text) else ""

    def take(self) -> str:
        char = self.peek()
        self.i += 1
        return char

    def alternation(self) -> _Piece:
        options = [self.sequence()]
        while self.peek() == "|":
            self.take()
            options.append(self.sequence())
        if len(options) == 1:
            return options[0]
        highs = [o.high for o in options]
        high = None if None in highs else max(h for h in highs if h is not None)
        gbnf = "( " + " | ".join(o.gbnf for o in options) + " )"
        return _Piece(gbnf, min(o.low for o in options), high)

    def sequence(self) -> _Piece:
        items = []
        while self.peek() not in ("", "|", ")"):
            items.append(self.quantified(self.atom()))
        if len(items) == 1:
            return items[0]
        highs = [i.high for i in items]
        high = None if None in highs else sum(h for h in highs if h is not None)
        gbnf = " ".join(i.gbnf for i in items) if items else '""'
        return _Piece(gbnf, sum(i.low for i in items), high)

    def atom(self) -> _Piece:
        char = self.take()
        if char == "(":
            if self.text.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                raise self.fail("a lookaround or named group")
            self.depth += 1
            if self.depth > MAX_PATTERN_NESTING:
                raise GrammarError(
                    f"pattern {self.pattern!r} nests groups deeper than {MAX_PATTERN_NESTING}"
                )
            inner = self.alternation()
            self.depth -= 1
            if self.take() != ")":
                raise self.fail("an unclosed group")
            return _Piece(f"( {inner.gbnf} )", inner.low, inner.high)
        if char == "[":
            return _single(self.char_class())
        if char == ".":
            return _single(_ANY)
        if char == "\\":
            return _single(self.escape())
        if char in "^$":
            raise self.fail(f"{char!r} inside the pattern")
        if char in "*+?{":
            raise self.fail(f"a quantifier {char!r} with nothing before it")
        return _single(_char_literal(char, self.pattern))

    def escape(self) -> str:
        char = self.take()
        if not char:
            raise self.fail("a trailing backslash")
        if char in _CLASSES:
            return f"[{_CLASSES[char]}]"
        if char in _NEGATED:
            return _NEGATED[char]
        if char in _META or char in "'\"":
            return _char_literal(char, self.pattern)
        raise self.fail(f"the escape \\{char}")

    def char_class(self) -> str:
        negate = self.peek() == "^"
        if negate:
            self.take()
        parts: list[str] = []
        while True:
            char = self.take()
            if char == "":
                raise self.fail("an unclosed character class")
            if char == "]" and parts:
                break
            if char == "\\":
                escaped = self.take()
                parts.append(_CLASSES.get(escaped) or _class_char(escaped, self.pattern))
            elif char == "-" and parts and self.peek() not in ("]", ""):
                parts.append("-" + _class_char(self.take(), self.pattern))
            else:
                parts.append(_class_char(char, self.pattern))
        body = "".join(parts)
        return f'[^{body}"\\\\\\x00-\\x1f]' if negate else f"[{body}]"

    def quantified(self, piece: _Piece) -> _Piece:
        char = self.peek()
        if char and char in "*+?":
            self.take()
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
        elif char == "{":
            end = self.text.find("}", self.i)
            counts = self.text[self.i + 1 : end].split(",") if end > 0 else []
            if not 1 <= len(counts) <= 2 or not all(
                decimal(c.strip()) is not None or c == "" for c in counts
            ):
                raise self.fail("this repetition")
            self.i = end + 1
            low, high = decimal(counts[0].strip()) or 0, decimal(counts[-1].strip())
        else:
            return piece
        if self.peek() == "?":  # lazy: the same strings
            self.take()
        single = piece.low == piece.high == 1  # one character: lengths can cut its counts
        return _Piece(
            _repeated(self.add, piece.gbnf, low, high),
            piece.low * low,
            None if high is None or piece.high is None else piece.high * high,
            (piece.gbnf, low, high) if single else None,
        )


def _repeated(add: AddRule, gbnf: str, low: int, high: int | None) -> str:
    """``gbnf`` ``low`` to ``high`` times: GBNF's own counts where llama.cpp enforces them."""
    if not fits(low, high):
        return repeat(add, gbnf, low, high, "pattern-item")
    if (low, high) == (0, None):
        return f"{gbnf}*"
    if (low, high) == (1, None):
        return f"{gbnf}+"
    if (low, high) == (0, 1):
        return f"{gbnf}?"
    return f"{gbnf}{{{low},{'' if high is None else high}}}"


def pattern_to_gbnf(
    pattern: str, add: AddRule, min_length: int = 0, max_length: int | None = None
) -> str:
    """A GBNF expression for the contents of a JSON string matching ``pattern`` entirely, of
    ``min_length`` to ``max_length`` characters where that can be enforced (see above); the
    rules it needs (chunks of a long repetition) made with ``add``."""
    parser = _Parser(pattern, add)
    piece = parser.alternation()
    if parser.i != len(parser.text):
        raise parser.fail(f"{parser.text[parser.i]!r} at position {parser.i}")
    too_short = piece.high is not None and piece.high < min_length
    if too_short or (max_length is not None and piece.low > max_length):
        raise GrammarError(
            f"pattern {pattern!r} matches no string of {min_length} to "
            f"{'any number of' if max_length is None else max_length} characters"
        )
    if piece.repeated is not None:
        unit, low, high = piece.repeated
        if max_length is not None:
            high = max_length if high is None else min(high, max_length)
        return _repeated(add, unit, max(low, min_length), high)
    return piece.gbnf
