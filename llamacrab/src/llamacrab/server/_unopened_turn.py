"""``add_generation_prompt: false`` on the chat routes, as llama-server reads it from the body:
the conversation rendered without the opening of the answer's turn (``/apply-template``'s
prompt), and what the model writes after it as the assistant's message. A last assistant
message that is continued opens no turn either: that chat goes the usual way. Text only:
tools, a response format and media need the chat methods' own prompt, and are refused."""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from typing import Any

from llamacrab import Stream
from llamacrab._llama import Llama
from llamacrab._types import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessage,
    Completion,
    CompletionChoice,
    CompletionChunk,
)
from llamacrab.server._errors import ApiError

# The chat methods' keywords that a plain completion does not take.
_CHAT_ONLY = ("tools", "tool_choice", "response_format", "chat_template_kwargs")


def unopened(add_generation_prompt: bool, messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a chat is answered without opening the answer's turn: asked so, and no last
    assistant message after other turns to continue (which wins, as in llama-server)."""
    if add_generation_prompt:
        return False
    last = messages[-1]
    return len(messages) < 2 or last.get("role") != "assistant" or bool(last.get("tool_calls"))


def completion_kwargs(kwargs: dict[str, Any], messages: Sequence[Mapping[str, Any]]) -> None:
    """Refuse what needs the chat methods' prompt; leave the keywords a completion takes."""
    response_format = kwargs.get("response_format") or {"type": "text"}
    if kwargs.get("tools") or response_format["type"] != "text":
        raise ApiError(400, "add_generation_prompt false answers with text alone: not with "
                       "tools or a response_format", param="add_generation_prompt")  # fmt: skip
    if any(_has_media(message.get("content")) for message in messages):
        raise ApiError(400, "add_generation_prompt false takes text messages alone, no images "
                       "or sounds", param="add_generation_prompt")  # fmt: skip
    for name in _CHAT_ONLY:
        kwargs.pop(name, None)


def _has_media(content: Any) -> bool:
    return isinstance(content, list) and any(
        not isinstance(part, Mapping) or part.get("type") not in ("text", "refusal")
        for part in content
    )


def prompt_tokens(
    llama: Llama, messages: Sequence[Mapping[str, Any]], variables: Mapping[str, Any] | None
) -> list[int]:
    """The conversation's tokens, its turns closed and none opened; BOS added unless the
    template writes it, as the chat methods tokenize theirs."""
    text = llama.chat_prompt(messages, None, None, variables, prefill_assistant=False,
                             add_generation_prompt=False)  # fmt: skip
    bos = llama.vocab.bos
    written = bos is not None and text.startswith(llama.vocab.token_to_piece(bos, True))
    return llama.tokenize(text, add_special=not written, parse_special=True)


def chat_completion(result: Completion) -> ChatCompletion:
    """A completion as the assistant's messages."""
    choices = tuple(_chat_choice(choice) for choice in result.choices)
    return ChatCompletion(result.id, result.created, result.model, choices, result.usage)


def _chat_choice(choice: CompletionChoice) -> ChatChoice:
    message = ChatMessage("assistant", choice.text)
    return ChatChoice(choice.index, message, choice.finish_reason, choice.logprobs,
                      choice.stop_sequence)  # fmt: skip


def chat_chunks(
    stream: Stream[CompletionChunk],
) -> Generator[ChatCompletionChunk, None, None]:
    """A completion's chunks as the assistant's deltas (the first carries the role)."""
    role: str | None = "assistant"
    for chunk in stream:
        yield ChatCompletionChunk(chunk.id, chunk.created, chunk.model, chunk.index,
                                  ChatDelta(role, chunk.text), chunk.finish_reason, chunk.usage,
                                  chunk.logprobs, chunk.stop_sequence)  # fmt: skip
        role = None
