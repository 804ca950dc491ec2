"""JSON Schema grammars: accepted by llama.cpp, and generation that always matches the schema."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from llamacrab import (
    JSON_OBJECT_GRAMMAR,
    GrammarError,
    InvalidParameterError,
    Llama,
    SamplerChain,
    SamplingOptions,
    schema_to_grammar,
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer"},
        "role": {"enum": ["crab", "lobster"]},
        "tags": {"type": "array", "items": {"const": "x"}, "maxItems": 2},
        "ok": {"type": ["boolean", "null"]},
    },
    "required": ["name", "age", "role"],
}
TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer"},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 1},
            },
            "required": ["v"],
        }
    },
    "$ref": "#/$defs/node",
}
ALL_OPTIONAL = {"type": "object", "properties": {"a": {"const": 1}, "b": {"const": 2}}}


def check_person(value: Any) -> None:
    assert set(value) <= set(PERSON["properties"]) and {"name", "age", "role"} <= set(value)
    # A random byte-level model can emit bytes that are not UTF-8 (decoded as U+FFFD here);
    # llama.cpp's grammar counts the characters it did accept.
    assert isinstance(value["name"], str) and len(value["name"].replace("\ufffd", "")) <= 6
    assert isinstance(value["age"], int) and value["role"] in ("crab", "lobster")
    assert value.get("tags", []) in ([], ["x"], ["x", "x"]) and value.get("ok") in (
        True,
        False,
        None,
    )


@pytest.mark.parametrize("schema", [PERSON, TREE, ALL_OPTIONAL, {"type": "array"}, {}])
def test_llama_cpp_accepts_the_grammars(tiny_llama: Llama, schema: dict[str, Any]) -> None:
    options = SamplingOptions(grammar=schema_to_grammar(schema))
    SamplerChain(tiny_llama.model, options).close()
    SamplerChain(tiny_llama.model, SamplingOptions(grammar=JSON_OBJECT_GRAMMAR)).close()


def test_generation_always_matches_the_schema(tiny_llama: Llama) -> None:
    grammar = schema_to_grammar(PERSON)
    for seed in range(6):
        result = tiny_llama.create_completion("the cat", max_tokens=300, grammar=grammar,
                                              temperature=1.0, seed=seed)  # fmt: skip
        assert result.choices[0].finish_reason == "eos", result.text
        check_person(json.loads(result.text))


def test_objects_whose_keys_are_all_optional(tiny_llama: Llama) -> None:
    grammar = schema_to_grammar(ALL_OPTIONAL)
    for seed in range(4):
        result = tiny_llama.create_completion("x", max_tokens=200, temperature=1.0, seed=seed,
                                              grammar=grammar)  # fmt: skip
        text = result.text
        assert json.loads(text) in ({}, {"a": 1}, {"b": 2}, {"a": 1, "b": 2})


def test_unsupported_schemas_are_refused() -> None:
    with pytest.raises(GrammarError, match="lookaround"):
        schema_to_grammar({"type": "string", "pattern": "^(?!a)b$"})
    with pytest.raises(GrammarError, match="resolve"):
        schema_to_grammar({"$ref": "#/$defs/missing"})
    with pytest.raises(GrammarError, match="not in properties"):
        schema_to_grammar({"type": "object", "properties": {"y": {}}, "required": ["x"]})


@pytest.mark.real_model
def test_chat_response_format_json_schema(gemma: Llama) -> None:
    messages = [{"role": "user", "content": "Describe a crab named Bob, aged 3, as JSON."}]
    result = gemma.create_chat_completion(
        messages, temperature=0, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"schema": PERSON}},
    )  # fmt: skip
    check_person(json.loads(result.text))
    with pytest.raises(InvalidParameterError, match="response_format"):
        gemma.create_chat_completion(messages, response_format={"type": "xml"})


@pytest.mark.parametrize(
    ("pattern", "problem"),
    [
        ("(ab", "unclosed group"),
        ("[ab", "unclosed character class"),
        ("ab\\", "trailing"),
        ("*a", "quantifier"),
        ("a{x}", "repetition"),
        ("a$b", "inside the pattern"),
    ],
)
def test_malformed_patterns_are_refused(pattern: str, problem: str) -> None:
    with pytest.raises(GrammarError, match=problem):
        schema_to_grammar({"type": "string", "pattern": pattern})


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        ({"type": "array", "minItems": 10**6}, "'minItems' at root-value is 1000000; it must be"),
        ({"type": "string", "minLength": -1}, "'minLength' at root-value is -1"),
        ({"type": "string", "maxLength": 2**64}, "'maxLength' at root-value is 1844"),
        ({"type": "object", "maxProperties": -3}, "'maxProperties' at root-value is -3"),
        ({"enum": []}, "'enum' at root-value is empty"),
        ({"type": []}, "'type' at root-value is empty"),
        ({"enum": [float("nan")]}, "not JSON (ValueError): nan"),
        ({"const": {1, 2}}, "not JSON (TypeError)"),
    ],
)
def test_bad_schema_values_are_refused_naming_the_keyword(
    schema: dict[str, Any], problem: str
) -> None:
    # Each failed only when llama.cpp parsed the grammar ("failed to parse grammar", naming
    # nothing), was accepted silently (minItems -5), or raised from json.dumps (a hunt).
    with pytest.raises(GrammarError, match=re.escape(problem)):
        schema_to_grammar(schema)


def test_schemas_that_grew_the_converter_without_bound_are_quick() -> None:
    # Property names that clean up to one rule name: each new rule tried every name before it
    # (16k: 30 s). One dict shared in both branches, 40 deep: 2**40 visits (hung).
    names = {"a" + chr(0x4E00 + i): {"const": i} for i in range(8000)}
    with pytest.raises(GrammarError, match="grows past"):
        schema_to_grammar({"type": "object", "properties": names, "required": list(names)})
    few = {"a" + chr(0x4E00 + i): {"const": i} for i in range(300)}
    grammar = schema_to_grammar({"type": "object", "properties": few, "required": list(few)})
    assert grammar.count(" ::= ") > 300
    shared: dict[str, Any] = {"type": "string", "maxLength": 3}
    for _ in range(40):
        shared = {"anyOf": [shared, shared]}
    assert len(schema_to_grammar(shared)) < 20_000
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(GrammarError, match="not JSON"):
        schema_to_grammar({"const": deep})


def test_a_pattern_repetition_of_other_digits_is_refused() -> None:
    # str.isdigit is true of "²": the repetition went on into the grammar as "{²}".
    with pytest.raises(GrammarError):
        schema_to_grammar({"type": "string", "pattern": "^a{²}$"})


def _required_strings(count: int, **lengths: int) -> dict[str, Any]:
    properties = {f"p{i}": {"type": "string", **lengths} for i in range(count)}
    return {"type": "object", "properties": properties, "required": list(properties)}


@pytest.mark.parametrize(
    ("schema", "repetition"),
    [
        # Each property repeated a copy of its own: 3.2M elements, past the expansion bound.
        (_required_strings(400, maxLength=2000), "{0,2000}"),
        # A repetition of a group past 1000: "failed to parse grammar" in llama.cpp.
        ({"type": "string", "maxLength": 2000}, "{0,2000}"),
        (_required_strings(3, minLength=1500), "{1500,}"),
    ],
    ids=["400-properties", "maxLength-2000", "minLength-1500"],
)
def test_long_strings_are_one_repetition_llama_cpp_accepts(
    tiny_llama: Llama, schema: dict[str, Any], repetition: str
) -> None:
    grammar = schema_to_grammar(schema)
    SamplerChain(tiny_llama.model, SamplingOptions(grammar=grammar)).close()
    assert grammar.count(repetition) == 1  # one rule per string shape, shared


def test_strings_of_other_shapes_keep_their_own_bounds(tiny_llama: Llama) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 2}, "b": {"const": "b"},
                       "c": {"type": "string", "minLength": 3, "maxLength": 4}},
        "required": ["a", "b", "c"],
    }  # fmt: skip
    for seed in range(4):
        result = tiny_llama.create_completion("x", max_tokens=300, temperature=1.0, seed=seed,
                                              grammar=schema_to_grammar(schema))  # fmt: skip
        assert result.choices[0].finish_reason == "eos", result.text
        value = json.loads(result.text)
        assert len(value["a"].replace("\ufffd", "")) <= 2
        assert 3 <= len(value["c"].replace("\ufffd", "")) <= 4
