"""What a llama-cpp-python chat request names that llamacrab's chat takes in other terms: its
``chat_format`` names, and the legacy function-calling messages of OpenAI's older API."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import llamacrab
from llamacrab import InvalidParameterError
from llamacrab.compat._errors import UnsupportedParameterError

# llama-cpp-python's chat format names that llamacrab spells differently.
_ALIASES = {"llama-2": "llama2-sys", "qwen": "chatml"}
# Names llama-cpp-python registers for which llamacrab has no format: refused when the Llama
# is made, not at its first chat. The functionary ones and chatml-function-calling are tool
# handlers; llamacrab calls tools with the model's own template (or chat_format=).
_WITHOUT_EQUIVALENT = frozenset(
    ("baichuan-2", "baichuan", "openbuddy", "redpajama-incite", "snoozy", "phind", "intel",
     "open-orca", "mistrallite", "pygmalion", "saiga", "functionary", "functionary-v1",
     "functionary-v2", "chatml-function-calling")
)  # fmt: skip


def native_chat_format(name: str | None) -> str | None:
    """llamacrab's chat_format for llama-cpp-python's: None for the model's own template."""
    if name is None or name == "chat_template.default":
        return None
    if name.startswith("chat_template."):  # a named template of the GGUF
        return "tokenizer." + name
    return _ALIASES.get(name, name)


def check_chat_format(name: str | None) -> None:
    """Refuse a name llamacrab has no format for (UnsupportedParameterError for one that
    llama-cpp-python knows), listing the names it has."""
    native = native_chat_format(name)
    if native is None or native.startswith("tokenizer.") or _is_template(native):
        return
    if native in llamacrab.chat_format_names():
        return
    known = sorted({*llamacrab.chat_format_names(), *_ALIASES})
    supported = (
        f"supported: {', '.join(known)}, chat_template.default or chat_template.NAME (templates "
        "in the GGUF), or a Jinja template"
    )
    if name in _WITHOUT_EQUIVALENT:
        raise UnsupportedParameterError([f"chat_format={name!r} ({supported})"])
    raise InvalidParameterError(f"no chat format {name!r}; {supported}")


def _is_template(chat_format: str) -> bool:
    return "{{" in chat_format or "{%" in chat_format  # as llamacrab tells a Jinja source


def current_messages(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """``messages`` with the legacy function calling of OpenAI's older API in today's terms,
    which llamacrab's chat takes: a ``function`` message (a result) becomes a ``tool`` message
    with the same name, and an assistant's ``function_call`` becomes its one tool call."""
    return [_current(message) for message in messages]


def _current(message: Mapping[str, Any]) -> Mapping[str, Any]:
    if not isinstance(message, Mapping):
        return message  # llamacrab's chat refuses it by position
    if message.get("role") == "function":
        return {**message, "role": "tool"}
    if "function_call" not in message:
        return message
    rest = {k: v for k, v in message.items() if k != "function_call"}
    call = message["function_call"]
    if call is None or message.get("tool_calls"):
        # Either nothing, or the first of the tool calls again: llama-cpp-python's (and
        # llamacrab.compat's) responses carry both, and a history appends them as they are.
        return rest
    return {**rest, "tool_calls": [{"type": "function", "function": call}]}
