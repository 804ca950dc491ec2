"""llama.cpp's generic tool format, for a chat template that cannot present tools (a built-in
format such as chatml, Gemma's fallback, or a Jinja template that ignores ``tools``).

A system message lists the tools and shows the JSON shape of a call; a grammar makes the
answer one JSON object: ``{"tool_call": {"name": ..., "arguments": {...}}}``, or for
tool_choice "auto" also ``{"response": "..."}`` (the reply to the user, in a string). The
answer is parsed back into tool calls or content. The shapes, the instruction and the system
message follow llama.cpp's generic handler (``common_chat_params_init_generic``) and minja's
tools polyfill, with the example showing the shape the grammar asks for.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from llamacrab._chat.tool_calls import new_call, parse_tool_calls, tool_names, tool_parameters
from llamacrab._exceptions import InvalidParameterError
from llamacrab._grammar.json_schema import Document, schema_to_grammar
from llamacrab._types import ToolCall

INSTRUCTION = (
    "Respond in JSON format, either with `tool_call` (a request to call tools) or with "
    "`response` reply to the user's request"
)
_EXAMPLE = {"tool_call": {"name": "tool_name", "arguments": {"arg1": "some_value"}}}


def system_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system message that presents ``tools`` and the shape of an answer."""
    listing = json.dumps([dict(t) for t in tools], indent=2, ensure_ascii=False)
    return (
        f"{INSTRUCTION}\n\nYou can call any of the following tools to satisfy the user's "
        f"requests: {listing}\n\nExample tool call syntax:\n\n{json.dumps(_EXAMPLE, indent=2)}"
    )


def _call_schema(tools: Sequence[Mapping[str, Any]], only: str | None) -> dict[str, Any]:
    options = []
    for tool, name in zip(tools, tool_names(tools), strict=True):
        if only is not None and name != only:
            continue
        function = tool["function"]
        schema: dict[str, Any] = {
            "type": "object",
            "properties": {"name": {"type": "string", "const": name},
                           "arguments": tool_parameters(tool)},
            "required": ["name", "arguments"],
        }  # fmt: skip
        if function.get("description"):
            schema["description"] = function["description"]
        options.append(schema)
    if not options:
        raise InvalidParameterError(f"tool_choice names {only!r}, which is not among the tools")
    return options[0] if len(options) == 1 else {"anyOf": options}


def forced_tool_name(tool_choice: Mapping[str, Any]) -> str:
    """The tool a tool_choice object forces: ``{"type": "function", "function": {"name": ...}}``."""
    kind = tool_choice.get("type", "function")
    if kind != "function":  # OpenAI's allowed_tools and custom choices
        raise InvalidParameterError(f"tool_choice type {kind!r} is not supported")
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise InvalidParameterError(
            f'a tool_choice object needs {{"function": {{"name": ...}}}}, got {dict(tool_choice)!r}'
        )
    return name


def generic_grammar(
    tools: Sequence[Mapping[str, Any]],
    tool_choice: str | Mapping[str, Any],
    response_schema: Mapping[str, Any] | None = None,
) -> str:
    """The grammar of an answer: a call (of the named tool, for a named tool_choice), or for
    "auto" either a call or ``{"response": ...}`` (a string, or ``response_schema``)."""
    only = None
    if isinstance(tool_choice, Mapping):
        only = forced_tool_name(tool_choice)
    elif tool_choice not in ("auto", "required"):
        raise InvalidParameterError(f"unknown tool_choice {tool_choice!r}")
    call = {
        "type": "object",
        "properties": {"tool_call": _call_schema(tools, only)},
        "required": ["tool_call"],
    }
    if tool_choice != "auto":
        return schema_to_grammar(call)
    reply = {
        "type": "object",
        "properties": {"response": Document(response_schema or {"type": "string"})},
        "required": ["response"],
    }
    return schema_to_grammar({"anyOf": [call, reply]})


def parse_generic(text: str) -> tuple[str, list[ToolCall]]:
    """Content and tool calls of an answer in the generic format: ``{"response": ...}`` is
    content (JSON other than a string is written out, indented; a response string cut short,
    at max_tokens, is its text so far, as a stream shows it); calls are parsed as
    ``parse_tool_calls`` does. A call cut short is that call with its arguments' text so far
    (not JSON), as OpenAI and llama-server return it, once its name is whole; before, no
    content and no call. Anything else is content as it is."""
    try:
        value = json.loads(text.strip())
    except RecursionError:  # nested past Python's limit: no call, so content
        value = None
    except json.JSONDecodeError:
        opened = _OPENER.match(text)
        if opened is not None:
            return _JsonStringReader().push(text[opened.end() :]), []
        if _cut_call(text):  # the call's private JSON is not the user's text
            return "", _named_cut_call(text)
        value = None
    if (
        isinstance(value, Mapping)
        and "response" in value
        and not ({"tool_call", "tool_calls"} & value.keys())
    ):
        response = value["response"]
        content = response if isinstance(response, str) else json.dumps(response, indent=2)
        return content, []
    return parse_tool_calls(text)


_OPENER = re.compile(r'\s*\{\s*"response"\s*:\s*"')
# A call cut short whose name is whole: the name (a JSON string), and the arguments so far.
_CUT_CALL = re.compile(
    r'\s*\{\s*"tool_call"\s*:\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")'
    r'(?:\s*,\s*"arguments"\s*:\s*(.*))?',
    re.S,
)
_COMPACT_OPENER = '{"response":"'


def _named_cut_call(text: str) -> list[ToolCall]:
    """The call cut short in ``text``, once its name is whole: its arguments' text so far."""
    named = _CUT_CALL.match(text)
    try:
        name = json.loads(named.group(1)) if named is not None else None
    except json.JSONDecodeError:  # an escape the grammar did not constrain
        name = None
    if named is None or not isinstance(name, str):
        return []
    return [new_call(name, named.group(2) or "")]


_COMPACT_CALL = '{"tool_call":'


def _cut_call(text: str) -> bool:
    """Whether ``text`` is the start of a call cut short (at max_tokens, say), or of an
    answer that could still have become one (``{``)."""
    compact = re.sub(r"\s+", "", text)
    return bool(compact) and (
        compact.startswith(_COMPACT_CALL) or _COMPACT_CALL.startswith(compact)
    )


_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class _JsonStringReader:
    """Decodes the body of a JSON string as its text arrives (escapes split across pieces
    are held until whole); ``done`` once the closing quote came."""

    def __init__(self) -> None:
        self.raw = ""
        self.done = False

    def push(self, text: str) -> str:
        if self.done:
            return ""
        raw, i = self.raw + text, 0
        out: list[str] = []
        while i < len(raw):
            char = raw[i]
            if char == '"':
                self.done, self.raw = True, ""
                return "".join(out)
            if char != "\\":
                out.append(char)
                i += 1
                continue
            if i + 1 >= len(raw):
                break
            kind = raw[i + 1]
            if kind != "u":
                out.append(_ESCAPES.get(kind, kind))
                i += 2
                continue
            decoded, used = _unicode_escape(raw, i)
            if used == 0:
                break  # the escape (or its surrogate pair) is not all here yet
            out.append(decoded)
            i += used
        self.raw = raw[i:]
        return "".join(out)


def _unicode_escape(raw: str, i: int) -> tuple[str, int]:
    """The character of the ``\\uXXXX`` escape at ``i`` (a surrogate pair takes two) and the
    characters it used; 0 used when more text is needed."""
    if i + 6 > len(raw):
        return "", 0
    try:
        code = int(raw[i + 2 : i + 6], 16)
    except ValueError:
        return raw[i : i + 6], 6  # not JSON: kept as written
    if 0xD800 <= code < 0xDC00:
        if i + 12 > len(raw):
            return "", 0
        if raw[i + 6 : i + 8] == "\\u":
            try:
                low = int(raw[i + 8 : i + 12], 16)
            except ValueError:
                low = 0
            if 0xDC00 <= low < 0xE000:
                return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)), 12
        return "\ufffd", 6
    if 0xDC00 <= code < 0xE000:
        return "\ufffd", 6
    return chr(code), 6


class GenericSplitter:
    """A streamed answer in the generic format: the text of ``{"response": "..."}`` is
    emitted as it arrives; a call is held back and parsed at the end. Text that is not JSON
    (a grammar of the caller's own) is content."""

    def __init__(self) -> None:
        self.held = ""
        self.mode = "start"  # start, response, held, text
        self._reader = _JsonStringReader()

    def push(self, text: str) -> str:
        if self.mode == "response":
            return self._reader.push(text)
        if self.mode == "text":
            return text
        self.held += text
        if self.mode == "held":
            return ""
        compact = re.sub(r"\s+", "", self.held)
        if not compact:
            return ""
        if not compact.startswith("{"):
            self.mode = "text"
            text, self.held = self.held, ""
            return text
        if _COMPACT_OPENER.startswith(compact):
            return ""  # may still become {"response": "
        match = _OPENER.match(self.held)
        if match is None:
            self.mode = "held"  # a call, or other JSON: parsed at the end
            return ""
        self.mode = "response"
        return self._reader.push(self.held[match.end() :])

    def finish(self) -> tuple[str, list[ToolCall]]:
        """Content still to emit and the calls found in what was held."""
        if self.mode in ("response", "text") or not self.held:
            return "", []  # (a response cut short in an escape loses the partial escape)
        return parse_generic(self.held)
