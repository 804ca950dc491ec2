"""Chat: messages rendered with the model's own template (or a named built-in) and completed.

The model's GGUF template is the default: a model's format is never silently replaced by a
generic one. Gemma GGUFs without a template get the gemma format; any other model without one
needs ``chat_format``. Messages are first adapted to what the template can present
(``_chat/adapt.py``); tools a template cannot present are described in llama.cpp's generic
tool format (``_chat/generic_tools.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llamacrab._chat.adapt import adapt_messages
from llamacrab._chat.builtin import apply_builtin, builtin_names
from llamacrab._chat.caps import BUILTIN_CAPS, TemplateCaps, template_caps
from llamacrab._exceptions import InvalidParameterError, TemplateError
from llamacrab._native.model import Model

ROLES = ("system", "developer", "user", "assistant", "tool")
# What a template is given by the chat itself; chat_template_kwargs add to these.
_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools",
                       "documents")  # fmt: skip


def template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` (llama-server's: ``enable_thinking``, ``reasoning_effort``, ...)
    checked: names, none of the variables the chat itself sets."""
    checked = dict(kwargs or {})
    for name in checked:
        if not isinstance(name, str) or not name.isidentifier():
            raise InvalidParameterError(f"chat_template_kwargs: {name!r} is not a variable name")
        if name in _TEMPLATE_VARIABLES:
            raise InvalidParameterError(
                f"chat_template_kwargs: {name!r} is set by the chat itself "
                f"(these are: {', '.join(_TEMPLATE_VARIABLES)})"
            )
    return checked


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as plain dicts; content given as OpenAI text parts is joined into a string."""
    if not messages:
        raise InvalidParameterError("a chat needs at least one message")
    result = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidParameterError(f"message {i} must be an object, not {type(message)}")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidParameterError(f"message {i} has role {role!r}; expected one of {ROLES}")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type") if isinstance(part, Mapping) else type(part)
                if kind == "refusal" and role == "assistant":  # what it said, as its text
                    texts.append(str(part.get("refusal", "")))
                    continue
                if kind != "text":
                    raise InvalidParameterError(
                        f"message {i}: content part of type {kind!r} is not supported"
                    )
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        elif content is not None and not isinstance(content, str):
            raise InvalidParameterError(f"message {i}: content must be text, not {type(content)}")
        result.append({**message, "role": role, "content": content})
    return result


def chat_prompt(
    model: Model,
    messages: Sequence[Mapping[str, Any]],
    chat_format: str | None = None,
    add_generation_prompt: bool = True,
    /,
    **template_variables: Any,
) -> str:
    """The prompt text for ``messages``: ``chat_format`` may name a built-in format, a GGUF
    template variant (``tokenizer.chat_template.NAME``), or be a Jinja template itself.
    Positional-only, so that a template variable may have any of these names."""
    source = template_source(model, chat_format)
    if source is None:
        adapted = adapt_messages(
            normalize_messages(messages), BUILTIN_CAPS, template_variables.get("tools")
        )
        return apply_builtin(chat_format or "gemma", adapted, add_generation_prompt)
    vocab = model.vocab
    return render_template(
        source,
        messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=_token_text(model, vocab.bos),
        eos_token=_token_text(model, vocab.eos),
        **template_variables,
    )


def render_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    /,
    add_generation_prompt: bool = True,
    **template_variables: Any,
) -> str:
    """``messages`` rendered with the Jinja template ``source``, adapted to what it can present
    (``tools``, if given, are among ``template_variables``)."""
    from llamacrab._chat.template import render  # Jinja2 loads with the first template

    tools = template_variables.get("tools")
    # GPT-OSS templates (the <|channel|> format) know the developer role; llama.cpp keeps it.
    developer = "<|channel|>" in source
    adapted = adapt_messages(normalize_messages(messages), template_caps(source), tools, developer)
    return render(source, adapted, add_generation_prompt=add_generation_prompt,
                  **template_variables)  # fmt: skip


def assistant_prefill(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """The text of a last assistant message after other turns, which a chat answer continues
    (a "prefill", as llama-server's ``--prefill-assistant`` does by default) instead of
    closing that turn and opening a new one. None where the chat ends with another role, with
    a message of tool calls (a finished turn: there is no text to go on from), or is that
    message alone (a turn, rendered as one). llama-server refuses tool calls there, and two
    assistant messages at the end; here the last of two is continued after the other."""
    last = messages[-1] if len(messages) > 1 else None
    if not isinstance(last, Mapping) or last.get("role") != "assistant" or last.get("tool_calls"):
        return None  # (rendering names what is wrong with a message that is no mapping)
    content = last.get("content")
    if isinstance(content, list) and not all(
        isinstance(part, Mapping) and part.get("type") in ("text", "refusal") for part in content
    ):
        raise InvalidParameterError(
            "the last message is an assistant's, which is continued (a prefill): it may hold "
            "text only"
        )
    return str(normalize_messages([last])[0]["content"] or "")


def answer_prompt(
    model: Model,
    messages: Sequence[Mapping[str, Any]],
    chat_format: str | None,
    prefill: str | None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    variables: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt a chat answer is generated from; with ``prefill`` (``assistant_prefill``'s),
    the turns before the last message with the generation prompt, then that text. No chat
    template leaves a turn open, so a prefill cannot be rendered by the template itself.
    ``add_generation_prompt=False`` leaves out the opening of the answer's turn, but for a
    prefill, which continues that turn (as llama-server renders one)."""
    turns = messages if prefill is None else messages[:-1]
    opened = add_generation_prompt or prefill is not None
    return chat_prompt(model, turns, chat_format, opened, tools=tools, **(variables or {})) + (
        prefill or ""
    )


def presents_tools(source: str | None) -> bool:
    """Whether the template ``source`` (None: a built-in format) renders ``tools`` itself."""
    return source is not None and template_caps(source).tools


def template_source(model: Model, chat_format: str | None) -> str | None:
    """A Jinja source to render, or None for a built-in (chat_format, or gemma by detection)."""
    if chat_format is None:
        template = model.chat_template()
        if template is not None:
            return template
        if model.arch.startswith("gemma"):
            return None
        raise TemplateError(
            f"{model.path.name} has no chat template: pass chat_format= (one of "
            f"{', '.join(builtin_names())}, or a Jinja template)"
        )
    if chat_format.startswith("tokenizer.chat_template."):
        variant = model.chat_template(chat_format.removeprefix("tokenizer.chat_template."))
        if variant is None:
            raise TemplateError(f"{model.path.name} has no {chat_format}")
        return variant
    if "{{" in chat_format or "{%" in chat_format:
        return chat_format
    if chat_format not in builtin_names():
        raise TemplateError(f"no chat format {chat_format!r}; known: {', '.join(builtin_names())}")
    return None


def template_in_use(model: Model, chat_format: str | None) -> tuple[str, TemplateCaps] | None:
    """The template ``chat_prompt`` renders with, and what it can present: its Jinja source,
    or a built-in format's name (llama.cpp's are C++ code, not text). None where the model
    has none to chat with."""
    try:
        source = template_source(model, chat_format)
    except TemplateError:
        return None
    if source is None:
        return chat_format or "gemma", BUILTIN_CAPS
    return source, template_caps(source)


def _token_text(model: Model, token: int | None) -> str:
    return "" if token is None else model.vocab.token_to_piece(token, special=True)
