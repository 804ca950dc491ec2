"""Bounds on GBNF text before llama.cpp's grammar parser sees it.

The parser recurses once per nested group, and its left-recursion check once per rule in a
chain of leading references: a deep enough grammar overflows the C stack (SIGSEGV, which no
handler can catch). Its repetitions copy what they repeat: the elements they build are counted
(``expansion``). Trigger words become ``std::regex`` patterns, whose compiler and matcher
also recurse per character. So the text is scanned here, in one linear pass that never
recurses, and anything past a limit raises GrammarError naming it.
"""

from __future__ import annotations

from collections.abc import Sequence

from llamacrab._exceptions import GrammarError
from llamacrab._field_types import utf8
from llamacrab._native.gbnf.expansion import MAX_REPETITION as MAX_REPETITION  # re-exported
from llamacrab._native.gbnf.expansion import Expansion, class_elements, literal_elements
from llamacrab._native.gbnf.fanout import check_grammar_fanout
from llamacrab._native.gbnf.structure import RULE_NAME, skip_quoted

MAX_GRAMMAR_BYTES = 256 * 1024
MAX_GRAMMAR_NESTING = 128  # nested ( ) groups
MAX_GRAMMAR_RULES = 8192  # named rules plus the rules groups and repetitions generate
MAX_TRIGGER_WORDS = 64
MAX_TRIGGER_WORD_CHARS = 256
# llama.cpp tokenizes a <piece> token reference on the caller's thread, unbounded
# (pretokenizer.py); it must be one token anyway.
MAX_TOKEN_REFERENCE_CHARS = 256
_REPEATS = {"*": (0, None), "+": (1, None), "?": (0, 1)}


def check_grammar(text: str) -> None:
    """Raise GrammarError if ``text`` exceeds a bound; syntax is left to llama.cpp."""
    check_grammar_size(text)
    depth = max_depth = rules = 0
    expansion = Expansion(text)
    i, n = 0, len(text)
    while i < n:
        char = text[i]
        if char == "#":  # a comment runs to the end of the line
            end = text.find("\n", i)
            i = n if end < 0 else end
        elif char in '"[':  # a literal or a character class: skip it, escapes included
            end = skip_quoted(text, i, '"' if char == '"' else "]")
            count = literal_elements if char == '"' else class_elements
            expansion.item(count(text[i + 1 : end]))
            i = end
        elif name := RULE_NAME.match(text, i):  # a rule's name
            i = name.end() - 1
            expansion.item(1)
        elif char == "<":  # a token: <id> or <piece>
            i = token_reference_end(text, i)
            expansion.item(1)
        elif char == ".":
            expansion.item(1)
        elif char == "|":
            expansion.alternative()
        elif char == "(":
            depth += 1
            rules += 1
            max_depth = max(max_depth, depth)
            expansion.open_group()
        elif char == ")":
            depth = max(0, depth - 1)
            expansion.close_group()
        elif char in "*+?{" or text.startswith("::=", i):
            rules += 1
            if char == "{":
                low, high, end = repetition_counts(text, i)
                if low is not None and low > MAX_REPETITION:  # exact_repetitions wrote the rest
                    raise GrammarError(
                        f"a repetition of at least {low} times; the limit is {MAX_REPETITION} "
                        "(llama.cpp's)"
                    )
                if low is not None:
                    expansion.repeat(low, high, i, end)
                i = end - 1
            elif char == ":":
                expansion.rule()
            else:
                expansion.repeat(*_REPEATS[char], i, i + 1)
        i += 1
    if max_depth > MAX_GRAMMAR_NESTING:
        raise GrammarError(
            f"the grammar nests groups {max_depth} deep; the limit is {MAX_GRAMMAR_NESTING}"
        )
    if rules > MAX_GRAMMAR_RULES:
        raise GrammarError(
            f"the grammar defines about {rules} rules (groups and repetitions included); "
            f"the limit is {MAX_GRAMMAR_RULES}"
        )
    check_grammar_fanout(text)  # after the nesting bound, which its parser relies on


def check_grammar_size(text: str, what: str = "the grammar") -> None:
    size = len(utf8(text, "the grammar", GrammarError))
    if size > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"{what} is {size} bytes; the limit is {MAX_GRAMMAR_BYTES}")


def check_trigger_words(words: Sequence[str]) -> None:
    if len(words) > MAX_TRIGGER_WORDS:
        raise GrammarError(f"{len(words)} grammar trigger words; the limit is {MAX_TRIGGER_WORDS}")
    for word in words:
        if not word or len(word) > MAX_TRIGGER_WORD_CHARS:
            raise GrammarError(
                f"a grammar trigger word must have 1 to {MAX_TRIGGER_WORD_CHARS} characters, "
                f"not {len(word)}"
            )


def token_reference_end(text: str, start: int) -> int:
    end = text.find(">", start)
    end = len(text) if end < 0 else end
    if end - start - 1 > MAX_TOKEN_REFERENCE_CHARS:
        raise GrammarError(
            f"the token reference {text[start : start + 20]}... is {end - start - 1} "
            f"characters; the limit is {MAX_TOKEN_REFERENCE_CHARS} (it must be one token)"
        )
    return end


def repetition_counts(text: str, start: int) -> tuple[int | None, int | None, int]:
    """The counts of the repetition ``{m,n}`` at ``start`` (None where absent) and the index
    past it. n < m is refused: llama.cpp computes n - m unsigned and adds rules until memory
    runs out (a bad_alloc after gigabytes and seconds, or the process killed first)."""
    numbers: list[int | None] = []
    i = start + 1
    for _ in range(2):
        i = _skip_space(text, i)
        j = i
        while j < len(text) and text[j].isascii() and text[j].isdigit():
            j += 1
        if j - i > 20:  # past 64 bits: llama.cpp's stoull throws (and Python's int() past 4300)
            raise GrammarError(f"a repetition count has {j - i} digits; the limit is 20")
        numbers.append(int(text[i:j]) if j > i else None)
        i = _skip_space(text, j)
        if i >= len(text) or text[i] != ",":
            break
        i += 1
    low, high = numbers[0], numbers[-1] if len(numbers) == 2 else numbers[0]
    if low is not None and high is not None and high < low:
        raise GrammarError(f"the repetition {{{low},{high}}} has its maximum below its minimum")
    return low, high, i + 1 if text.startswith("}", i) else i


def _skip_space(text: str, i: int) -> int:
    """Past spaces, newlines and comments, as llama.cpp's parse_space (nested) skips them."""
    while i < len(text):
        if text[i] == "#":
            end = text.find("\n", i)
            i = len(text) if end < 0 else end
        elif text[i] in " \t\r\n":
            i += 1
        else:
            break
    return i
