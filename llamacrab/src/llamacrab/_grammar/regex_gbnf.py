"""A documented subset of regular expressions, translated to GBNF for JSON string ``pattern``s.

Supported: literal characters, ``.``, character classes ``[...]`` and ``[^...]`` with ranges,
``\\d \\w \\s`` (and ``\\D \\W \\S`` outside classes), escaped punctuation, groups ``(...)`` and
``(?:...)``, alternation ``|``, quantifiers ``* + ? {m} {m,} {m,n}`` (a trailing ``?`` making them
lazy is accepted: it matches the same strings; counts past llama.cpp's limit over chunk rules,
``repetition``), and ``^``/``$`` at the ends. The grammar makes
the whole string match (which also satisfies JSON Schema's unanchored search). Characters a
JSON string must escape (``"``, ``\\``, control characters) cannot be matched. Anything else
(lookarounds, backreferences, named groups, flags) raises GrammarError.
"""

from __future__ import annotations

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

    def alternation(self) -> str:
        options = [self.sequence()]
        while self.peek() == "|":
            self.take()
            options.append(self.sequence())
        return options[0] if len(options) == 1 else "( " + " | ".join(options) + " )"

    def sequence(self) -> str:
        items = []
        while self.peek() not in ("", "|", ")"):
            items.append(self.quantified(self.atom()))
        return " ".join(items) if items else '""'

    def atom(self) -> str:
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
            return f"( {inner} )"
        if char == "[":
            return self.char_class()
        if char == ".":
            return _ANY
        if char == "\\":
            return self.escape()
        if char in "^$":
            raise self.fail(f"{char!r} inside the pattern")
        if char in "*+?{":
            raise self.fail(f"a quantifier {char!r} with nothing before it")
        return _char_literal(char, self.pattern)

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

    def quantified(self, atom: str) -> str:
        char = self.peek()
        if char and char in "*+?":
            self.take()
            suffix = char
        elif char == "{":
            end = self.text.find("}", self.i)
            counts = self.text[self.i + 1 : end].split(",") if end > 0 else []
            if not 1 <= len(counts) <= 2 or not all(
                decimal(c.strip()) is not None or c == "" for c in counts
            ):
                raise self.fail("this repetition")
            self.i = end + 1
            suffix = "{" + ",".join(c.strip() for c in counts) + "}"
            low, high = decimal(counts[0].strip()), decimal(counts[-1].strip())
            if low is not None and not fits(low, high):
                suffix = ""
                atom = repeat(self.add, atom, low, high, "pattern-item")
        else:
            return atom
        if self.peek() == "?":  # lazy: the same strings
            self.take()
        return f"{atom}{suffix}"


def pattern_to_gbnf(pattern: str, add: AddRule) -> str:
    """A GBNF expression for the contents of a JSON string matching ``pattern`` entirely; the
    rules it needs (chunks of a long repetition) made with ``add``."""
    parser = _Parser(pattern, add)
    expression = parser.alternation()
    if parser.i != len(parser.text):
        raise parser.fail(f"{parser.text[parser.i]!r} at position {parser.i}")
    return expression
