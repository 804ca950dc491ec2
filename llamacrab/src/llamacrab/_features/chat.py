"""Chat requests: messages (with their media) through the chat template into a prompt, and
the completion keywords the chat options imply."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llamacrab._chat.media_parts import extract_media, has_media
from llamacrab._chat.options import ChatOptions
from llamacrab._chat.prompt import (
    answer_prompt,
    assistant_prefill,
    presents_tools,
    template_source,
)
from llamacrab._features.checkpoint_hints import suffix_start
from llamacrab._features.completion import check_generates
from llamacrab._features.media import MediaInput
from llamacrab._native.media import Media
from llamacrab._native.model import Model
from llamacrab._native.mtmd import Chunks
from llamacrab._types import ChatCompletion, Completion


def chat_request(
    model: Model,
    media: MediaInput,
    messages: Sequence[Mapping[str, Any]],
    chat_format: str | None,
    options: ChatOptions,
    kwargs: dict[str, Any],
) -> tuple[list[int] | Chunks, dict[str, Any]]:
    """The prompt (tokens, or chunks with media) and the completion keywords. Tools the
    template cannot present go in llama.cpp's generic format (none for tool_choice "none").
    A last assistant message is continued (``assistant_prefill``) unless the options say
    otherwise; the answer's turn is opened unless they say otherwise (``answer_prompt``)."""
    check_generates(model)  # before the template: an embedding model rarely has one
    source = template_source(model, chat_format)
    tools = options.tools
    if tools and not presents_tools(source):
        if options.parses_tools:
            options.generic_tools = True
        else:
            tools = None
    prefill = assistant_prefill(messages) if options.prefill_assistant else None
    if prefill:
        options.check_continuable()
    prompt, tokens = _prompt_and_tokens(model, media, messages, chat_format, prefill, tools,
                                        options.template_kwargs,
                                        options.add_generation_prompt)  # fmt: skip
    completion = options.completion_kwargs(kwargs, source)
    if isinstance(tokens, list) and model.needs_checkpoints:
        start = _last_content_start(model, messages, prompt, tokens)
        if start is not None:
            completion["checkpoint_at"] = (*completion.get("checkpoint_at", ()), start)
    return tokens, completion


def chat_tokens(
    model: Model,
    media: MediaInput,
    messages: Sequence[Mapping[str, Any]],
    chat_format: str | None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int] | Chunks:
    prefill = assistant_prefill(messages)
    return _prompt_and_tokens(model, media, messages, chat_format, prefill, tools)[1]


def _prompt_and_tokens(
    model: Model,
    media: MediaInput,
    messages: Sequence[Mapping[str, Any]],
    chat_format: str | None,
    prefill: str | None,
    tools: Sequence[Mapping[str, Any]] | None,
    variables: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> tuple[str, list[int] | Chunks]:
    """``prefill``: the last message's text, continued; ``variables``: checked
    chat_template_kwargs; ``add_generation_prompt``: as ``answer_prompt`` takes it."""
    items: list[Media] = []
    if has_media(messages):
        messages, items = extract_media(messages, media.projector.marker, media.policy)
    prompt = answer_prompt(model, messages, chat_format, prefill, tools, variables,
                           add_generation_prompt)  # fmt: skip
    if items:
        add_special = _adds_bos(model, prompt)
        return prompt, media.tokenize(prompt, items, add_special=add_special, parse_special=True)
    return prompt, _tokenize(model, prompt)


def _adds_bos(model: Model, prompt: str) -> bool:
    """Whether the tokenizer adds BOS: not to a template that writes it itself."""
    bos = model.vocab.bos
    return not (bos is not None and prompt.startswith(model.vocab.token_to_piece(bos, True)))


def _tokenize(model: Model, prompt: str) -> list[int]:
    return model.vocab.tokenize(prompt, add_special=_adds_bos(model, prompt), parse_special=True)


def _last_content_start(
    model: Model, messages: Sequence[Mapping[str, Any]], prompt: str, tokens: list[int]
) -> int | None:
    """How many prompt tokens precede the last message's text, where the next request of a
    conversation asking something else (after the same document, say) leaves this prompt.
    Found as text (templates insert it verbatim, perhaps stripped), then as the tokens that
    end the prompt from there; None where the tokenizer joined it to what came before."""
    last = messages[-1] if messages else None
    content = last.get("content") if last is not None else None
    if not isinstance(content, str) or not content.strip():
        return None
    return suffix_start(model.vocab, prompt, tokens, prompt.rfind(content.strip()), True)


def chat_completion(result: Completion, options: ChatOptions) -> ChatCompletion:
    """A completion of a chat prompt as a chat completion (tool calls parsed)."""
    choices = tuple(options.choice(c) for c in result.choices)
    chat_id = "chatcmpl-" + result.id.removeprefix("cmpl-")
    return ChatCompletion(chat_id, result.created, result.model, choices, result.usage)
