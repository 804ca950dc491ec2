"""Answers that take time: native work in a worker thread, server-sent events from a stream,
and whole completions that stop when their client goes away."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

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
    Usage,
)
from llamacrab.server import _wire as wire
from llamacrab.server._errors import ApiError, client_closed, from_llama_error, model_closed
from llamacrab.server._schemas import ErrorResponse, GenerationFields
from llamacrab.server._sse import sse_json
from llamacrab.server._state import ServerState
from llamacrab.server._stream_choices import choice_chunks

_Chunk = TypeVar("_Chunk", CompletionChunk, ChatCompletionChunk)
_Result = TypeVar("_Result", Completion, ChatCompletion)
_T = TypeVar("_T")
_DISCONNECT_POLL_SECONDS = 0.25  # how soon a client that left is noticed while nothing is sent
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
    return f"data: {sse_json(payload)}\n\n"


async def sse(
    state: ServerState,
    client: Request,
    streams: Sequence[Stream[_Chunk]],
    encode: Callable[[_Chunk], dict[str, Any] | list[dict[str, Any]]],
    include_usage: bool,
    n: int = 1,
    timings_per_token: bool = False,
) -> StreamingResponse:
    """OpenAI's chat and completion chunks as server-sent events (``encode`` makes one event
    of a chunk, or several), then ``[DONE]``: ``streams`` are the answer's choices, ``n`` to a
    prompt, each chunk naming its choice (OpenAI streams ``n`` choices so), and the usage
    event after them all counts each prompt once. llama-server's ``timings`` come on the last
    event of every chunk with ``timings_per_token``, else on each choice's last."""

    async def write(chunks: AsyncIterator[_Chunk]) -> AsyncIterator[str]:
        used_by: dict[int, Usage] = {}  # the choices' usage, by index
        last: dict[str, Any] | None = None
        try:
            async for chunk in chunks:
                encoded = encode(chunk)
                payloads = encoded if isinstance(encoded, list) else [encoded]
                used = chunk.usage if chunk.finish_reason is not None else None
                shown = chunk.usage_so_far if timings_per_token else None
                if used is not None and not include_usage:
                    shown = used
                if shown is not None and payloads:
                    payloads[-1] = {**payloads[-1], "timings": wire.timings(shown)}
                for payload in payloads:
                    yield event(payload)
                last = payloads[-1] if payloads else last
                if used is not None:
                    used_by[chunk.index] = used
            if include_usage and used_by and last is not None:
                used = wire.choices_usage([used_by[k] for k in sorted(used_by)], n)
                yield event({**last, "choices": [], "usage": wire.usage(used),
                             "timings": wire.timings(used)})  # fmt: skip
        except ApiError as error:
            yield event(error.body())
        yield "data: [DONE]\n\n"

    return await sse_events(state, client, streams, write, n)


async def sse_events(
    state: ServerState,
    client: Request,
    stream: Stream[_Chunk] | Sequence[Stream[_Chunk]],
    write: Callable[[AsyncIterator[_Chunk]], AsyncIterator[str]],
    n: int = 1,
) -> StreamingResponse:
    """Server-sent events that ``write`` makes of a stream's chunks (each API has its own event
    types), or of several streams' (the choices of one answer, ``n`` to a prompt: their chunks
    as they come, each with its choice's index). The first chunk is awaited before answering,
    so an error there (a full queue, a bad grammar, the timeout) gets its proper status; a
    client that leaves meanwhile (its request queued, or its prompt decoding) cancels the
    streams. Later, a library error or a run past the timeout reaches ``write`` as an
    ApiError raised by the chunks it iterates. Tokens are counted (each prompt's once), and
    the streams are closed (their slots freed) when the client goes away."""
    streams = [stream] if isinstance(stream, Stream) else list(stream)
    deadline = streams[0].session.deadline  # set when the streams were made, with the timeout

    def cancelled_error() -> ApiError:
        return cancelled(state, deadline is not None and time.monotonic() >= deadline)

    def cancel() -> None:
        for one in streams:
            one.cancel()

    chunks = choice_chunks(streams)
    try:
        first = await until_disconnected(client, anext(chunks), cancel)
    except LlamaError as error:
        raise from_llama_error(error) from error
    except ApiError:  # the client left
        await chunks.aclose()
        raise
    if first.finish_reason == "cancelled":  # nothing was sent yet: a status, not an event
        await chunks.aclose()
        raise cancelled_error()

    async def checked() -> AsyncIterator[_Chunk]:
        chunk: _Chunk | None = first
        while chunk is not None:
            if chunk.finish_reason == "cancelled":
                raise cancelled_error()
            if chunk.finish_reason is not None and chunk.usage is not None:
                used, prompt_counted = chunk.usage, chunk.index % n != 0
                state.metrics.tokens(0 if prompt_counted else used.prompt_tokens,
                                     used.completion_tokens,
                                     0 if prompt_counted else used.cached_tokens)  # fmt: skip
            yield chunk
            try:
                chunk = await anext(chunks, None)
            except LlamaError as error:
                raise from_llama_error(error) from error

    async def events() -> AsyncIterator[str]:
        try:
            async for text in write(checked()):
                yield text
        finally:
            with anyio.CancelScope(shield=True):  # a client that left: free its slots now
                await chunks.aclose()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})  # fmt: skip


def cancelled(state: ServerState, past_deadline: bool) -> ApiError:
    """Why a generation ended "cancelled": it ran past the timeout (504), or its model was
    closed before that (a forced unload, the server stopping: 503). A client that left gets
    no answer anyway."""
    if past_deadline:
        return ApiError(504, f"the request ran past {state.settings.timeout} s", code="timeout")
    return model_closed()


async def generate(
    state: ServerState,
    client: Request,
    body: GenerationFields,
    streams: Sequence[Callable[..., Stream[_Chunk]]],
    create: Callable[..., Completion | ChatCompletion],
    chunk_json: Callable[[_Chunk, str], dict[str, Any] | list[dict[str, Any]]],
    result_json: Callable[[Any, str], dict[str, Any]],
) -> Any:
    """A streamed (SSE) or whole answer to a completion or chat request. Streamed, each of
    ``streams`` (one to a prompt, taking ``seed=``) makes the prompt's ``n`` choices."""
    alias = state.model_name(body.model)
    if body.stream:
        include = bool(body.stream_options and body.stream_options.include_usage)
        opened = await in_thread(_choices, streams, wire.choice_seeds(body))
        return await sse(state, client, opened, lambda chunk: chunk_json(chunk, alias), include,
                         body.n, body.timings_per_token)  # fmt: skip
    return result_json(await complete(state, client, create), alias)


def _choices(
    streams: Sequence[Callable[..., Stream[_Chunk]]], seeds: Sequence[int | None]
) -> list[Stream[_Chunk]]:
    """Every prompt's choices, queued at once (parallel slots run them side by side, one
    slot in turn), with the seeds the whole answer's choices get; a failure part-way cancels
    those made."""
    opened: list[Stream[_Chunk]] = []
    try:
        for start in streams:
            opened.extend(start(seed=seed) for seed in seeds)
    except BaseException:
        for stream in opened:
            stream.cancel()
        raise
    return opened


async def complete(
    state: ServerState,
    client: Request,
    create: Callable[..., _Result],
    deadline: float | None = None,
) -> _Result:
    """A whole completion (``create`` takes ``cancel=`` and ``timeout=``): 504 past the
    request's ``deadline`` (``time.monotonic()``; None: ``--timeout`` from now), stopped early
    if the client goes away, its tokens counted whichever way it ended. A request that
    answers several prompts in turn passes one deadline to each: they share its
    ``--timeout``."""
    if deadline is None:
        deadline = time.monotonic() + state.settings.timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise cancelled(state, past_deadline=True)
    cancel = threading.Event()

    def count(result: _Result) -> None:  # computed, though its client may have left
        used = result.usage
        state.metrics.tokens(used.prompt_tokens, used.completion_tokens, used.cached_tokens)

    work = in_thread(create, cancel=cancel, timeout=left)
    result = await until_disconnected(client, work, cancel.set, count)
    count(result)
    if any(choice.finish_reason == "cancelled" for choice in result.choices):
        # The generation's deadline is ``left`` from a moment after ``deadline`` was read:
        # past it, this is past too.
        raise cancelled(state, time.monotonic() >= deadline)
    return cast(_Result, result)


async def until_disconnected(
    client: Request,
    work: Awaitable[_T],
    stop: Callable[[], None],
    left_behind: Callable[[_T], None] | None = None,
) -> _T:
    """What ``work`` gives; ``stop`` is called once if the client goes away meanwhile (or this
    wait is cancelled), and must make ``work`` end soon (a generation ends "cancelled" within
    a step, and its slot is freed). A client that went away gets ``client_closed`` (499)
    once ``work`` ended, not what it ended with; ``left_behind`` gets what it gave (its
    tokens still count)."""
    task = asyncio.ensure_future(work)
    stopped = False
    try:
        while not (await asyncio.wait([task], timeout=_DISCONNECT_POLL_SECONDS))[0]:
            if not stopped and await client.is_disconnected():
                stop()
                stopped = True
    except BaseException:  # cancelled, or the watch itself failed: nobody waits for ``work``
        if not task.done():
            stop()
            task.add_done_callback(_unread)
        raise
    if stopped:
        _unread(task)
        if left_behind is not None and not task.cancelled() and task.exception() is None:
            left_behind(task.result())
        raise client_closed()
    return task.result()


def _unread(task: asyncio.Future[Any]) -> None:
    """What ``task`` ended with is nobody's to raise (asyncio would log it as never retrieved)."""
    if not task.cancelled():
        task.exception()
