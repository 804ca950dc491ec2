"""LlamaGrammar: a GBNF grammar to constrain sampling, built as llama-cpp-python builds it."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from llamacrab import InvalidParameterError, schema_to_grammar

LLAMA_GRAMMAR_DEFAULT_ROOT = "root"


class LlamaGrammar:
    """A grammar in llama.cpp's GBNF, checked by llama.cpp when a completion uses it (an invalid
    one raises ``llamacrab.GrammarError``, a ValueError). ``from_json_schema`` converts with
    llamacrab's converter: a schema keyword it cannot enforce is refused by name, never
    loosened."""

    def __init__(self, *args: Any, _grammar: str, root: str = LLAMA_GRAMMAR_DEFAULT_ROOT) -> None:
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
        schema = json.loads(json_schema) if isinstance(json_schema, str) else json_schema
        if not isinstance(schema, Mapping):
            raise InvalidParameterError("a JSON Schema must be an object")
        return cls(_grammar=schema_to_grammar(schema))

    def __repr__(self) -> str:
        lines = self._grammar.count("\n") + 1
        return f"LlamaGrammar(root={self._root!r}, {lines} lines)"


__all__ = ["LLAMA_GRAMMAR_DEFAULT_ROOT", "LlamaGrammar"]
