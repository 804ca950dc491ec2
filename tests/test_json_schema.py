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
    Model,
    SamplerChain,
    SamplingOptions,
    schema_to_grammar,
)
from llamacrab._native.gbnf import repetition

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
        ({"type": "array", "minItems": 2**64}, "'minItems' at root-value is 1844"),
        ({"type": "string", "minLength": -1}, "'minLength' at root-value is -1"),
        ({"type": "string", "minLength": 3000, "maxLength": 2500}, "maxLength 2500 < minLength"),
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


def _takes(model: Model, grammar: str, text: str) -> bool:
    """Whether ``grammar`` takes all of ``text`` and may end there: its tokens accepted one by
    one, then the end of generation. The tiny model's tokenizer puts a space before a text."""
    spaced = grammar.replace("root ::= ", 'root ::= " " ', 1)
    chain = SamplerChain(model, SamplingOptions(grammar=spaced))
    try:
        for token in [*model.vocab.tokenize(text, add_special=False), model.vocab.eog_tokens[0]]:
            chain.accept(token)
    except GrammarError:
        return False
    finally:
        chain.close()
    return True


def _string(n: int) -> str:
    return '"' + "a" * n + '"'


def _array(n: int) -> str:
    return "[" + ",".join(["0"] * n) + "]"


def _object(n: int) -> str:
    return "{" + ",".join(f'"k{i}":0' for i in range(n)) + "}"


ZERO = {"const": 0}


@pytest.mark.parametrize(
    ("schema", "text", "low", "high"),
    [
        ({"type": "string", "maxLength": 5000}, _string, 0, 5000),
        ({"type": "string", "minLength": 3000}, _string, 3000, None),
        ({"type": "string", "minLength": 2100, "maxLength": 4321}, _string, 2100, 4321),
        ({"type": "array", "items": ZERO, "maxItems": 2500}, _array, 0, 2500),
        ({"type": "array", "items": ZERO, "minItems": 2500}, _array, 2500, None),
        ({"type": "array", "prefixItems": [ZERO], "items": ZERO, "maxItems": 2500}, _array, 1,
         2500),
        ({"type": "object", "additionalProperties": ZERO, "maxProperties": 2500}, _object, 0,
         2500),
        ({"type": "string", "pattern": "^a{0,5000}$"}, _string, 0, 5000),
        ({"type": "string", "pattern": "^(a|b){2500,}$"}, _string, 2500, None),
    ],
    ids=["maxLength", "minLength", "both-lengths", "maxItems", "minItems", "prefixItems",
         "maxProperties", "pattern-max", "pattern-min"],
)  # fmt: skip
def test_counts_past_llama_cpps_repetition_limit_are_exact(
    tiny_llama: Llama, schema: dict[str, Any], text: Any, low: int, high: int | None
) -> None:
    # llama.cpp reads a repetition's maximum past 2000 as none (maxLength 5000 took any string)
    # and refuses a minimum past 2000: written over chunk rules, both bounds hold.
    grammar = schema_to_grammar(schema)
    model = tiny_llama.model
    assert _takes(model, grammar, text(high if high is not None else low + 1))
    assert _takes(model, grammar, text(low))
    if high is not None:
        assert not _takes(model, grammar, text(high + 1))
    if low:
        assert not _takes(model, grammar, text(low - 1))


def test_long_strings_of_any_shape_share_their_chunks(tiny_llama: Llama) -> None:
    schema = _required_strings(2, maxLength=5000)
    schema["properties"]["long"] = {"type": "string", "minLength": 3000, "maxLength": 9000}
    grammar = schema_to_grammar(schema)
    SamplerChain(tiny_llama.model, SamplingOptions(grammar=grammar)).close()
    assert grammar.count("{1000}") == 1 and grammar.count("string-char-upto-5000 ::=") == 1
    # Bounds up to 2**63 stay exact, over a chunk rule per factor of 1000: a small grammar,
    # read a few ways at once.
    huge = schema_to_grammar({"type": "string", "minLength": 2**62, "maxLength": 2**63})
    assert len(huge) < 5000 and not _takes(tiny_llama.model, huge, _string(3))
    assert _takes(tiny_llama.model, schema_to_grammar({"type": "string", "maxLength": 2**63}),
                  _string(3))  # fmt: skip


CHUNKED_COUNTS = [(0, 5), (0, 9), (0, 10), (0, 26), (0, 27), (0, 31), (0, 61), (5, 23),
                  (7, None), (28, 40), (30, None)]  # fmt: skip


@pytest.mark.parametrize(("low", "high"), CHUNKED_COUNTS)
def test_chunked_counts_hold_at_every_length(
    tiny_llama: Llama, monkeypatch: pytest.MonkeyPatch, low: int, high: int | None
) -> None:
    """The chunks in base 3 past a limit of 4: the decomposition's every level, and each
    length around each bound, at counts llama.cpp checks quickly."""
    monkeypatch.setattr(repetition, "CHUNK", 3)
    monkeypatch.setattr(repetition, "MAX_REPETITION", 4)
    lengths = {"minLength": low} if high is None else {"minLength": low, "maxLength": high}
    grammar = schema_to_grammar({"type": "string", **lengths})
    assert "{3}" in grammar  # chunked
    for n in range((high if high is not None else low + 10) + 2):
        accepted = low <= n and (high is None or n <= high)
        assert _takes(tiny_llama.model, grammar, _string(n)) == accepted, n
