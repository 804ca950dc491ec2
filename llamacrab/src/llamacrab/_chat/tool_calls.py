"""Tool calls: finding them in a model's answer, and a grammar that forces one.

Parsers for the formats in common use, tried in order: Hermes/ChatML
``<tool_call>{...}</tool_call>``, Functionary ``<function=NAME>{...}</function>`` or
``>>>NAME\n{...}``, Mistral ``[TOOL_CALLS][{...}]``, Llama 3
``<|python_tag|>{...}`` or a bare ``{"name": ..., "parameters": ...}``, and generic JSON
(``{"tool_calls": [...]}``, llama.cpp's ``{"tool_call": {...}}``, or one call).
Tools are never executed: arguments come back as JSON text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from llamacrab._engine.stop import StopMatcher
from llamacrab._exceptions import InvalidParameterError, ToolCallError
from llamacrab._field_types import checked
from llamacrab._grammar.json_schema import Document, schema_to_grammar
from llamacrab._types import ToolCall

_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
_MISTRAL = re.compile(r"\[TOOL_CALLS\]\s*(\[.*\])", re.S)
_PYTHON_TAG = re.compile(r"<\|python_tag\|>\s*(\{.*\})", re.S)
# Functionary: v3.1 <function=NAME>{...}</function>, v3 >>>NAME\n{...}
_FUNCTIONARY = re.compile(
    r"(?:<function=([\w.-]+)>|>>>\s*([\w.-]+)\s*\n)\s*(\{.*?\})"
    r"\s*(?:</function>|$|(?=>>>|<function=))",
    re.S,
)


def _call(obj: Any) -> ToolCall | None:
    if not isinstance(obj, Mapping):
        return None
    name = obj.get("name") or (obj.get("function") or {}).get("name")
    args = obj.get("arguments", obj.get("parameters", (obj.get("function") or {}).get("arguments")))
    if not isinstance(name, str) or args is None:
        return None
    return new_call(name, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def new_call(name: str, arguments: str) -> ToolCall:
    """A call of ``name`` with ``arguments`` (their text), given an id of its own."""
    return ToolCall(name, arguments, f"call_{uuid.uuid4().hex[:24]}")


def _loads(text: str) -> Any:
    """``text`` parsed, or None: not JSON, or nested past Python's recursion limit (a model's
    output can be anything; such a call is left in the content, as any malformed one)."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


@checked
def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The answer's remaining content and the tool calls found in it (none: ``text``, [])."""
    hermes = [c for m in _HERMES.finditer(text) if (c := _call(_loads(m.group(1))))]
    if hermes:
        return _HERMES.sub("", text).strip(), hermes
    matches = list(_FUNCTIONARY.finditer(text))
    functionary = [
        c
        for m in matches
        if (c := _call({"name": m.group(1) or m.group(2), "arguments": _loads(m.group(3))}))
    ]
    if functionary:
        return text[: matches[0].start()].strip(), functionary
    for pattern in (_MISTRAL, _PYTHON_TAG):
        match = pattern.search(text)
        if match:
            found = _loads(match.group(1))
            items = found if isinstance(found, list) else [found]
            calls = [c for item in items if (c := _call(item))]
            if calls:
                return text[: match.start()].strip(), calls
    whole = _loads(text.strip())
    if isinstance(whole, Mapping) and isinstance(whole.get("tool_calls"), list):
        calls = [c for item in whole["tool_calls"] if (c := _call(item))]
        return "", calls
    if isinstance(whole, Mapping) and isinstance(whole.get("tool_call"), Mapping):
        single = _call(whole["tool_call"])  # llama.cpp's generic format
        return ("", [single]) if single else (text, [])
    single = _call(whole)
    return ("", [single]) if single else (text, [])


class ToolCallSplitter:
    """Splits a streamed answer into content to emit now and a tool call to hold back: from
    the first tool-call opener (or a ``{`` opening the answer) on, text is held and parsed
    at the end."""

    OPENERS = ("<tool_call>", "<function=", ">>>", "[TOOL_CALLS]", "<|python_tag|>")

    def __init__(self) -> None:
        self._openers = StopMatcher(self.OPENERS)
        self._emitted = False
        self.held: str | None = None

    def push(self, text: str) -> str:
        if self.held is not None:
            self.held += text
            return ""
        if not self._emitted and text.lstrip().startswith("{"):
            self.held = text
            return ""
        content = self._openers.push(text)
        if self._openers.stopped:
            self.held = self._openers.remainder
        self._emitted = self._emitted or bool(content.strip())
        return content

    def finish(self) -> tuple[str, list[ToolCall]]:
        """Content still to emit and the calls found in what was held."""
        if self.held is None:
            return self._openers.flush(), []
        content, calls = parse_tool_calls(self.held)
        return (content, calls) if calls else (self.held, [])


def tool_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    """The tools' names, checking each tool's shape and that its parameters describe an
    object (arguments are a JSON object: a call constrained to a string schema would answer
    text that no client can read as arguments)."""
    names = []
    for i, tool in enumerate(tools):
        is_function = isinstance(tool, Mapping) and tool.get("type", "function") == "function"
        function = tool.get("function") if is_function else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InvalidParameterError(
                f"tool {i} is not {{'type': 'function', 'function': {{'name': ...}}}}"
            )
        parameters = function.get("parameters")
        if parameters is not None and (
            not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object"
        ):
            raise InvalidParameterError(
                f"tool {function['name']!r}: parameters must be a JSON Schema of type "
                f"'object', not {_shown(parameters)}"
            )
        names.append(function["name"])
    return names


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


# OpenAI: omitting parameters defines a function that takes none.
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def tool_parameters(tool: Mapping[str, Any]) -> Document:
    """The schema of a (checked, see ``tool_names``) tool's arguments: always an object, and a
    document of its own (its refs resolve against it inside the grammar of a call)."""
    parameters = tool["function"].get("parameters")
    if parameters is None:
        return Document(_NO_PARAMETERS)
    return Document({**parameters, "type": "object"})


# A chat template mentioning one of these openers gets, for tool_choice "auto", a lazy grammar:
# free text until the opener appears, then only a well-formed call (as generic JSON inside).
_LAZY_WRAPPERS = {
    "<tool_call>": 'tool-call-root ::= "<tool_call>" ws root ws "</tool_call>"',
    "[TOOL_CALLS]": 'tool-call-root ::= "[TOOL_CALLS]" ws "[" ws root ( ws "," ws root )* ws "]"',
    "<|python_tag|>": 'tool-call-root ::= "<|python_tag|>" ws root',
}


def lazy_call_grammar(
    tools: Sequence[Mapping[str, Any]], template: str | None
) -> dict[str, Any] | None:
    """Sampling options for tool_choice "auto": a grammar that stays idle until the template's
    tool-call opener is generated, then forces a valid call. None when the template shows no
    opener it knows (the answer is then parsed as generated)."""
    for opener, wrapper in _LAZY_WRAPPERS.items():
        if template is not None and opener in template:
            grammar = forced_call_grammar(tools) + "\n" + wrapper
            return {"grammar": grammar, "grammar_root": "tool-call-root",
                    "grammar_trigger_words": (opener,)}  # fmt: skip
    return None


def check_arguments(calls: Sequence[ToolCall], tools: Sequence[Mapping[str, Any]]) -> None:
    """Raise ToolCallError unless each call names a tool and its arguments are JSON that
    validates against that tool's parameter schema (with the ``jsonschema`` package)."""
    try:
        import jsonschema  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        raise InvalidParameterError(
            "checking tool arguments needs the jsonschema package: pip install 'llamacrab[tools]'"
        ) from None
    schemas = {
        name: tool_parameters(tool) for tool, name in zip(tools, tool_names(tools), strict=True)
    }
    for call in calls:
        if call.name not in schemas:
            raise ToolCallError(f"the model called {call.name!r}, which is not among the tools")
        try:
            arguments = json.loads(call.arguments)
        except json.JSONDecodeError as error:
            raise ToolCallError(f"{call.name}: the arguments are not JSON ({error})") from None
        try:
            jsonschema.validate(arguments, schemas[call.name])
        except jsonschema.ValidationError as error:
            raise ToolCallError(f"{call.name}: invalid arguments: {error.message}") from None


def forced_call_grammar(tools: Sequence[Mapping[str, Any]], only: str | None = None) -> str:
    """A grammar whose every output is one call, as generic JSON {"name", "arguments"}, of
    any tool (``tool_choice="required"``) or of the tool named ``only``."""
    options = []
    for tool, name in zip(tools, tool_names(tools), strict=True):
        if only is not None and name != only:
            continue
        options.append({
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": tool_parameters(tool)},
            "required": ["name", "arguments"],
        })  # fmt: skip
    if not options:
        raise InvalidParameterError(f"tool_choice names {only!r}, which is not among the tools")
    return schema_to_grammar(options[0] if len(options) == 1 else {"anyOf": options})
