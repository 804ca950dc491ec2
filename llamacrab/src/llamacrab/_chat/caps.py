"""What a chat template can present, found by rendering probe conversations (as llama.cpp and
minja do): a system role, tools, assistant tool calls (with arguments as JSON text or as
objects), tool results. Where it cannot, the messages are adapted before rendering
(``_chat/adapt.py``)."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llamacrab._exceptions import TemplateError

_USER = "llamacrab-user-needle"
_SYSTEM = "llamacrab-system-needle"
_TOOL = "llamacrab_tool_needle"
_ARGUMENT = "llamacrab_argument_needle"
_RESULT = "llamacrab-tool-result-needle"
# Mistral's templates take only nine alphanumeric characters as a call id.
_CALL_ID = "call00001"


@dataclass(frozen=True)
class TemplateCaps:
    system_role: bool = True
    tools: bool = False  # renders the request's ``tools``
    tool_calls: bool = False  # renders an assistant message's ``tool_calls``
    tool_responses: bool = False  # renders a ``tool`` message's content
    object_arguments: bool = False  # needs a call's arguments as an object, not JSON text


# llama.cpp's built-in formats take role and content only (they place a system message).
BUILTIN_CAPS = TemplateCaps()


def _probe_tools() -> list[dict[str, Any]]:
    parameters = {
        "type": "object",
        # Not the argument's needle: a listing of the tools must not look like a call.
        "properties": {"arg": {"type": "string", "description": "An argument."}},
        "required": ["arg"],
    }
    function = {"name": _TOOL, "description": "A tool.", "parameters": parameters}
    return [{"type": "function", "function": function}]


def _probe_call(arguments: Any) -> list[dict[str, Any]]:
    call = {"id": _CALL_ID, "type": "function",
            "function": {"name": _TOOL, "arguments": arguments}}  # fmt: skip
    return [
        {"role": "user", "content": _USER},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": _TOOL, "tool_call_id": _CALL_ID, "content": _RESULT},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": _USER},
    ]


class _Slow(Exception):
    """A probe ran out of time: the template will not render in time either."""


def _try(
    source: str, messages: Sequence[Mapping[str, Any]], tools: Any = None, **extra: Any
) -> str | None:
    from llamacrab._chat.template import TemplateTimeout, render  # Jinja2 loads lazily

    try:
        return render(source, messages, add_generation_prompt=False, tools=tools, **extra)
    except TemplateTimeout:
        raise _Slow from None
    except TemplateError:
        return None


@functools.lru_cache(maxsize=32)
def template_caps(source: str) -> TemplateCaps:
    """What the Jinja template ``source`` renders (each probe that fails counts as "no"; a
    template too slow to render gets the defaults, and its own rendering times out)."""
    try:
        return _probe(source)
    except _Slow:
        return TemplateCaps()


def _probe(source: str) -> TemplateCaps:
    greeting = [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _USER}]
    # A template for tool use may need tools to render at all.
    system = _try(source, greeting) or _try(source, greeting, tools=_probe_tools())
    listed = _try(source, [{"role": "user", "content": _USER}], tools=_probe_tools())
    as_object = _try(source, _probe_call({_ARGUMENT: "x"}), tools=_probe_tools())
    as_text = _try(source, _probe_call(f'{{"{_ARGUMENT}": "x"}}'), tools=_probe_tools())
    # JSON text written out as it is shows the quoted key; JSON text escaped again by tojson
    # (a template that wants objects) shows it only after a backslash.
    text_ok = as_text is not None and f'"{_ARGUMENT}"' in as_text
    object_ok = as_object is not None and _ARGUMENT in as_object
    rendered = as_text if text_ok else as_object if object_ok else None
    return TemplateCaps(
        system_role=system is not None and _SYSTEM in system,
        tools=listed is not None and _TOOL in listed,
        tool_calls=text_ok or object_ok,
        tool_responses=rendered is not None and _RESULT in rendered,
        object_arguments=object_ok and not text_ok,
    )
