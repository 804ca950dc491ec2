"""OpenAI's deprecated function calling, which its SDK still types: ``functions`` and
``function_call`` in a chat request, an assistant's ``function_call`` and ``role: "function"``
results in its messages, and ``message.function_call`` with finish_reason "function_call" in
the answer. Read as tools with one call at most, answered in the old shape."""

from __future__ import annotations

from typing import Any

from llamacrab.server._errors import ApiError


def tools_of(functions: list[dict[str, Any]], tools: object) -> list[dict[str, Any]]:
    if tools:
        raise ApiError(400, "send tools or the deprecated functions, not both", param="functions")
    return [{"type": "function", "function": function} for function in functions]


def tool_choice_of(function_call: str | dict[str, Any]) -> str | dict[str, Any]:
    """ "none" and "auto" as they are; ``{"name": ...}`` forces that function."""
    if isinstance(function_call, str):
        return function_call
    return {"type": "function", "function": {"name": function_call.get("name")}}


def messages_of(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant's ``function_call`` as a tool call, and each ``function`` message as the
    result of the call before it (the old shape pairs them by order, not by id)."""
    converted, last_id = [], None
    for i, message in enumerate(messages):
        if message.get("role") == "assistant" and message.get("function_call") is not None:
            call = message["function_call"]
            last_id = f"call_legacy_{i}"
            function = {"name": call.get("name"), "arguments": call.get("arguments", "{}")}
            message = {k: v for k, v in message.items() if k != "function_call"}
            message["tool_calls"] = [{"id": last_id, "type": "function", "function": function}]
        elif message.get("role") == "function":
            if last_id is None:
                raise ApiError(400, f"message {i}: a function result without an assistant "
                               "function_call before it", param="messages")  # fmt: skip
            message = {**message, "role": "tool", "tool_call_id": last_id}
        converted.append(message)
    return converted


def answer(shaped: dict[str, Any]) -> dict[str, Any]:
    """A chat answer's tool calls as ``function_call`` (the first; there is one at most)."""
    for choice in shaped["choices"]:
        calls = choice["message"].pop("tool_calls", None)
        if calls:
            choice["message"]["function_call"] = calls[0]["function"]
            choice["finish_reason"] = "function_call"
    return shaped


def events(shaped: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stream's events with their tool-call deltas as ``function_call`` deltas."""
    for event in shaped:
        for choice in event["choices"]:
            calls = choice["delta"].pop("tool_calls", None)
            if calls:
                choice["delta"]["function_call"] = calls[0]["function"]
            if choice["finish_reason"] == "tool_calls":
                choice["finish_reason"] = "function_call"
    return shaped
