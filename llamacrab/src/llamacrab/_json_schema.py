"""JSON Schema to GBNF: grammars that make llama.cpp's sampler emit only matching JSON.

Supported: type (object, array, string, number, integer, boolean, null, or a list of them),
properties with required (in declaration order; no other keys), items with minItems/maxItems,
string minLength/maxLength, enum, const, anyOf/oneOf, and $ref into #/$defs or #/definitions.
Anything else is refused with a clear error rather than silently loosened.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from llamacrab._exceptions import GrammarError

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
    """A GBNF string literal matching ``value`` serialized as JSON."""
    text = json.dumps(value, ensure_ascii=False)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


class _Converter:
    def __init__(self, root: Mapping[str, Any]) -> None:
        self.root = root
        self.rules: dict[str, str] = {}
        self.refs: dict[str, str] = {}

    def add(self, hint: str, body: str) -> str:
        base = re.sub(r"[^a-zA-Z0-9-]+", "-", hint).strip("-").lower() or "rule"
        name, n = base, 1
        while name in self.rules and self.rules[name] != body:
            n += 1
            name = f"{base}-{n}"
        self.rules[name] = body
        return name

    def visit(self, schema: Any, hint: str) -> str:
        """The name of a rule matching ``schema``."""
        if schema is True or schema == {}:
            return "json-value"
        if not isinstance(schema, Mapping):
            raise GrammarError(f"schema at {hint!r} must be an object, not {schema!r}")
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
            options = [self.visit({**schema, "type": k}, f"{hint}-{k}") for k in kind]
            return self.add(hint, " | ".join(options))
        if kind == "object":
            return self.object(schema, hint)
        if kind == "array":
            return self.array(schema, hint)
        if kind == "string":
            return self.string(schema, hint)
        if kind in ("number", "integer", "boolean", "null"):
            return f"json-{kind}"
        if kind is None and not ({"properties", "items"} & set(schema)):
            return "json-value"
        raise GrammarError(f"unsupported schema at {hint!r}: {json.dumps(schema)[:200]}")

    def ref(self, ref: str) -> str:
        if ref not in self.refs:
            match = re.fullmatch(r"#/(\$defs|definitions)/(.+)", ref)
            if match is None or match.group(2) not in self.root.get(match.group(1), {}):
                raise GrammarError(f"cannot resolve $ref {ref!r}")
            section, key = match.groups()
            # Registered before its body is built, so a recursive schema can refer to it.
            self.refs[ref] = name = self.add(f"ref-{key}", f"<{ref}>")
            self.rules[name] = self.visit(self.root[section][key], f"def-{key}")
        return self.refs[ref]

    def object(self, schema: Mapping[str, Any], hint: str) -> str:
        properties: Mapping[str, Any] = schema.get("properties", {})
        if not properties:
            return "json-object"
        required = set(schema.get("required", []))
        unknown = required - set(properties)
        if unknown:
            raise GrammarError(f"{hint}: required {sorted(unknown)} are not in properties")
        pairs = {
            key: f'{_literal(key)} ws ":" ws {self.visit(value, f"{hint}-{key}")}'
            for key, value in properties.items()
        }
        must = [pairs[k] for k in properties if k in required]
        may = [pairs[k] for k in properties if k not in required]
        if must:
            body = ' ws "," ws '.join(must) + "".join(f' ( ws "," ws {p} )?' for p in may)
        else:  # the first optional key present opens the list without a comma
            starts = [
                p + "".join(f' ( ws "," ws {q} )?' for q in may[i + 1 :]) for i, p in enumerate(may)
            ]
            body = "( " + " | ".join(f"( {s} )" for s in starts) + " )?"
        return self.add(hint, f'"{{" ws {body} ws "}}"')

    def array(self, schema: Mapping[str, Any], hint: str) -> str:
        item = self.visit(schema.get("items", True), f"{hint}-item")
        low, high = int(schema.get("minItems", 0)), schema.get("maxItems")
        if high is not None and int(high) < low:
            raise GrammarError(f"{hint}: maxItems {high} < minItems {low}")
        if high is not None and int(high) == 0:
            return self.add(hint, '"[" ws "]"')
        rest_low = max(low - 1, 0)
        rest_high = "" if high is None else str(int(high) - 1)
        repeat = f'( ws "," ws {item} ){{{rest_low},{rest_high}}}'
        items = f"{item} {repeat}"
        body = f'"[" ws {items} ws "]"' if low > 0 else f'"[" ws ( {items} )? ws "]"'
        return self.add(hint, body)

    def string(self, schema: Mapping[str, Any], hint: str) -> str:
        if "pattern" in schema or "format" in schema:
            raise GrammarError(f"{hint}: string pattern/format is not supported")
        low, high = schema.get("minLength"), schema.get("maxLength")
        if low is None and high is None:
            return "json-string"
        char = r'( [^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )'
        count = f"{{{int(low or 0)},{'' if high is None else int(high)}}}"
        return self.add(hint, f'"\\"" {char}{count} "\\""')


def schema_to_grammar(schema: Mapping[str, Any]) -> str:
    """A GBNF grammar (root rule ``root``) accepting exactly the JSON that ``schema`` allows."""
    converter = _Converter(schema)
    top = converter.visit(schema, "root-value")
    lines = [f"root ::= {top}"]
    lines += [f"{name} ::= {body}" for name, body in converter.rules.items()]
    lines += [f"{name} ::= {body}" for name, body in _PRIMITIVES.items()]
    return "\n".join(lines) + "\n"
