"""A corpus of JSON Schemas: each grammar compiles in llama.cpp, and sampled generations from
the tiny model (and Gemma for a subset) parse and validate with the jsonschema package."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from llamacrab import GrammarError, Llama, schema_to_grammar

S = {"type": "string", "maxLength": 8}
CORPUS: list[dict[str, Any]] = [
    {"type": "integer"},
    {"type": "number"},
    {"type": "boolean"},
    {"type": "null"},
    {"type": "string", "maxLength": 5},
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"type": ["integer", "null"]},
    {"enum": ["red", "green", 3, None]},
    {"const": {"a": [1, 2]}},
    {"type": "integer", "minimum": -3, "maximum": 7},
    {"type": "integer", "minimum": 0},
    {"type": "integer", "minimum": 1},
    {"type": "integer", "minimum": -250, "maximum": 1000000},
    {"type": "integer", "exclusiveMinimum": 100, "exclusiveMaximum": 2000},
    {"type": "integer", "maximum": -7},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "number", "minimum": -40, "maximum": 60},
    {"type": ["number", "null"], "minimum": 2},
    {"type": "number", "exclusiveMinimum": 0},
    {"type": "number", "exclusiveMaximum": 0},
    {"type": "number", "minimum": -2.5, "exclusiveMaximum": 99.99},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "time"},
    {"type": "string", "format": "date-time"},
    {"type": "string", "format": "uuid"},
    {"type": "string", "format": "email"},
    {"type": "string", "format": "uri"},
    {"type": "string", "format": "ipv4"},
    {"type": "string", "format": "ipv6"},
    {"type": "string", "format": "hostname"},
    {"type": "string", "format": "duration"},
    {"type": "integer", "multipleOf": 5},
    {"type": "integer", "multipleOf": 3, "minimum": -9, "maximum": 30},
    {
        "type": "object",
        "additionalProperties": {"type": "integer"},
        "minProperties": 1,
        "maxProperties": 2,
    },
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
    {"type": "array", "maxItems": 0},
    {"type": "array", "prefixItems": [S, {"type": "integer"}], "items": False},
    {"type": "array", "prefixItems": [{"const": 1}], "items": {"type": "null"}, "maxItems": 3},
    {"type": "object", "properties": {"a": S, "b": {"type": "integer"}}, "required": ["a", "b"]},
    {"type": "object", "properties": {"a": S, "b": {"type": "integer"}}, "required": ["b"]},
    {"type": "object", "properties": {"a": {"const": 1}, "b": {"const": 2}}},
    {"type": "object", "properties": {"a": S}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"a": S}, "additionalProperties": {"type": "integer"}},
    {"type": "object", "additionalProperties": {"type": "boolean"}, "maxProperties": 3},
    {"type": "object", "properties": {}, "additionalProperties": False},
    {"anyOf": [{"type": "integer"}, S]},
    {"oneOf": [{"const": "x"}, {"type": "boolean"}]},
    {
        "allOf": [
            {"properties": {"a": S}, "required": ["a"]},
            {"properties": {"b": {"type": "integer"}}, "required": ["b"]},
        ]
    },
    {
        "$defs": {
            "p": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
        },
        "$ref": "#/$defs/p",
    },
    {
        "definitions": {"c": {"enum": ["r", "g"]}},
        "type": "array",
        "items": {"$ref": "#/definitions/c"},
        "maxItems": 2,
    },
    {
        "$defs": {
            "n": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer", "minimum": 0, "maximum": 9},
                    "next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]},
                },
                "required": ["v", "next"],
            }
        },
        "$ref": "#/$defs/n",
    },
    {
        "type": "object",
        "properties": {
            "when": {"type": "string", "format": "date"},
            "tags": {"type": "array", "items": S, "maxItems": 2},
        },
        "required": ["when"],
    },
    {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"},
    {"type": "string", "pattern": "^(cat|dog)s?$"},
    {"type": "string", "pattern": "^\\d{1,3}\\.\\d{2}$"},
    {"type": "string", "pattern": "^[A-Z][a-z]{0,5}( [A-Z][a-z]{0,5}){0,2}$"},
    {"type": "string", "pattern": "^a.c$"},
    {"type": "string", "pattern": "^(?:ab){1,3}[^xyz]?$"},
    {"type": "string", "pattern": "^\\w{2}\\s\\w{2}$"},
    {"title": "annotated", "description": "ignored", "type": "boolean", "default": True},
    {},
    {
        "type": "array",
        "items": {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]},
        "maxItems": 2,
    },
]


@pytest.fixture(scope="module")
def roomy_tiny(tiny_model_path: Path) -> Iterator[Llama]:
    """Room for the long strings a random model writes before it happens to close them."""
    with Llama(tiny_model_path, n_ctx=2048, n_threads=2) as llm:
        yield llm


def generate(llm: Llama, schema: dict[str, Any], seed: int, **options: Any) -> Any:
    result = llm.create_completion(
        "json:",
        max_tokens=1900,
        temperature=1.0,
        seed=seed,
        grammar=schema_to_grammar(schema),
        **options,
    )
    assert result.choices[0].finish_reason == "eos", (schema, result.text)
    return json.loads(result.text)


def test_corpus_size_covers_the_keywords() -> None:
    assert len(CORPUS) >= 40 - 1  # plus the refusals below
    used = {key for schema in CORPUS for key in json.dumps(schema).split('"')[1::2]}
    for keyword in (
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "prefixItems",
        "additionalProperties",
        "allOf",
        "anyOf",
        "oneOf",
        "$ref",
        "$defs",
        "format",
        "const",
        "enum",
    ):
        assert keyword in used


@pytest.mark.parametrize("index", range(len(CORPUS)))
def test_tiny_model_generations_validate(roomy_tiny: Llama, index: int) -> None:
    schema = CORPUS[index]
    # The random tiny model spells text byte by byte and happily writes invalid UTF-8, which no
    # real model does: its non-ASCII byte tokens (ids 131..258) are banned here.
    ascii_only = {"logit_bias": {token: float("-inf") for token in range(3 + 128, 3 + 256)}}
    for seed in range(3):
        jsonschema.validate(generate(roomy_tiny, schema, seed, **ascii_only), schema)


# Schemas whose JSON can grow without bound (a recursive list, any JSON at all, any number of
# extra properties): a small model may repeat itself until max_tokens, which proves nothing
# about the grammar. The tiny model covers them above; Gemma takes every bounded schema.
UNBOUNDED = {
    i
    for i, s in enumerate(CORPUS)
    if s == {} or "n" in s.get("$defs", {}) or s.get("additionalProperties") not in (None, False)
}


@pytest.mark.real_model
@pytest.mark.parametrize("index", sorted(set(range(len(CORPUS))) - UNBOUNDED))
def test_gemma_generations_validate(gemma: Llama, index: int) -> None:
    schema = CORPUS[index]
    for seed in range(2):
        jsonschema.validate(generate(gemma, schema, seed), schema)


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "string", "pattern": "^(?=a)a$"}, "lookaround"),
        ({"type": "string", "pattern": "^(a)\\1$"}, "escape"),
        ({"type": "string", "pattern": 'say "hi"'}, "JSON"),
        ({"type": "number", "minimum": 1e17}, "minimum"),
        ({"type": "number", "minimum": 1, "exclusiveMaximum": 1}, "exclusiveMaximum"),
    ],
)
def test_unsupported_keywords_are_named(schema: dict[str, Any], keyword: str) -> None:
    with pytest.raises(GrammarError, match=keyword):
        schema_to_grammar(schema)
