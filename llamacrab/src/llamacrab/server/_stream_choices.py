"""Several generations streamed as the choices of one answer (OpenAI's ``n``, a legacy
completion's prompts): their chunks interleaved as they come, each naming its choice."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Sequence
from typing import TypeVar

import anyio

from llamacrab import Stream
from llamacrab._types import ChatCompletionChunk, CompletionChunk

_Chunk = TypeVar("_Chunk", CompletionChunk, ChatCompletionChunk)


async def choice_chunks(streams: Sequence[Stream[_Chunk]]) -> AsyncGenerator[_Chunk, None]:
    """The chunks of ``streams`` as they come, stream k's with index k and all with the id
    and creation time of the first chunk given; each stream is read up to its chunk with a
    finish reason. A choice's chunks wait until every choice before it has given one:
    OpenAI's SDK adds a choice to its accumulated answer where its first chunk comes. Leaving
    early (or an error) cancels every generation and waits for their worker threads (a step
    each)."""
    # What each choice's reader hands over: a chunk, its error, or None at its end.
    arrived: asyncio.Queue[tuple[int, _Chunk | Exception | None]] = asyncio.Queue()

    async def read(k: int, stream: Stream[_Chunk]) -> None:
        chunks = aiter(stream)
        try:
            async for chunk in chunks:
                arrived.put_nowait((k, chunk))
                if chunk.finish_reason is not None:
                    break
            arrived.put_nowait((k, None))
        except Exception as error:  # raised to the reader of the merged chunks
            arrived.put_nowait((k, error))
        finally:
            await chunks.aclose()

    readers = [asyncio.ensure_future(read(k, stream)) for k, stream in enumerate(streams)]
    waiting: list[list[_Chunk]] = [[] for _ in streams]  # of choices not yet in line
    in_line, running = 0, len(streams)  # choices before ``in_line`` have given a chunk
    head: tuple[str, int] | None = None
    try:
        while running:
            k, item = await arrived.get()
            if item is None:
                running -= 1
                continue
            if isinstance(item, Exception):
                raise item
            waiting[k].append(dataclasses.replace(item, index=k))
            while in_line < len(streams) and waiting[in_line]:
                in_line += 1
            for ready in waiting[:in_line]:
                for chunk in ready:
                    head = head or (chunk.id, chunk.created)
                    yield dataclasses.replace(chunk, id=head[0], created=head[1])
                ready.clear()
    finally:
        for stream in streams:
            stream.cancel()
        with anyio.CancelScope(shield=True):  # a client that left: its slots are freed now
            await asyncio.wait(readers)
