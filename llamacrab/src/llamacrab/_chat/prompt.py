"""Chat: messages rendered with the model's own template (or a named built-in) and completed.

The model's GGUF template is the default: a model's format is never silently replaced by a
generic one. Gemma GGUFs without a template get the gemma format; any other model without one
needs ``chat_format``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llamacrab._chat.builtin import apply_builtin, builtin_names
from llamacrab._exceptions import InvalidParameterError, TemplateError
from llamacrab._native.model import Model

ROLES = ("system", "user", "assistant", "tool")


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as plain dicts; content given as OpenAI text parts is joined into a string."""
    if not messages:
        raise InvalidParameterError("a chat needs at least one message")
    result = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLES:
            raise InvalidParameterError(f"message {i} has role {role!r}; expected one of {ROLES}")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text":
                    raise InvalidParameterError(
                        f"message {i}: content part of type {part.get('type')!r} is not supported"
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
    **template_variables: Any,
) -> str:
    """The prompt text for ``messages``: ``chat_format`` may name a built-in format, a GGUF
    template variant (``tokenizer.chat_template.NAME``), or be a Jinja template itself."""
    normalized = normalize_messages(messages)
    source = template_source(model, chat_format)
    if source is None:
        if template_variables.get("tools"):
            raise InvalidParameterError(
                "this built-in chat format cannot present tools: use the model's own template "
                "or a Jinja chat_format that renders `tools`"
            )
        name = chat_format or "gemma"
        return apply_builtin(name, normalized, add_generation_prompt)
    from llamacrab._chat.template import render  # Jinja2 loads with the first template

    vocab = model.vocab
    return render(
        source,
        normalized,
        add_generation_prompt=add_generation_prompt,
        bos_token=_token_text(model, vocab.bos),
        eos_token=_token_text(model, vocab.eos),
        **template_variables,
    )


def template_source(model: Model, chat_format: str | None) -> str | None:
    """A Jinja source to render, or None for a built-in (chat_format, or gemma by detection)."""
    if chat_format is None:
        template = model.chat_template()
        if template is not None:
            return template
        if model.metadata.get("general.architecture", "").startswith("gemma"):
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


def _token_text(model: Model, token: int | None) -> str:
    return "" if token is None else model.vocab.token_to_piece(token, special=True)
