"""Bounded integers and numbers in JSON Schema grammars: exactly the values in range match."""

from __future__ import annotations

import random
import re

import pytest

from llamacrab import GrammarError, schema_to_grammar
from llamacrab._grammar.number_range import bounded


def as_regex(gbnf: str) -> re.Pattern[str]:
    """The digit rules use only literals, classes, groups, ? and {m,n}: the same in Python."""
    out = re.sub(r'"([^"]*)"', lambda m: re.escape(m.group(1)), gbnf)
    return re.compile(out.replace(" ", ""))


def matches(pattern: re.Pattern[str], text: str) -> bool:
    return pattern.fullmatch(text) is not None


@pytest.mark.parametrize(
    ("low", "high"),
    [(0, 0), (0, 9), (3, 17), (10, 99), (7, 1234), (-5, 1000), (-1234, -7), (-99, 99),
     (95, 105), (1, 1), (-10, -10), (199, 2001), (0, 10000)],
)  # fmt: skip
def test_integer_ranges_match_exactly(low: int, high: int) -> None:
    pattern = as_regex(bounded(low, high, fraction=False))
    for value in range(low - 30, high + 31):
        assert matches(pattern, str(value)) == (low <= value <= high), value
    assert not matches(pattern, "-0") and not matches(pattern, "007")


@pytest.mark.parametrize("low", [None, -1000, -3, 0, 1, 42, 10**12])
def test_open_ranges(low: int | None) -> None:
    pattern = as_regex(bounded(low, None, fraction=False))
    rng = random.Random(low)
    samples = [rng.randrange(-(10**15), 10**15) for _ in range(2000)]
    samples += [0, 1, -1, 10**15 + 1, -(10**15)] + ([low - 1, low, low + 1] if low else [])
    for value in samples:
        fits = abs(value) < 10**16 and (low is None or value >= low)
        assert matches(pattern, str(value)) == fits, value
    upper = as_regex(bounded(None, 250, fraction=False))
    assert matches(upper, "250") and matches(upper, "-99999") and not matches(upper, "251")


def test_number_ranges_respect_the_fraction_at_the_bounds() -> None:
    pattern = as_regex(bounded(-2, 3, fraction=True))
    inside = ["0", "3", "3.0", "3.000", "2.999", "-2", "-2.00", "-1.5", "0.25", "-0.5", "1"]
    outside = ["3.01", "4", "-2.1", "-3", "10", "3.", "1e2", "01.5"]
    assert all(matches(pattern, text) for text in inside)
    assert not any(matches(pattern, text) for text in outside)
    positive = as_regex(bounded(1, None, fraction=True))
    assert matches(positive, "1.5") and matches(positive, "12345.25")
    assert not matches(positive, "0.99") and not matches(positive, "-1")


def test_schema_keywords_and_refusals() -> None:
    exclusive = schema_to_grammar({"type": "integer", "exclusiveMinimum": 0,
                                   "exclusiveMaximum": 10})  # fmt: skip
    assert "[1-9]" in exclusive
    refused = [
        ({"type": "number", "maximum": 1.5}, "whole-number bounds"),
        ({"type": "number", "exclusiveMinimum": 0}, "exclusiveMinimum"),
        ({"type": "integer", "minimum": 5, "maximum": 2}, "greater than maximum"),
        ({"type": "integer", "minimum": 10**17}, "more than 16 digits"),
        ({"type": "string", "minimum": 1}, "'minimum' on string"),
    ]
    for schema, words in refused:
        with pytest.raises(GrammarError, match=words):
            schema_to_grammar(schema)
