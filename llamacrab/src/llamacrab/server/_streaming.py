"""Answers that take time: native work in a worker thread, server-sent events from a stream,
and whole completions that stop when their client goes away."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import anyio
from fastapi.responses import StreamingResponse
from starlette.requests import Request

from llamacrab import Stream
from llamacrab._exceptions import LlamaError
from llamacrab._types import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
)
from llamacrab.server import _wire as wire
from llamacrab.server._errors import ApiError, from_llama_error
from llamacrab.server._schemas import ErrorResponse, GenerationFields
from llamacrab.server._state import ServerState

_Chunk = TypeVar("_Chunk", CompletionChunk, ChatCompletionChunk)
# The error answers every generating route documents in its OpenAPI entry.
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 503, 504)
}


async def in_thread(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return await asyncio.to_thread(function, *args, **kwargs)
    except LlamaError as error:
        raise from_llama_error(error) from error


def event(payload: object) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def sse(
    state: ServerState,
    stream: Stream[_Chunk],
    encode: Callable[[_Chunk], dict[str, Any]],
    include_usage: bool,
) -> StreamingResponse:
    """Server-sent events from a stream. The first chunk is awaited before answering, so an
    error there (a full queue, a bad grammar) gets its proper status."""
    chunks = aiter(stream)
    try:
        first = await anext(chunks)
    except LlamaError as error:
        raise from_llama_error(error) from error

    async def events() -> AsyncIterator[str]:
        chunk = first
        try:
            while True:
                if chunk.finish_reason == "cancelled":
                    timeout = state.settings.timeout
                    yield event(ApiError(504, f"the request ran past {timeout} s").body())
                    break
                yield event(encode(chunk))
                if chunk.finish_reason is not None:
                    if chunk.usage is not None:
                        usage = chunk.usage
                        state.metrics.tokens(usage.prompt_tokens, usage.completion_tokens)
                        if include_usage:
                            yield event({**encode(chunk), "choices": [],
                                          "usage": wire.usage(usage)})  # fmt: skip
                    break
                chunk = await anext(chunks)
        except LlamaError as error:
            yield event(from_llama_error(error).body())
        finally:
            with anyio.CancelScope(shield=True):  # a client that left: free its slot now
                await chunks.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})  # fmt: skip


async def generate(
    state: ServerState,
    client: Request,
    body: GenerationFields,
    stream: Callable[[], Stream[_Chunk]],
    create: Callable[..., Completion | ChatCompletion],
    chunk_json: Callable[[_Chunk, str], dict[str, Any]],
    result_json: Callable[[Any, str], dict[str, Any]],
) -> Any:
    """A streamed (SSE) or whole answer to a completion or chat request."""
    alias = state.settings.alias
    if body.stream:
        include = bool(body.stream_options and body.stream_options.include_usage)
        chunks = await in_thread(stream)
        return await sse(state, chunks, lambda chunk: chunk_json(chunk, alias), include)
    result = await until_disconnected(client, create)
    if any(choice.finish_reason == "cancelled" for choice in result.choices):
        raise ApiError(504, f"the request ran past {state.settings.timeout} s", code="timeout")
    state.metrics.tokens(result.usage.prompt_tokens, result.usage.completion_tokens)
    return result_json(result, alias)


async def until_disconnected(
    client: Request, create: Callable[..., Completion | ChatCompletion]
) -> Completion | ChatCompletion:
    """A whole completion, stopped early (and its slot freed) if the client goes away."""
    cancel = threading.Event()
    task = asyncio.ensure_future(in_thread(create, cancel=cancel))
    while not (await asyncio.wait([task], timeout=0.25))[0]:
        if not cancel.is_set() and await client.is_disconnected():
            cancel.set()  # the generation ends "cancelled" within a step
    return task.result()  # type: ignore[no-any-return]
