"""Schema keywords past the core: those enforced by the grammar take valid JSON and refuse the
rest; the validation-only ones are accepted without being enforced (as llama-server) while the
rest of the schema still holds; a tool's parameters resolve their refs against themselves."""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Any

import pytest
from test_json_schema import _takes

from llamacrab import GrammarError, Llama, Model, schema_to_grammar
from llamacrab._chat.generic_tools import generic_grammar, parse_generic
from llamacrab._chat.tool_calls import forced_call_grammar

S = {"type": "string"}


class Raw(str):
    """JSON text written as it is (a number spelled so)."""


def _check(model: Model, schema: dict[str, Any], good: list[Any], bad: list[Any]) -> None:
    grammar = schema_to_grammar(schema)
    for value in good:
        assert _takes(model, grammar, _text(value)), (schema, value)
    for value in bad:
        assert not _takes(model, grammar, _text(value)), (schema, value)


def _text(value: Any) -> str:
    return value if isinstance(value, Raw) else json.dumps(value)


FORMATS = {
    "ipv4": (["192.168.0.1", "0.0.0.0", "255.255.255.255"], ["256.1.1.1", "1.2.3", "01.2.3.4"]),
    "ipv6": (
        ["::1", "::", "fe80::1:2", "2001:db8:0:0:0:0:2:1", "1:2:3:4:5:6:7::"],
        ["1:2:3:4:5:6:7:8:9", "1::2::3", "12345::", ":1"],
    ),
    "hostname": (["example.com", "a-b.c", "localhost"], ["-a.com", "a_b", "a..b", ""]),
    "duration": (["P1D", "PT1H30M", "P1DT2.5S", "P2W", "P1Y2M3DT4H5M6S"], ["P", "PT", "1D", "P1H"]),
}


@pytest.mark.parametrize("name", FORMATS)
def test_openai_formats_are_enforced(tiny_llama: Llama, name: str) -> None:
    good, bad = FORMATS[name]
    _check(tiny_llama.model, {"type": "string", "format": name}, good, bad)


def test_generated_formats_are_valid(tiny_llama: Llama) -> None:
    label = r"[a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?"
    time = r"T(?=\d)(\d+H)?(\d+M)?(\d+(\.\d+)?S)?"
    checks = {
        "ipv4": ipaddress.IPv4Address,
        "ipv6": ipaddress.IPv6Address,
        "hostname": re.compile(rf"{label}(\.{label})*").fullmatch,
        "duration": re.compile(rf"P(?!$)(\d+Y)?(\d+M)?(\d+D)?({time})?|P\d+W").fullmatch,
    }
    for name, check in checks.items():
        grammar = schema_to_grammar({"type": "string", "format": name})
        for seed in range(3):
            result = tiny_llama.create_completion("x", max_tokens=120, temperature=1.0,
                                                  seed=seed, grammar=grammar)  # fmt: skip
            assert result.choices[0].finish_reason == "eos", result.text
            assert check(json.loads(result.text)), (name, result.text)


@pytest.mark.parametrize(
    ("schema", "good", "bad"),
    [
        # At most 16 digits, as every integer of the grammar: unbounded, Gemma wrote digits
        # until its budget ran out.
        ({"type": "integer", "multipleOf": 5}, [0, 5, 15, -10, 1234567890, 10**15],
         [7, -3, 51, 10**16]),
        ({"type": "integer", "multipleOf": 7, "exclusiveMinimum": 0}, [7, 700], [0, -7, 8]),
        ({"type": "integer", "multipleOf": 5, "minimum": 3}, [5, 10], [0, -5, 3]),
        ({"type": "integer", "multipleOf": 3, "minimum": -6, "maximum": 6}, [-6, 0, 6], [9, 4]),
        ({"type": "integer", "multipleOf": 10, "maximum": 0}, [0, -10], [10, -5]),
        ({"type": "number", "multipleOf": 5}, [10], [Raw("10.5"), 11]),
        ({"type": "number", "multipleOf": 0.01}, [Raw("1.25"), 3, Raw("-0.5")], [Raw("1.255")]),
        ({"type": "integer", "minimum": 3, "exclusiveMinimum": True}, [4], [3]),
        # number bounds, either end excluded, with decimals: pydantic's PositiveFloat,
        # NegativeFloat, confloat(gt=1, lt=5), confloat(ge=0.5, le=99.99); "-0" never
        ({"type": "number", "exclusiveMinimum": 0}, [Raw("0.5"), Raw("0.01"), 1, Raw("3.25")],
         [0, Raw("0.0"), Raw("0.000"), Raw("-0.5"), Raw("-0")]),
        ({"type": "number", "exclusiveMaximum": 0}, [Raw("-0.5"), -1],
         [0, Raw("-0"), Raw("-0.0"), Raw("0.5")]),
        ({"type": "number", "exclusiveMaximum": 5}, [Raw("4.999"), -8], [5, Raw("5.0"), 6]),
        ({"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 5}, [2, Raw("4.99")],
         [1, Raw("1.0"), 5, Raw("5.00")]),
        ({"type": "number", "minimum": 0.5, "maximum": 99.99},
         [Raw("0.5"), Raw("0.50"), Raw("99.99"), Raw("99.990"), 42],
         [Raw("0.49"), Raw("0.4999"), Raw("99.991"), 100, 0]),
        ({"type": "number", "exclusiveMinimum": 0.1}, [Raw("0.11"), 7], [Raw("0.1"), Raw("0.10")]),
        ({"type": "number", "minimum": -2.5, "exclusiveMaximum": -2.25},
         [Raw("-2.5"), Raw("-2.50"), Raw("-2.30")], [Raw("-2.25"), Raw("-2.250"), Raw("-2.51")]),
        ({"type": "number", "minimum": -2.5, "maximum": 1.5}, [0, Raw("-2.5"), Raw("1.50")],
         [Raw("-0"), Raw("1.51"), -3]),
        ({"type": "integer", "minimum": 0.5, "exclusiveMaximum": 3.5}, [1, 3], [0, 4]),
        ({"type": "integer", "maximum": 3, "exclusiveMaximum": True}, [2], [3]),
        ({"type": "string", "nullable": True}, ["a", None], [1]),
        ({"type": "object", "minProperties": 1, "maxProperties": 2,
          "additionalProperties": {"type": "integer"}},
         [{"a": 1}, {"a": 1, "b": 2}], [{}, {"a": 1, "b": 2, "c": 3}, {"a": "x"}]),
        # pattern enforced, and the length beside it where the pattern repeats one character
        ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, ["abc"], ["AB", "abcdef"]),
    ],
)  # fmt: skip
def test_enforced_keywords(
    tiny_llama: Llama, schema: dict[str, Any], good: list[Any], bad: list[Any]
) -> None:
    _check(tiny_llama.model, schema, good, bad)


@pytest.mark.parametrize(
    ("schema", "good", "bad"),
    [
        ({"type": "array", "items": S, "uniqueItems": True}, [["a", "b"], ["a", "a"]], [[1]]),
        ({"type": "integer", "not": {"const": 3}}, [1, 3], ["x"]),
        ({"type": "object", "properties": {"a": S}, "if": {"required": ["a"]},
          "then": {"required": ["b"]}, "else": {}}, [{"a": "x"}], [{"a": 1}]),
        ({"type": "object", "propertyNames": {"pattern": "^x"},
          "additionalProperties": {"type": "integer"}}, [{"x": 1}, {"y": 2}], [{"x": "s"}]),
        ({"type": "object", "properties": {"a": S}, "required": ["a"],
          "dependentRequired": {"a": ["b"]}}, [{"a": "x"}], [{"a": 2}]),
        # patternProperties: names not checked, values of the patterns' schemas
        ({"type": "object", "properties": {"a": S}, "required": ["a"],
          "patternProperties": {"^n_": {"type": "integer"}}},
         [{"a": "x", "n_1": 2}, {"a": "x", "z": 2}], [{"a": "x", "n_1": "s"}]),
        ({"type": "object", "properties": {"a": S, "b": S}, "required": ["a"],
          "minProperties": 2, "maxProperties": 2}, [{"a": "x"}, {"a": "x", "b": "y"}], [{}]),
        ({"type": "string", "format": "path"}, ["/tmp/x", "anything"], [1]),  # pydantic Path
        ({"type": "string", "format": "binary"}, ["Zm9v"], [None]),  # pydantic bytes
        ({"type": "string", "format": "uri-reference", "maxLength": 8}, ["../a/b"], ["../a/b/c/d"]),
        ({"type": "string", "format": "uuid", "pattern": "^a+$"}, ["aaa"], ["b"]),
        ({"type": "string", "pattern": "^a+b*$", "maxLength": 2}, ["aaab"], ["b"]),
    ],
)  # fmt: skip
def test_accepted_keywords_are_not_enforced_but_the_rest_is(
    tiny_llama: Llama, schema: dict[str, Any], good: list[Any], bad: list[Any]
) -> None:
    _check(tiny_llama.model, schema, good, bad)


def _sized(pattern: str, low: int | None, high: int | None) -> dict[str, Any]:
    sizes = {"minLength": low, "maxLength": high}
    return {
        "type": "string",
        "pattern": pattern,
        **{k: v for k, v in sizes.items() if v is not None},
    }


@pytest.mark.parametrize(
    ("schema", "good", "bad"),
    [
        # One character repeated (pydantic's constr(pattern=..., max_length=...)): cut counts.
        (_sized("^[a-z0-9_]+$", 3, 8), ["abc", "a_b_c_d1"], ["ab", "abcdefghi", "ABC"]),
        (_sized("^[a-z]*$", None, 2), ["", "ab"], ["abc"]),
        (_sized("^\\d{2,10}$", 4, None), ["1234", "1234567890"], ["123", "12345678901"]),
        (_sized("^(x|y)+$", 2, 3), ["xy", "yyx"], ["x", "xyxy"]),
        (_sized("^.{0,3000}$", None, 2500), ["a" * 2500], ["a" * 2501]),  # past 2000: chunks
        # A pattern of one length only: the lengths hold already.
        (_sized("^[A-Z]{2}-[0-9]{4}$", 5, 7), ["AB-1234"], ["AB-123"]),
        # Others: the pattern holds, the lengths are not enforced (as llama-server).
        (_sized("^a+b+$", 1, 3), ["ab", "aabbb"], ["ba"]),
    ],
)
def test_lengths_beside_a_pattern(
    tiny_llama: Llama, schema: dict[str, Any], good: list[Any], bad: list[Any]
) -> None:
    _check(tiny_llama.model, schema, good, bad)


@pytest.mark.parametrize(
    "schema",
    [_sized("^[A-Z]{2}-[0-9]{4}$", 8, None), _sized("^[a-z]{5,}$", None, 4),
     _sized("^(ab|cd)$", 3, 10)],
)  # fmt: skip
def test_a_pattern_no_string_of_its_lengths_matches_is_refused(schema: dict[str, Any]) -> None:
    with pytest.raises(GrammarError, match="matches no string of"):
        schema_to_grammar(schema)


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "string", "minLenght": 3}, "'minLenght'"),  # a typo is no keyword
        ({"type": "integer", "multipleOf": 0}, "multipleOf"),
        ({"type": "number", "multipleOf": float("inf")}, "multipleOf"),
        ({"type": "integer", "multipleOf": 7, "minimum": 3, "maximum": 10_000}, "multipleOf 7"),
        ({"type": "integer", "multipleOf": 5, "minimum": 6, "maximum": 9}, "no multiple"),
        ({"type": "integer", "multipleOf": 65}, "multipleOf above 64"),
        ({"type": "number", "multipleOf": 0.3}, "multipleOf 0.3"),
        ({"type": "number", "multipleOf": 0.1, "maximum": 3}, "without bounds"),
        ({"type": "number", "exclusiveMinimum": 3, "exclusiveMaximum": 3},
         "exclusiveMinimum 3 and exclusiveMaximum 3 leave no number"),
        ({"type": "number", "minimum": 2.5, "maximum": -2.5}, "minimum 2.5 is greater than"),
        ({"type": "number", "minimum": 1e20}, "minimum 1e+20"),
        ({"not": {}}, "allows no value"),
        ({"type": "object", "minProperties": 3, "maxProperties": 2}, "maxProperties 2 <"),
        ({"type": "object", "properties": {"a": S, "b": S}, "required": ["a", "b"],
          "maxProperties": 1}, "the 2 required"),
        ({"type": "object", "additionalProperties": False, "minProperties": 1}, "minProperties"),
        ({"type": "array", "uniqueItems": "yes"}, "'uniqueItems'"),
        ({"type": "string", "nullable": "yes"}, "'nullable'"),
        ({"$ref": "https://example.com/schema.json"}, "cannot resolve"),
    ],
)  # fmt: skip
def test_what_is_refused_is_named(schema: dict[str, Any], named: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(named)):
        schema_to_grammar(schema)


# -- a tool's parameters are a document of their own ---------------------------------------------


def _tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


ADDRESS = {"type": "object", "properties": {"city": S}, "required": ["city"]}
PERSON = {  # openai.pydantic_function_tool of a pydantic model with a nested one
    "$defs": {"Address": {**ADDRESS, "title": "Address", "additionalProperties": False}},
    "properties": {"name": S, "address": {"$ref": "#/$defs/Address"}},
    "required": ["name", "address"],
    "type": "object",
    "additionalProperties": False,
}
DRAFT7 = {  # zod-to-json-schema and many MCP servers
    "definitions": {"Point": {"type": "array", "items": {"type": "integer"}, "maxItems": 2}},
    "type": "object",
    "properties": {"at": {"$ref": "#/definitions/Point"}},
    "required": ["at"],
}
# the same ref name, another meaning: each tool's refs are its own
OTHER = {
    "$defs": {"Address": {"type": "integer"}},
    "type": "object",
    "properties": {"address": {"$ref": "#/$defs/Address"}},
    "required": ["address"],
}
TOOLS = [_tool("person", PERSON), _tool("point", DRAFT7), _tool("other", OTHER)]


def _generic(name: str, arguments: Any) -> str:
    return json.dumps({"tool_call": {"name": name, "arguments": arguments}})


def _native(name: str, arguments: Any) -> str:
    return json.dumps({"name": name, "arguments": arguments})


BY_NAME = {"type": "function", "function": {"name": "person"}}


@pytest.mark.parametrize(
    ("build", "call"),
    [
        (lambda: generic_grammar(TOOLS, "auto"), _generic),
        (lambda: generic_grammar(TOOLS, "required"), _generic),
        (lambda: generic_grammar(TOOLS, BY_NAME), _generic),
        (lambda: forced_call_grammar(TOOLS), _native),
    ],
)
def test_tool_parameters_resolve_their_own_refs(tiny_llama: Llama, build: Any, call: Any) -> None:
    grammar = build()
    model = tiny_llama.model
    assert _takes(model, grammar, call("person", {"name": "A", "address": {"city": "B"}}))
    assert not _takes(model, grammar, call("person", {"name": "A", "address": {"city": 1}}))
    if "point" in grammar:  # not the tool forced by name
        assert _takes(model, grammar, call("point", {"at": [1, 2]}))
        assert not _takes(model, grammar, call("point", {"at": [1, 2, 3]}))
        assert _takes(model, grammar, call("other", {"address": 7}))
        assert not _takes(model, grammar, call("other", {"address": {"city": "B"}}))


def test_a_response_format_beside_tools_resolves_its_own_refs(tiny_llama: Llama) -> None:
    grammar = generic_grammar(TOOLS, "auto", response_schema=PERSON)
    reply = {"response": {"name": "A", "address": {"city": "B"}}}
    assert _takes(tiny_llama.model, grammar, json.dumps(reply))
    reply["response"]["address"] = 3
    assert not _takes(tiny_llama.model, grammar, json.dumps(reply))


def test_remote_refs_in_tools_are_refused() -> None:
    remote = {"type": "object", "properties": {"a": {"$ref": "https://x.test/a.json"}}}
    with pytest.raises(GrammarError, match="cannot resolve"):
        generic_grammar([_tool("t", remote)], "auto")


# -- a call cut at max_tokens ----------------------------------------------------------------------


def test_a_cut_call_with_a_whole_name_is_returned_with_its_arguments_so_far() -> None:
    text = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Par'
    content, calls = parse_generic(text)
    assert content == ""
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Par')]
    assert calls[0].id.startswith("call_")
    _, calls = parse_generic('{"tool_call": {"name": "get_weather"')
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", "")]
    for unnamed in ('{"tool_call": {"name": "get_wea', '{"tool_call": {', "{"):
        assert parse_generic(unnamed) == ("", [])
