"""Stream: the chunks of one generation, with a ``cancel()`` that works from any thread."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Generator, Iterator
from typing import Generic, TypeVar

from llamacrab._generation import Session

_T = TypeVar("_T")
_U = TypeVar("_U")


class Stream(Iterator[_T], Generic[_T]):
    """Iterate for chunks. ``close()`` (or leaving a ``with`` block) stops the generation from
    the consuming thread; ``cancel()`` asks it to stop from any thread: the stream then ends
    with a chunk whose finish_reason is "cancelled"."""

    def __init__(self, chunks: Generator[_T, None, None], session: Session) -> None:
        self._chunks = chunks
        self.session = session

    def __iter__(self) -> Stream[_T]:
        return self

    def __next__(self) -> _T:
        return next(self._chunks)

    def close(self) -> None:
        self._chunks.close()

    def cancel(self) -> None:
        self.session.cancel()

    def __enter__(self) -> Stream[_T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def then(self, transform: Callable[[Stream[_T]], Generator[_U, None, None]]) -> Stream[_U]:
        """A stream of ``transform(self)``, cancelled together with this one."""
        return Stream(transform(self), self.session)


async def async_chunks(stream: Stream[_T]) -> AsyncGenerator[_T, None]:
    """Drive a stream from asyncio, one step per worker-thread call, so the event loop never
    waits on llama.cpp. Leaving early (or a cancelled task) cancels the generation, waits for
    the step in flight, then closes the stream."""
    done = object()
    pending: asyncio.Future[object] | None = None
    try:
        while True:
            pending = asyncio.ensure_future(asyncio.to_thread(next, stream, done))
            chunk = await asyncio.shield(pending)
            if chunk is done:
                return
            yield chunk  # type: ignore[misc]
    finally:
        stream.cancel()
        if pending is not None and not pending.done():
            await asyncio.wait([pending])  # a cancelled step ends quickly
        await asyncio.to_thread(stream.close)
