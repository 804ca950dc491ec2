"""Messages adapted to what a chat template can present, as llama.cpp does before rendering
(its workarounds in ``common/chat.cpp`` and minja's polyfills):

- a ``developer`` message is a ``system`` one (except for GPT-OSS templates, which know it);
- missing content is ``""`` (templates concatenate or split it);
- a template without a system role gets the system text at the head of the next message;
- a call's arguments are an object for a template that needs one, JSON text otherwise;
- a template that cannot render assistant tool calls gets them as JSON content
  (``{"tool_calls": [{"name", "arguments", "id"}], "content": ...}``), and one that cannot
  render tool results gets them as a user message ``{"tool_response": {"tool", "content",
  "tool_call_id"}}``;
- ``tools`` a template cannot present are described in the system message, in llama.cpp's
  generic tool format (``_chat/generic_tools.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from llamacrab._chat.caps import TemplateCaps
from llamacrab._chat.generic_tools import system_text
from llamacrab._exceptions import InvalidParameterError


def adapt_messages(
    messages: Sequence[Mapping[str, Any]],
    caps: TemplateCaps,
    tools: Sequence[Mapping[str, Any]] | None = None,
    developer_role: bool = False,
) -> list[dict[str, Any]]:
    """``messages`` (normalized: content text or None) as the template can take them;
    ``developer_role`` keeps developer messages as they are."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        item = dict(message)
        if item["role"] == "developer" and not developer_role:
            item["role"] = "system"
        if item.get("content") is None:
            item["content"] = ""
        if item.get("tool_calls"):
            calls = [_with_arguments(call, caps.object_arguments, i) for call in item["tool_calls"]]
            if caps.tool_calls:
                item["tool_calls"] = calls
            else:
                item = _calls_as_content(item, calls)
        elif "tool_calls" in item:
            del item["tool_calls"]  # None or []: nothing to render
        if item["role"] == "tool" and not caps.tool_responses:
            item = _response_as_user(item)
        out.append(item)
    if tools and not caps.tools:
        out = _with_system(out, system_text(tools))
    if not caps.system_role:
        out = _system_merged(out)
    return out


def _with_arguments(call: Any, as_object: bool, index: int) -> dict[str, Any]:
    """An OpenAI tool call (a copy) with its arguments as an object or as JSON text."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise InvalidParameterError(
            f"message {index}: a tool call is {{'type': 'function', 'function': {{...}}}}"
        )
    function = dict(call["function"])
    arguments = function.get("arguments")
    if as_object and isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments) if arguments.strip() else {}
        except (json.JSONDecodeError, RecursionError) as error:
            raise InvalidParameterError(
                f"message {index}: tool call arguments are not JSON Python can read ({error})"
            ) from None
    elif not as_object and arguments is not None and not isinstance(arguments, str):
        function["arguments"] = json.dumps(arguments, ensure_ascii=False)
    return {**call, "type": call.get("type", "function"), "function": function}


def _loaded(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return arguments
    return arguments


def _calls_as_content(message: dict[str, Any], calls: list[dict[str, Any]]) -> dict[str, Any]:
    shown = []
    for call in calls:
        function = call["function"]
        entry = {"name": function.get("name"), "arguments": _loaded(function.get("arguments"))}
        if call.get("id"):
            entry["id"] = call["id"]
        shown.append(entry)
    body: dict[str, Any] = {"tool_calls": shown}
    if message.get("content"):
        body["content"] = message["content"]
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": json.dumps(body, indent=2, ensure_ascii=False)}


def _response_as_user(message: dict[str, Any]) -> dict[str, Any]:
    response: dict[str, Any] = {}
    if message.get("name"):
        response["tool"] = message["name"]
    response["content"] = message.get("content", "")
    if message.get("tool_call_id"):
        response["tool_call_id"] = message["tool_call_id"]
    rest = {k: v for k, v in message.items() if k not in ("name", "tool_call_id")}
    text = json.dumps({"tool_response": response}, indent=2, ensure_ascii=False)
    return {**rest, "role": "user", "content": text}


def _with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """``text`` after the first message's if that is a system message, else a new one first."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        joined = f"{first['content']}\n\n{text}" if first["content"] else text
        return [{**first, "content": joined}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _system_merged(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A leading system message joined to the next message (dropped if it is alone)."""
    if not messages or messages[0]["role"] != "system":
        return messages
    if len(messages) == 1:
        return []
    system, following = messages[0], messages[1]
    content = f"{system['content']}\n{following['content']}"
    return [{**following, "content": content}, *messages[2:]]
