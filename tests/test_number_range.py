"""Bounded integers and numbers in JSON Schema grammars: exactly the values in range match."""

from __future__ import annotations

import random
import re
from collections import Counter
from decimal import Decimal
from typing import Any

import pytest

from llamacrab import GrammarError, schema_to_grammar
from llamacrab._grammar.number_range import Bound, bounded
from llamacrab._native.gbnf.fanout import check_grammar_fanout


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
        ({"type": "integer", "minimum": 5, "maximum": 2}, "minimum 5 is greater than maximum 2"),
        ({"type": "integer", "minimum": 10**17}, "leaves no number of at most 16 digits"),
        ({"type": "string", "minimum": 1}, "'minimum' on string"),
    ]
    for schema, words in refused:
        with pytest.raises(GrammarError, match=words):
            schema_to_grammar(schema)


# -- numbers between decimal bounds, either end excluded --------------------------------------


def root_rule(grammar: str) -> str:
    """The body of the rule the root names (a bounded number's, which refers to no other)."""
    rules = dict(line.split(" ::= ", 1) for line in grammar.splitlines() if " ::= " in line)
    return rules[rules["root"]]


def schema_pattern(schema: dict[str, Any]) -> re.Pattern[str]:
    return as_regex(root_rule(schema_to_grammar(schema)))


ZEROS_1 = "0." + "0" * 15 + "1"  # the smallest fraction the grammar writes: 16 digits


@pytest.mark.parametrize(
    ("schema", "good", "bad"),
    [
        # pydantic's PositiveFloat, NegativeFloat, confloat(gt=1, lt=5)
        ({"exclusiveMinimum": 0}, ["0.5", "0.01", "1", "3.25", ZEROS_1, "9" * 16],
         ["0", "0.0", "0.000", "-0.5", "-0", "-0.0", "-1", ZEROS_1 + "0"]),
        ({"exclusiveMaximum": 0}, ["-0.5", "-1", "-" + ZEROS_1, "-" + "9" * 16],
         ["0", "-0", "-0.0", "0.5", "0.0", "1"]),
        ({"exclusiveMaximum": 5}, ["4.999", "4." + "9" * 16, "0", "-100", "4"],
         ["5", "5.0", "5.00", "5.0001", "6", "50"]),
        ({"exclusiveMinimum": 1, "exclusiveMaximum": 5}, ["1.0001", "2", "4.99", "3.0"],
         ["1", "1.0", "1.000", "5", "5.000", "0.5", "-2", "15"]),
        # decimal bounds: the fraction compared digit by digit, trailing zeros equal
        ({"minimum": 0.5, "maximum": 99.99},
         ["0.5", "0.50", "0.5000", "0.51", "1", "99.99", "99.990", "99.9899", "50.5"],
         ["0.4999", "0.49", "0", "99.991", "99.9900001", "100", "99.999", "-0.5", ".5"]),
        ({"exclusiveMinimum": 0.1}, ["0.11", "0.1000001", "1", "0.2"],
         ["0.1", "0.10", "0.100", "0.09", "0", "-0.2"]),
        ({"minimum": -2.5, "maximum": -2.25}, ["-2.5", "-2.50", "-2.25", "-2.3", "-2.4999"],
         ["-2.51", "-2.2", "-2.249", "-3", "2.3", "-2"]),
        ({"exclusiveMinimum": -2.5, "exclusiveMaximum": -2.25}, ["-2.3", "-2.4999", "-2.26"],
         ["-2.5", "-2.500", "-2.25", "-2.250"]),
        # across zero: 0 is written "0", never "-0"
        ({"minimum": -2.5, "exclusiveMaximum": 1.5},
         ["-2.5", "-1", "0", "0.0", "-0.5", "1.4999", "1"],
         ["-2.5001", "1.5", "1.50", "2", "-3", "-0", "-0.0"]),
        ({"exclusiveMinimum": -0.5, "maximum": 0}, ["-0.4", "-0.49", "0", "0.000"],
         ["-0.5", "-0.50", "0.1", "-1"]),
        ({"minimum": 2.5, "maximum": 2.5}, ["2.5", "2.50"], ["2.4", "2.51", "2", "3"]),
        ({"maximum": -0.0}, ["0", "0.00", "-1"], ["0.1", "-0"]),  # -0.0 is 0
        ({"exclusiveMaximum": -0.0}, ["-0.1"], ["0", "-0", "-0.0"]),
        ({"minimum": 1e-5}, ["0.00001", "0.00002", "1"], ["0.000009", "0.0000099", "0"]),
        ({"maximum": 1234.5}, ["1234.5", "1234", "-1234.6", "999.99"], ["1234.51", "1235"]),
        # the tighter of two lower bounds; at one value, the exclusive one
        ({"minimum": 3, "exclusiveMinimum": 3}, ["3.1"], ["3", "3.0"]),
        ({"minimum": 3, "exclusiveMinimum": 2}, ["3", "3.5"], ["2.5", "2.9"]),
        ({"maximum": 1.25, "exclusiveMaximum": 1.5}, ["1.25"], ["1.26", "1.5"]),
        ({"minimum": 0, "exclusiveMinimum": True}, ["0.1"], ["0", "0.0"]),  # draft-04
        # the grammar's form: no exponent, no leading zero, at most 16 digits each side
        ({"minimum": 0}, ["0", "12.5", ZEROS_1, "9" * 16 + "." + "9" * 16],
         ["1e2", "01", "00.5", "1.", "+1", ZEROS_1 + "0", "1" + "0" * 16]),
    ],
)  # fmt: skip
def test_number_bounds_take_exactly_the_numbers_within(
    schema: dict[str, Any], good: list[str], bad: list[str]
) -> None:
    pattern = schema_pattern({"type": "number", **schema})
    assert [text for text in good if not matches(pattern, text)] == []
    assert [text for text in bad if matches(pattern, text)] == []


@pytest.mark.parametrize(
    ("schema", "good", "bad"),
    [
        ({"minimum": 0.5}, ["1", "2"], ["0", "-1"]),  # JSON Schema compares 1 >= 0.5
        ({"exclusiveMaximum": 2.5}, ["2", "-7"], ["3"]),
        ({"minimum": -2.5, "maximum": -0.5}, ["-2", "-1"], ["-3", "0", "-0"]),
        ({"exclusiveMinimum": 1.0, "maximum": 3.0}, ["2", "3"], ["1", "4"]),
    ],
)
def test_integer_decimal_bounds_take_the_whole_numbers_within(
    schema: dict[str, Any], good: list[str], bad: list[str]
) -> None:
    pattern = schema_pattern({"type": "integer", **schema})
    assert [text for text in good if not matches(pattern, text)] == []
    assert [text for text in bad if matches(pattern, text)] == []


def test_a_whole_multiple_between_decimal_bounds() -> None:
    grammar = schema_to_grammar({"type": "number", "multipleOf": 5, "minimum": 2.5,
                                 "exclusiveMaximum": 15})  # fmt: skip
    assert root_rule(grammar) == '"5" | "10"'


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"exclusiveMinimum": 1e17}, "exclusiveMinimum 1e+17 at root-value leaves no number of "
         "at most 16 digits"),
        ({"maximum": -float("inf")}, "maximum -inf at root-value leaves no number"),
        ({"minimum": float("nan")}, "minimum at root-value must be a number, not nan"),
        ({"minimum": 5.5, "maximum": 2}, "minimum 5.5 is greater than maximum 2"),
        ({"exclusiveMinimum": 3, "exclusiveMaximum": 3},
         "exclusiveMinimum 3 and exclusiveMaximum 3 leave no number between them"),
        ({"minimum": 3, "exclusiveMaximum": 3.0},
         "minimum 3 and exclusiveMaximum 3.0 leave no number between them"),
        ({"type": "integer", "minimum": 0.2, "maximum": 0.8},
         "minimum 0.2 and maximum 0.8 leave no integer between them"),
        ({"type": "integer", "exclusiveMinimum": 9999999999999999}, "no integer of at most 16"),
    ],
)  # fmt: skip
def test_bounds_that_cannot_be_met_are_named(schema: dict[str, Any], named: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(named)):
        schema_to_grammar({"type": "number", **schema})


@pytest.mark.parametrize(
    ("schema", "good", "bad"),
    [
        # Past every number of the grammar (16 digits a side): no bound at all.
        ({"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
         ["0", "-9999999999999999", "9999999999999999"], []),
        ({"minimum": -float("inf"), "maximum": 1.8e308}, ["-1.5", "12345.25"], []),
        ({"exclusiveMinimum": -1e20, "maximum": 1}, ["-9999999999999999.5", "1"], ["1.5"]),
        # Between two numbers of 16 decimals: the nearest one inside, inclusive.
        ({"exclusiveMinimum": 1e-17}, ["0.0000000000000001", "2"], ["0", "0.0"]),
        ({"exclusiveMaximum": 1e-20}, ["0", "-0.5", "0.0000000000000000"], ["0.0000000000000001"]),
        ({"maximum": 0.1 + 0.2}, ["0.3", "0.3000000000000000"], ["0.3000000000000001"]),
        ({"minimum": 0, "exclusiveMaximum": 1 / 7},
         ["0.1428571428571428"], ["0.1428571428571429", "0.15"]),
    ],
)  # fmt: skip
def test_bounds_past_the_grammar_s_digits(
    schema: dict[str, Any], good: list[str], bad: list[str]
) -> None:
    grammar = schema_to_grammar({"type": "number", **schema})
    if grammar.startswith(("root ::= json-number\n", "root ::= json-integer\n")):  # no bound
        assert not bad
        return
    pattern = as_regex(root_rule(grammar))
    assert [text for text in good if not matches(pattern, text)] == []
    assert [text for text in bad if matches(pattern, text)] == []


def test_properties_of_one_range_share_its_rule() -> None:
    # A rule per property took 620 bytes each: 456 of them reached the 256 KiB grammar bound.
    properties = {f"p{i}": {"type": "number", "minimum": -1, "maximum": 1} for i in range(1000)}
    grammar = schema_to_grammar(
        {"type": "object", "properties": properties, "required": list(properties)}
    )
    assert grammar.count("number-range ::=") == 1
    assert len(grammar.encode()) < 64 * 1024


def test_a_bound_past_every_number_of_the_grammar_is_named() -> None:
    beyond = Bound(Decimal("9" * 16 + "." + "9" * 16), exclusive=True, keyword="exclusiveMinimum")
    with pytest.raises(GrammarError, match="leave no number of at most 16 digits"):
        bounded(beyond, None, fraction=True)


def _random_decimal(rng: random.Random) -> Decimal:
    """A decimal of 0 to 3 places, either sign, often near zero."""
    places = rng.randint(0, 3)
    span = 30 if rng.random() < 0.3 else 3000
    return Decimal(rng.randint(-span, span)).scaleb(-places)


def _spelled(value: Decimal, rng: random.Random) -> str:
    """``value`` as JSON writes it, sometimes with zeros after the point."""
    text = format(value, "f")
    if rng.random() < 0.3:
        text += ("" if "." in text else ".") + "0" * rng.randint(1, 3)
    return text


CHECKS = {
    "minimum": Decimal.__ge__,
    "exclusiveMinimum": Decimal.__gt__,
    "maximum": Decimal.__le__,
    "exclusiveMaximum": Decimal.__lt__,
}


@pytest.mark.parametrize("seed", range(3))
def test_random_bounds_take_exactly_the_values_within(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        bounds = {}
        for side in ("Minimum", "Maximum"):
            if rng.random() < 0.8:
                key = "exclusive" + side if rng.random() < 0.5 else side.lower()
                bounds[key] = float(_random_decimal(rng))  # as json.loads reads it
        if not bounds:
            continue
        exact = {key: Decimal(repr(value)) for key, value in bounds.items()}
        try:
            pattern = schema_pattern({"type": "number", **bounds})
        except GrammarError:  # only when nothing lies between the two
            assert len(exact) == 2
            (low_key, low), (high_key, high) = sorted(exact.items(), key=lambda b: "ax" in b[0])
            assert low > high or (low == high and "exclusive" in low_key + high_key)
            continue
        values = [_random_decimal(rng) for _ in range(30)]
        for end in exact.values():
            values += [end + Decimal(step) for step in ("0", "0.001", "-0.001", "0.0001")]
        for value in values:
            text = _spelled(value, rng)
            if value == 0 and text.startswith("-"):
                continue  # "-0" is never written
            within = all(CHECKS[key](value, end) for key, end in exact.items())
            assert matches(pattern, text) == within, (bounds, text)


def _ways(gbnf: str, text: str) -> int:
    """How many ways the digit rules' subset of GBNF (literals, classes, groups, ``|``, ``?``,
    ``{m,n}``) reads all of ``text``: 1 for an unambiguous grammar that takes it."""
    tokens = re.findall(r'"[^"]*"|\[[^\]]*\]|\{\d+(?:,\d+)?\}|[()|?]', gbnf)
    assert "".join(tokens) == gbnf.replace(" ", ""), "an item outside the subset"
    position = 0

    def alternatives() -> Any:
        nonlocal position
        options = [sequence()]
        while position < len(tokens) and tokens[position] == "|":
            position += 1
            options.append(sequence())
        return ("|", options)

    def sequence() -> Any:
        nonlocal position
        items = []
        while position < len(tokens) and tokens[position] not in "|)":
            token = tokens[position]
            position += 1
            if token == "(":
                item = alternatives()
                position += 1  # ")"
            else:
                item = ("text", token)
            while position < len(tokens) and tokens[position][0] in "?{":
                low, _, high = tokens[position].strip("{}").partition(",")
                counts = (0, 1) if tokens[position] == "?" else (int(low), int(high or low))
                item = ("repeat", item, *counts)
                position += 1
            items.append(item)
        return ("seq", items)

    def ends(node: Any, start: int) -> Counter[int]:
        """Where ``node`` may end when it starts at ``start``, and in how many ways."""
        kind = node[0]
        if kind == "text":
            token = node[1]
            if token[0] == '"':
                word = token[1:-1]
                return Counter({start + len(word): 1} if text.startswith(word, start) else {})
            fits = start < len(text) and re.fullmatch(token, text[start])
            return Counter({start + 1: 1} if fits else {})
        if kind == "|":
            return sum((ends(option, start) for option in node[1]), Counter())
        if kind == "seq":
            here = Counter({start: 1})
            for item in node[1]:
                following: Counter[int] = Counter()
                for at, count in here.items():
                    for end, more in ends(item, at).items():
                        following[end] += count * more
                here = following
            return here
        _, item, fewest, most = node
        here, total = Counter({start: 1}), Counter({start: 1} if fewest == 0 else {})
        for times in range(1, most + 1):
            following = Counter()
            for at, count in here.items():
                for end, more in ends(item, at).items():
                    following[end] += count * more
            here = following
            if times >= fewest:
                total += here
        return total

    tree = alternatives()
    return ends(tree, 0)[len(text)]


@pytest.mark.parametrize(
    "schema",
    [{"exclusiveMinimum": 0}, {"exclusiveMaximum": 0}, {"minimum": -2.5, "maximum": 99.99},
     {"exclusiveMinimum": 0.1, "exclusiveMaximum": 0.15}, {"minimum": -7, "maximum": 3.5}],
)  # fmt: skip
def test_each_number_is_read_one_way(schema: dict[str, Any]) -> None:
    body = root_rule(schema_to_grammar({"type": "number", **schema}))
    texts = ["0", "0.0", "0.5", "0.1001", "0.12", "1", "-1", "3.5", "3.50", "-2.5", "-0.25",
             "42.125", "99.99", "99.990", "0.0001", "-0.0001", "7", "-7.0", ZEROS_1]  # fmt: skip
    pattern = as_regex(body)
    for text in texts:
        assert _ways(body, text) == (1 if matches(pattern, text) else 0), text


@pytest.mark.parametrize(
    "schema",
    [{"type": "number", "exclusiveMinimum": 0}, {"type": "number", "exclusiveMaximum": 0},
     {"type": "number", "minimum": -0.0000000000000001, "maximum": 999999999999999.5},
     {"type": "number", "exclusiveMinimum": 0.123456789, "exclusiveMaximum": 0.123456799},
     {"type": "object", "properties": {k: {"type": "number", "exclusiveMinimum": 0.5 + i}
                                       for i, k in enumerate("abcdefgh")}}],
)  # fmt: skip
def test_number_bound_grammars_stay_small_and_pass_the_fanout_check(
    schema: dict[str, Any],
) -> None:
    grammar = schema_to_grammar(schema)
    check_grammar_fanout(grammar)
    rules = [line for line in grammar.splitlines() if line.startswith("root")]
    assert max(len(rule) for rule in rules) < 2000, max(rules, key=len)
