"""llamacrab's result objects as the dicts llama-cpp-python returns."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from llamacrab import Logprobs, ToolCall
from llamacrab.compat.llama_types import (
    ChatCompletionLogprobs,
    ChatCompletionMessageToolCall,
    ChatCompletionMessageToolCallChunk,
    ChatCompletionStreamResponseDelta,
    ChatCompletionStreamResponseDeltaEmpty,
    CompletionLogprobs,
    CompletionUsage,
    CreateChatCompletionStreamResponse,
    CreateCompletionResponse,
    FinishReason,
)


def finish_reason(reason: str | None, stopped_by_criteria: bool = False) -> FinishReason | None:
    """llamacrab's finish reason in llama-cpp-python's terms: an end-of-generation token and a
    stop string are both "stop"; so is a stopping criterion."""
    if reason is None:
        return None
    if stopped_by_criteria or reason in ("eos", "stop"):
        return "stop"
    if reason == "length":
        return "length"
    if reason == "tool_calls":
        return "tool_calls"
    return "cancelled"


def usage(prompt_tokens: int, completion_tokens: int) -> CompletionUsage:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(logprobs: Logprobs | None, offset: int) -> CompletionLogprobs | None:
    """``offset``: where the generated text starts in the text the offsets count from."""
    if logprobs is None:
        return None
    top: list[dict[str, float] | None] = []
    for token, value, alternatives in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        # The chosen token is always listed; an echoed prompt's first token has no values.
        if alternatives is None or value is None:
            top.append(None)
        else:
            top.append({**alternatives, token: value})
    return {
        "tokens": list(logprobs.tokens),
        "text_offset": [offset + o for o in logprobs.text_offset],
        "token_logprobs": list(logprobs.token_logprobs),
        "top_logprobs": top,
    }


def echo_logprobs(logprobs: Logprobs | None, first: str | None) -> CompletionLogprobs:
    """The echoed prompt's as llama-cpp-python gives them: each prompt token but a BOS, the
    first without a value. llamacrab lists every prompt token, the first without a value;
    ``first`` is the first token's text as llama-cpp-python shows it, None for a BOS (left
    out, and the token after it then shown without a value)."""
    converted = completion_logprobs(logprobs, 0) or {
        "tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []
    }  # fmt: skip
    if not converted["tokens"]:  # a prompt of one token: none was rated
        if first is not None:
            converted = {"tokens": [first], "text_offset": [0], "token_logprobs": [None],
                         "top_logprobs": [None]}  # fmt: skip
        return converted
    if first is not None:
        converted["tokens"][0] = first
        return converted
    del converted["tokens"][0], converted["text_offset"][0]
    del converted["token_logprobs"][0], converted["top_logprobs"][0]
    if converted["tokens"]:
        converted["token_logprobs"][0] = None
        converted["top_logprobs"][0] = None
    return converted


def chat_logprobs(logprobs: Logprobs | None) -> ChatCompletionLogprobs | None:
    if logprobs is None:
        return None
    return {
        "content": [
            {
                "token": token,
                "logprob": value,
                "bytes": None,
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": None}
                    for t, v in (alternatives or {}).items()
                ],
            }
            for token, value, alternatives in zip(
                logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
            )
            if value is not None  # (a chat echoes no prompt: always)
        ],
        "refusal": None,
    }


def completion_chunk(
    chunk_id: str,
    created: int,
    model: str,
    text: str,
    logprobs: CompletionLogprobs | None = None,
    finish: FinishReason | None = None,
) -> CreateCompletionResponse:
    return {
        "id": chunk_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}],
    }


def call_id(call: ToolCall, index: int) -> str:
    return call.id or f"call_{index}_{uuid.uuid4().hex[:24]}"


def tool_calls(calls: Sequence[ToolCall]) -> list[ChatCompletionMessageToolCall]:
    return [
        {
            "id": call_id(call, i),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for i, call in enumerate(calls)
    ]


def tool_call_chunks(calls: Sequence[ToolCall]) -> list[ChatCompletionMessageToolCallChunk]:
    return [
        {
            "index": i,
            "id": call_id(call, i),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for i, call in enumerate(calls)
    ]


def chat_chunk(
    chunk_id: str,
    created: int,
    model: str,
    delta: ChatCompletionStreamResponseDelta | ChatCompletionStreamResponseDeltaEmpty,
    finish: FinishReason | None = None,
    logprobs: ChatCompletionLogprobs | None = None,
) -> CreateChatCompletionStreamResponse:
    return {
        "id": chunk_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}],
    }
