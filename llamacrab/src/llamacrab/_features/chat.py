"""Chat requests: messages (with their media) through the chat template into a prompt, and
the completion keywords the chat options imply."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llamacrab._chat.media_parts import extract_media, has_media
from llamacrab._chat.options import ChatOptions
from llamacrab._chat.prompt import chat_prompt, presents_tools, template_source
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
    template cannot present go in llama.cpp's generic format (none for tool_choice "none")."""
    source = template_source(model, chat_format)
    tools = options.tools
    if tools and not presents_tools(source):
        if options.parses_tools:
            options.generic_tools = True
        else:
            tools = None
    tokens = chat_tokens(model, media, messages, chat_format, tools)
    return tokens, options.completion_kwargs(kwargs, source)


def chat_tokens(
    model: Model,
    media: MediaInput,
    messages: Sequence[Mapping[str, Any]],
    chat_format: str | None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int] | Chunks:
    items: list[Media] = []
    if has_media(messages):
        messages, items = extract_media(messages, media.projector.marker, media.policy)
    prompt = chat_prompt(model, messages, chat_format, tools=tools)
    vocab = model.vocab
    bos = vocab.bos
    # A template that writes BOS itself must not get a second one from the tokenizer.
    has_bos = bos is not None and prompt.startswith(vocab.token_to_piece(bos, True))
    if items:
        return media.tokenize(prompt, items, add_special=not has_bos, parse_special=True)
    return vocab.tokenize(prompt, add_special=not has_bos, parse_special=True)


def chat_completion(result: Completion, options: ChatOptions) -> ChatCompletion:
    """A completion of a chat prompt as a chat completion (tool calls parsed)."""
    choices = tuple(options.choice(c) for c in result.choices)
    chat_id = "chatcmpl-" + result.id.removeprefix("cmpl-")
    return ChatCompletion(chat_id, result.created, result.model, choices, result.usage)
