"""LlamaGrammar: a GBNF grammar to constrain sampling, built as llama-cpp-python builds it,
and the ready grammars ``llama_cpp.llama_grammar`` offers, written with llamacrab's own."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from llamacrab import JSON_OBJECT_GRAMMAR, InvalidParameterError, schema_to_grammar
from llamacrab.compat._errors import UnsupportedParameterError

LLAMA_GRAMMAR_DEFAULT_ROOT = "root"

#: Any JSON object (llama-cpp-python's JSON_GBNF, like llama.cpp's json.gbnf, is an object).
JSON_GBNF = JSON_OBJECT_GRAMMAR
#: A JSON array of any JSON values.
JSON_ARR_GBNF = schema_to_grammar({"type": "array"})
#: A list: one or more lines, each "- " and some text.
LIST_GBNF = r"""root ::= item+
item ::= "- " [^\r\n]+ "\n"
"""


class LlamaGrammar:
    """A grammar in llama.cpp's GBNF, checked by llama.cpp when a completion uses it (an invalid
    one raises ``llamacrab.GrammarError``, a ValueError). ``from_json_schema`` converts with
    llamacrab's converter: a schema keyword it cannot enforce is refused by name, never
    loosened."""

    def __init__(
        self,
        *args: Any,
        _grammar: str,
        root: str = LLAMA_GRAMMAR_DEFAULT_ROOT,
        verbose: bool = True,  # llama-cpp-python's: nothing is printed either way
    ) -> None:
        if args:
            raise TypeError("LlamaGrammar takes keywords: use LlamaGrammar.from_string(text)")
        if not isinstance(_grammar, str) or not _grammar.strip():
            raise InvalidParameterError("a grammar needs GBNF text")
        self._grammar = _grammar
        self._root = root

    @property
    def grammar(self) -> str:
        """The GBNF text."""
        return self._grammar

    @property
    def root(self) -> str:
        return self._root

    @classmethod
    def from_string(cls, grammar: str, verbose: bool = True) -> LlamaGrammar:
        return cls(_grammar=grammar)

    @classmethod
    def from_file(cls, file: str | os.PathLike[str], verbose: bool = True) -> LlamaGrammar:
        with open(file, encoding="utf-8") as handle:
            return cls.from_string(handle.read(), verbose=verbose)

    @classmethod
    def from_json_schema(
        cls, json_schema: str | Mapping[str, Any], verbose: bool = True
    ) -> LlamaGrammar:
        """``json_schema``: JSON Schema text (as llama-cpp-python takes it) or a mapping."""
        return cls(_grammar=json_schema_to_gbnf(json_schema))

    def __repr__(self) -> str:
        lines = self._grammar.count("\n") + 1
        return f"LlamaGrammar(root={self._root!r}, {lines} lines)"


def json_schema_to_gbnf(
    schema: str | Mapping[str, Any], prop_order: Sequence[str] | None = None
) -> str:
    """GBNF text accepting the JSON that ``schema`` (JSON Schema text or a mapping) allows,
    from llamacrab's converter: a keyword it cannot enforce is refused by name. Properties
    come in the schema's order; another ``prop_order`` is refused."""
    if prop_order:
        raise UnsupportedParameterError(
            [f"prop_order={list(prop_order)!r} (properties come in the schema's order)"]
        )
    loaded = json.loads(schema) if isinstance(schema, str) else schema
    if not isinstance(loaded, Mapping):
        raise InvalidParameterError("a JSON Schema must be an object")
    return schema_to_grammar(loaded)


__all__ = [
    "JSON_ARR_GBNF",
    "JSON_GBNF",
    "LIST_GBNF",
    "LLAMA_GRAMMAR_DEFAULT_ROOT",
    "LlamaGrammar",
    "json_schema_to_gbnf",
]
