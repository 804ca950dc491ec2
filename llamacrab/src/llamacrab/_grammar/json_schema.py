"""JSON Schema to GBNF: grammars that make llama.cpp's sampler emit only matching JSON.

Enforced: type (object, array, string, number, integer, boolean, null, or a list of them),
properties with required (declaration order), additionalProperties (false, true or a schema),
min/maxProperties of objects without properties, items, prefixItems, minItems/maxItems,
string minLength/maxLength, pattern (the regex subset of _regex_gbnf) and format (date, time,
date-time, duration, uuid, email, uri, hostname, ipv4, ipv6), minimum/maximum and
exclusiveMinimum/exclusiveMaximum, digit by digit (numbers: bounds with up to 16 decimals,
compared exactly, values written without exponent or "-0"; integers: the whole numbers in
range; draft-04's boolean exclusive bounds too),
multipleOf of integers (a divisibility automaton, or the multiples of a short range), enum,
const, anyOf/oneOf, allOf of objects, OpenAPI's nullable, and $ref into #/$defs or
#/definitions (recursion too) of the document the ref is in: a ``Document`` embedded in a
larger schema (a tool's parameters) resolves its refs against itself.

Accepted, not enforced (as llama-server does; the answer matches the rest of the schema):
the validation-only keywords of _NOT_ENFORCED, other string formats (a plain string), lengths
beside a format, and beside a pattern where regex_gbnf cannot hold them, and min/maxProperties
beside properties. Any other keyword is refused, by name, rather than loosened.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from collections.abc import Mapping
from typing import Any

from llamacrab._exceptions import GrammarError
from llamacrab._grammar.number_range import (
    Bound,
    bounded,
    decimal_bound,
    multiples,
    tighter,
    whole_range,
)
from llamacrab._grammar.regex_gbnf import pattern_to_gbnf
from llamacrab._grammar.string_formats import FORMATS
from llamacrab._native.gbnf.bounds import MAX_GRAMMAR_BYTES
from llamacrab._native.gbnf.repetition import repeat

# Keywords that constrain nothing a grammar must enforce.
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment",
                "$defs", "definitions", "deprecated", "readOnly", "writeOnly"}  # fmt: skip
# Validation keywords a grammar cannot express at a bounded size: accepted and not enforced,
# as llama-server's converter ignores them (pydantic's set is uniqueItems, MCP tools carry the
# rest). The answer still matches everything else in the schema.
_NOT_ENFORCED = {
    "uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else",
    "propertyNames", "patternProperties", "dependentRequired", "dependentSchemas",
    "dependencies", "unevaluatedProperties", "unevaluatedItems", "contentEncoding",
    "contentMediaType", "contentSchema", "discriminator",
}  # fmt: skip
_SUPPORTED = _ANNOTATIONS | _NOT_ENFORCED | {
    "type", "properties", "required", "additionalProperties", "minProperties", "maxProperties",
    "items", "prefixItems",
    "minItems", "maxItems", "minLength", "maxLength", "format", "pattern", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "enum",
    "const", "anyOf", "oneOf", "allOf", "$ref", "nullable",
}  # fmt: skip
_BOUNDS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
# The JSON type each keyword's value must have (a schema is untrusted input: a wrong type is
# a GrammarError naming it, not a TypeError from deep inside the converter).
_NUMBER = (int, float)
_KEYWORD_TYPES: dict[str, tuple[type, ...]] = {
    "type": (str, list), "properties": (Mapping,), "required": (list,),
    "additionalProperties": (bool, Mapping), "minProperties": (int,), "maxProperties": (int,),
    "items": (bool, Mapping), "multipleOf": _NUMBER, "nullable": (bool,),
    "patternProperties": (Mapping,), "not": (bool, Mapping), "uniqueItems": (bool,),
    "prefixItems": (list,), "minItems": (int,), "maxItems": (int,), "minLength": (int,),
    "maxLength": (int,), "format": (str,), "pattern": (str,), "minimum": _NUMBER,
    "maximum": _NUMBER, "exclusiveMinimum": _NUMBER, "exclusiveMaximum": _NUMBER,
    "enum": (list,), "anyOf": (list,), "oneOf": (list,), "allOf": (list,), "$ref": (str,),
    "$defs": (Mapping,), "definitions": (Mapping,),
}  # fmt: skip
# Counts of items, characters or properties: grammar repetitions, any count written so that
# llama.cpp enforces it exactly (repetition.py).
_COUNTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")
_PRIMITIVES = {
    "ws": r"[ \t\n]{0,8}",
    "json-string": r'"\"" ( [^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\""',
    "json-number": r'json-integer ( "." [0-9]{1,16} )? ( [eE] [-+]? [0-9]{1,3} )?',
    "json-integer": r'"-"? ( "0" | [1-9] [0-9]{0,15} )',
    "json-boolean": r'"true" | "false"',
    "json-null": r'"null"',
    "json-value": (
        "json-object | json-array | json-string | json-number | json-boolean | json-null"
    ),
    "json-object": (r'"{" ws ( json-member ( "," ws json-member )* )? "}"'),
    "json-member": r'json-string ws ":" ws json-value ws',
    "json-array": r'"[" ws ( json-value ws ( "," ws json-value ws )* )? "]"',
}

#: Any JSON object: the grammar of ``response_format={"type": "json_object"}``.
JSON_OBJECT_GRAMMAR = "root ::= json-object\n" + "".join(
    f"{name} ::= {body}\n" for name, body in _PRIMITIVES.items()
)


def _literal(value: Any) -> str:
    """A GBNF string literal matching ``value`` serialized as JSON (a const or enum value)."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, RecursionError) as error:  # NaN, a set, nested too deep
        raise GrammarError(
            f"a const or enum value is not JSON ({type(error).__name__}): {reprlib.repr(value)}"
        ) from None
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


class Document(dict[str, Any]):
    """A schema embedded in a larger one that is a JSON Schema document of its own (a tool's
    parameters inside the grammar of a call): its ``#/$defs/...`` refs resolve against it,
    where they were written, not against the schema it is embedded in."""


# Nested subschemas are visited recursively: deeper than this is refused by name, long before
# Python's recursion limit (a RecursionError is not an error message).
MAX_SCHEMA_DEPTH = 64


class _Converter:
    def __init__(self, root: Mapping[str, Any]) -> None:
        self.root = root  # the document whose refs are being resolved
        self.depth = 0
        self.rules: dict[str, str] = {}
        self.refs: dict[tuple[int, str], str] = {}  # (document id, ref): its rule
        self.named: dict[tuple[str, str], str] = {}  # (base name, body): its rule
        self.next_suffix: dict[str, int] = {}
        self.size = 0
        # Each subschema object visited once per document: a Python schema can share one dict
        # in many places ({"anyOf": [s, s]} nested n deep is 2**n visits). The object is kept
        # with its rule, so its id cannot be reused by another while converting.
        self.visited: dict[tuple[int, int], tuple[Any, str]] = {}

    def add(self, hint: str, body: str) -> str:
        """The rule named after ``hint`` whose body is ``body``: an existing one, or a new one
        (``base``, ``base-2``, ...). Names and sizes are kept as they grow: finding a free name
        by trying each in turn was quadratic in the properties whose names clean up alike, and
        a grammar past MAX_GRAMMAR_BYTES is refused while it is being built, not after."""
        base = re.sub(r"[^a-zA-Z0-9-]+", "-", hint).strip("-").lower() or "rule"
        known = self.named.get((base, body))
        if known is not None:
            return known
        name, n = base, self.next_suffix.get(base, 1)
        while name in self.rules:
            n += 1
            name = f"{base}-{n}"
        self.next_suffix[base] = n
        self.size += len(name) + len(body) + 6
        if self.size > MAX_GRAMMAR_BYTES:
            raise GrammarError(
                f"the schema's grammar grows past {MAX_GRAMMAR_BYTES} bytes (at {hint!r})"
            )
        self.rules[name] = body
        self.named[(base, body)] = name
        return name

    def visit(self, schema: Any, hint: str) -> str:
        """The name of a rule matching ``schema``."""
        if self.depth >= MAX_SCHEMA_DEPTH:
            raise GrammarError(
                f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels (at {hint!r})"
            )
        outer = self.root
        if isinstance(schema, Document):
            self.root = schema
        key = (id(schema), id(self.root))
        seen = self.visited.get(key)
        if seen is not None and seen[0] is schema:
            self.root = outer
            return seen[1]
        self.depth += 1
        try:
            rule = self._visit(schema, hint)
        finally:
            self.depth -= 1
            self.root = outer
        if isinstance(schema, Mapping):
            self.visited[key] = (schema, rule)
        return rule

    def _visit(self, schema: Any, hint: str) -> str:
        if schema is True or schema == {}:
            return "json-value"
        if not isinstance(schema, Mapping):
            raise GrammarError(f"schema at {hint!r} must be an object, not {schema!r}")
        unsupported = sorted(set(schema) - _SUPPORTED)
        if unsupported:
            raise GrammarError(
                f"JSON Schema keyword {unsupported[0]!r} (at {hint}) is not supported"
            )
        schema = _draft4_bounds(schema)
        _check_keyword_types(schema, hint)
        if schema.get("nullable") is True:  # OpenAPI 3.0: the schema, or null
            plain = {k: v for k, v in schema.items() if k != "nullable"}
            return self.add(hint, f"{self.visit(plain, f'{hint}-value')} | json-null")
        if schema.get("not") in (True, {}):
            raise GrammarError(f"the schema at {hint!r} allows no value ('not' of any value)")
        if "allOf" in schema:
            return self.visit(_merge_all_of(schema, hint), hint)
        if "$ref" in schema:
            return self.ref(schema["$ref"])
        if "const" in schema:
            return self.add(hint, _literal(schema["const"]))
        if "enum" in schema:
            return self.add(hint, " | ".join(_literal(v) for v in schema["enum"]))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = [self.visit(s, f"{hint}-{i}") for i, s in enumerate(schema[key])]
                return self.add(hint, " | ".join(options))
        kind = schema.get("type")
        if isinstance(kind, list):
            options = [self.visit(_for_type(schema, k), f"{hint}-{k}") for k in kind]
            return self.add(hint, " | ".join(options))
        if kind in ("integer", "number"):
            return self.numeric(schema, hint, kind)
        bounds = _BOUNDS & set(schema)
        if bounds:
            raise GrammarError(f"JSON Schema keyword {min(bounds)!r} on {kind} is not supported")
        if kind == "object":
            return self.object(schema, hint)
        if kind == "array":
            return self.array(schema, hint)
        if kind == "string":
            return self.string(schema, hint)
        if kind in ("boolean", "null"):
            return f"json-{kind}"
        if kind is None and not ({"properties", "items", "prefixItems"} & set(schema)):
            return "json-value"
        raise GrammarError(f"unsupported schema at {hint!r}: {json.dumps(schema)[:200]}")

    def ref(self, ref: str) -> str:
        key = (id(self.root), ref)
        if key not in self.refs:
            match = re.fullmatch(r"#/(\$defs|definitions)/(.+)", ref)
            if match is None or match.group(2) not in self.root.get(match.group(1), {}):
                raise GrammarError(f"cannot resolve $ref {ref!r}")
            section, name = match.groups()
            # Registered before its body is built, so a recursive schema can refer to it.
            self.refs[key] = rule = self.add(f"ref-{name}", f"<{id(self.root)}{ref}>")
            self.rules[rule] = self.visit(self.root[section][name], f"def-{name}")
        return self.refs[key]

    def object(self, schema: Mapping[str, Any], hint: str) -> str:
        properties: Mapping[str, Any] = schema.get("properties", {})
        extra = _extra_properties(schema)
        extra_member = None
        if extra is not False:
            value = self.visit(extra, f"{hint}-extra")
            extra_member = self.add(f"{hint}-member", f'json-string ws ":" ws {value}')
        fewest, most = schema.get("minProperties", 0), schema.get("maxProperties")
        if most is not None and fewest > most:
            raise GrammarError(f"{hint}: maxProperties {most} < minProperties {fewest}")
        if not properties:  # counts enforced; beside properties they are not
            if fewest and extra_member is None:
                raise GrammarError(f"{hint}: minProperties {fewest} of an object that has none")
            if extra_member is None or most == 0:
                return self.add(hint, '"{" ws "}"')
            more = self.more_items(
                extra_member, max(fewest - 1, 0), None if most is None else most - 1
            )
            members = f"{extra_member} {more}"
            return self.add(hint, f'"{{" ws {members if fewest else f"( {members} )?"} ws "}}"')
        required = set(schema.get("required", []))
        unknown = required - set(properties)
        if unknown:
            raise GrammarError(f"{hint}: required {sorted(unknown)} are not in properties")
        if most is not None and most < len(required):
            raise GrammarError(f"{hint}: maxProperties {most} < the {len(required)} required")
        pairs = {
            key: f'{_literal(key)} ws ":" ws {self.visit(value, f"{hint}-{key}")}'
            for key, value in properties.items()
        }
        must = [pairs[k] for k in properties if k in required]
        may = [pairs[k] for k in properties if k not in required]
        tail = f' ( ws "," ws {extra_member} )*' if extra_member else ""
        if must:
            body = ' ws "," ws '.join(must) + "".join(f' ( ws "," ws {p} )?' for p in may) + tail
        else:  # the first optional key present opens the list without a comma
            _check_optional_size(may, tail, hint)
            starts = [
                p + "".join(f' ( ws "," ws {q} )?' for q in may[i + 1 :]) + tail
                for i, p in enumerate(may)
            ]
            if extra_member:
                starts.append(extra_member + tail)
            body = "( " + " | ".join(f"( {s} )" for s in starts) + " )?"
        return self.add(hint, f'"{{" ws {body} ws "}}"')

    def array(self, schema: Mapping[str, Any], hint: str) -> str:
        if "prefixItems" in schema:
            return self.tuple(schema, hint)
        item = self.visit(schema.get("items", True), f"{hint}-item")
        low, high = int(schema.get("minItems", 0)), schema.get("maxItems")
        if high is not None and int(high) < low:
            raise GrammarError(f"{hint}: maxItems {high} < minItems {low}")
        if high is not None and int(high) == 0:
            return self.add(hint, '"[" ws "]"')
        more = self.more_items(item, max(low - 1, 0), None if high is None else high - 1)
        items = f"{item} {more}"
        body = f'"[" ws {items} ws "]"' if low > 0 else f'"[" ws ( {items} )? ws "]"'
        return self.add(hint, body)

    def tuple(self, schema: Mapping[str, Any], hint: str) -> str:
        """prefixItems: these items first (all of them), then ``items`` (false: nothing), up to
        maxItems in all."""
        fixed = [self.visit(s, f"{hint}-{i}") for i, s in enumerate(schema["prefixItems"])]
        if int(schema.get("minItems", 0)) > len(fixed):
            raise GrammarError(f"{hint}: minItems beyond prefixItems is not supported")
        body = ' ws "," ws '.join(fixed)
        rest = schema.get("items", True)
        limit = schema.get("maxItems")
        if rest is not False and (limit is None or int(limit) > len(fixed)):
            most = None if limit is None else int(limit) - len(fixed)
            body += " " + self.more_items(self.visit(rest, f"{hint}-rest"), 0, most)
        return self.add(hint, f'"[" ws {body} ws "]"' if fixed else '"[" ws "]"')

    def numeric(self, schema: Mapping[str, Any], hint: str, kind: str) -> str:
        if not _BOUNDS & set(schema):
            return f"json-{kind}"
        divisor = schema.get("multipleOf")
        if divisor is not None and not float(divisor).is_integer():
            return self.decimals(schema, hint)
        whole = kind == "integer" or divisor is not None  # a whole multipleOf makes integers
        low: Bound | None = None
        high: Bound | None = None
        for keyword in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
            if keyword in schema:
                bound = decimal_bound(schema[keyword], keyword, hint, whole)
                if bound is None:  # every number of the grammar is within it
                    continue
                if keyword.lower().endswith("minimum"):
                    low = tighter(low, bound, lower=True)
                else:
                    high = tighter(high, bound, lower=False)
        # Named after the range, not the place: properties of one range share a rule.
        if divisor is not None:
            first, last = whole_range(low, high)
            return self.add(f"{kind}-multiples", multiples(int(divisor), first, last, self.add,
                                                           hint))  # fmt: skip
        if low is None and high is None:
            return f"json-{kind}"
        return self.add(f"{kind}-range", bounded(low, high, fraction=not whole))

    def decimals(self, schema: Mapping[str, Any], hint: str) -> str:
        """multipleOf 0.1, 0.01, ...: numbers with at most that many decimals."""
        divisor = schema["multipleOf"]
        places = round(-math.log10(divisor)) if divisor > 0 else 0
        bounded_too = (_BOUNDS - {"multipleOf"}) & set(schema)
        if places < 1 or not math.isclose(divisor, 10.0**-places) or bounded_too:
            raise GrammarError(
                f"{hint}: multipleOf {divisor} is supported when it is a whole number, or "
                "0.1, 0.01, ... without bounds"
            )
        return self.add(hint, f'json-integer ( "." [0-9]{{1,{places}}} )?')

    def string(self, schema: Mapping[str, Any], hint: str) -> str:
        """A rule named after the string's shape, not its place: llama.cpp expands a bounded
        repetition where a rule defines it, so properties of one shape share one expansion
        (400 strings of maxLength 2000 each with its own copy: 3.2M elements, refused)."""
        low, high = schema.get("minLength"), schema.get("maxLength")
        if "pattern" in schema:  # enforced, and lengths where they can be; a format beside it not
            pattern = pattern_to_gbnf(schema["pattern"], self.add, int(low or 0),
                                      None if high is None else int(high))  # fmt: skip
            return self.add("string-pattern", f'"\\"" ( {pattern} ) "\\""')
        if schema.get("format") in FORMATS:  # other formats: a plain string, as llama-server
            body = FORMATS[schema["format"]]
            return self.add(f"string-{schema['format']}", f'"\\"" ( {body} ) "\\""')
        if low is None and high is None:
            return "json-string"
        # A rule, not a group: llama.cpp refuses a repetition past 2000 of all the rules it
        # repeats (this group's two), so a group allowed maxLength 1000 at most.
        char = self.add(
            "string-char", r'[^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} )'
        )
        fewest, most = int(low or 0), None if high is None else int(high)
        if most is not None and most < fewest:
            raise GrammarError(f"{hint}: maxLength {most} < minLength {fewest}")
        chars = repeat(self.add, char, fewest, most, char)
        return self.add(f"string-{fewest}-{'more' if most is None else most}",
                        f'"\\"" {chars} "\\""')  # fmt: skip

    def more_items(self, item: str, low: int, high: int | None) -> str:
        """``low`` to ``high`` (None: any) more of ``item``, each after a comma."""
        return repeat(self.add, f'ws "," ws {item}', low, high, f"{item}-next")


def _check_keyword_types(schema: Mapping[str, Any], hint: str) -> None:
    for keyword, value in schema.items():
        expected = _KEYWORD_TYPES.get(keyword)
        wrong = expected is not None and not isinstance(value, expected)
        if wrong or (isinstance(value, bool) and expected in ((int,), _NUMBER)):
            raise GrammarError(
                f"JSON Schema keyword {keyword!r} at {hint} has a value of the wrong type: "
                f"{json.dumps(value, default=repr)[:100]}"
            )
        if keyword == "required" and not all(isinstance(r, str) for r in value):
            raise GrammarError(f"JSON Schema 'required' at {hint} must list property names")
        if keyword in ("anyOf", "oneOf", "allOf", "enum", "type") and not value:
            raise GrammarError(f"JSON Schema {keyword!r} at {hint} is empty")
        if keyword in _COUNTS:
            _check_count(keyword, value, hint)
        if keyword == "multipleOf" and not 0 < value < math.inf:
            raise GrammarError(f"JSON Schema 'multipleOf' at {hint} must be a number above 0")


def _check_count(keyword: str, value: int, hint: str) -> None:
    if not 0 <= value <= 2**63:
        raise GrammarError(f"JSON Schema {keyword!r} at {hint} is {value}; it must be 0 to {2**63}")


def _check_optional_size(may: list[str], tail: str, hint: str) -> None:
    """Only optional properties: each may open the list, followed by any of the later ones, so
    the rule grows with the square of their number. Refused before it is built when it would
    exceed the grammar limit."""
    sizes = [len(q) + 16 for q in may]  # ' ( ws "," ws ' + q + ' )?'
    after, total = sum(sizes), 0
    for p, size in zip(may, sizes, strict=True):
        after -= size
        total += len(p) + after + len(tail) + 8
        if total > MAX_GRAMMAR_BYTES:
            raise GrammarError(
                f"{hint}: {len(may)} properties, none required, make a grammar over the limit of "
                f"{MAX_GRAMMAR_BYTES} bytes (require some, or use fewer)"
            )


def _extra_properties(schema: Mapping[str, Any]) -> Any:
    """The schema of properties beyond ``properties`` (False: none). patternProperties: any
    name (not checked against the patterns) with a value of one of their schemas."""
    properties = schema.get("properties", {})
    extra = schema.get("additionalProperties", not properties)
    patterned = list(schema.get("patternProperties", {}).values())
    if not patterned or extra is True:
        return extra
    return {"anyOf": patterned + ([] if extra is False else [extra])}


def _draft4_bounds(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    """Draft-04's boolean exclusiveMinimum/exclusiveMaximum (minimum is exclusive) in the
    numeric form of later drafts."""
    flags = {k for k in ("exclusiveMinimum", "exclusiveMaximum") if isinstance(schema.get(k), bool)}
    if not flags:
        return schema
    converted = {k: v for k, v in schema.items() if k not in flags}
    for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if schema.get(flag) is True and bound in schema:
            converted[flag] = converted.pop(bound)
    return converted


def _for_type(schema: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """One member of a type list: numeric bounds stay with the numeric types only."""
    kept = {k: v for k, v in schema.items() if kind in ("integer", "number") or k not in _BOUNDS}
    return {**kept, "type": kind}


def _merge_all_of(schema: Mapping[str, Any], hint: str) -> dict[str, Any]:
    """allOf of object schemas as one object schema (properties and required united)."""
    merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
    properties: dict[str, Any] = dict(merged.get("properties", {}))
    required: list[str] = list(merged.get("required", []))
    for part in schema["allOf"]:
        if not isinstance(part, Mapping) or set(part) - {
            "type",
            "properties",
            "required",
            *_ANNOTATIONS,
        }:
            raise GrammarError(
                f"allOf at {hint}: only object schemas with properties can be merged"
            )
        _check_keyword_types(part, f"{hint}-allOf")
        if part.get("type", "object") != "object":
            raise GrammarError(f"allOf at {hint}: only object schemas can be merged")
        for key, value in part.get("properties", {}).items():
            if key in properties and properties[key] != value:
                raise GrammarError(f"allOf at {hint}: property {key!r} is defined twice")
            properties[key] = value
        required += [r for r in part.get("required", []) if r not in required]
    return {**merged, "type": "object", "properties": properties, "required": required}


def schema_to_grammar(schema: Mapping[str, Any]) -> str:
    """A GBNF grammar (root rule ``root``) accepting exactly the JSON that ``schema`` allows."""
    converter = _Converter(schema)
    top = converter.visit(schema, "root-value")
    lines = [f"root ::= {top}"]
    lines += [f"{name} ::= {body}" for name, body in converter.rules.items()]
    lines += [f"{name} ::= {body}" for name, body in _PRIMITIVES.items()]
    return "\n".join(lines) + "\n"
