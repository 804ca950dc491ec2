"""Stream: the chunks of one generation, with a ``cancel()`` that works from any thread."""

from __future__ import annotations

import threading
import weakref
from collections.abc import AsyncGenerator, Callable, Generator, Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Generic, TypeVar

from llamacrab._engine.generation import Session
from llamacrab._exceptions import ConcurrentUseError

if TYPE_CHECKING:
    import asyncio

_T = TypeVar("_T")
_U = TypeVar("_U")


class Stream(Iterator[_T], Generic[_T]):
    """Iterate for chunks. ``close()`` (or leaving a ``with`` block) stops the generation from
    the consuming thread; ``cancel()`` asks it to stop from any thread: the stream then ends
    with a chunk whose finish_reason is "cancelled"."""

    def __init__(self, chunks: Generator[_T, None, None], session: Session) -> None:
        self._chunks = chunks
        self.session = session
        # One reader at a time: a generator entered from two threads raises ValueError.
        self._reading = threading.Lock()
        # A stream dropped unread (never started, so its generator's cleanup never runs) must
        # not keep a queued generation going.
        weakref.finalize(self, session.cancel)

    def __iter__(self) -> Stream[_T]:
        return self

    def __next__(self) -> _T:
        with self._reader():
            return next(self._chunks)

    def close(self) -> None:
        with self._reader():
            self._chunks.close()

    @contextmanager
    def _reader(self) -> Iterator[None]:
        if not self._reading.acquire(blocking=False):
            raise ConcurrentUseError(
                "this stream is being read by another thread (cancel() stops it from any thread)"
            )
        try:
            yield
        finally:
            self._reading.release()

    def cancel(self) -> None:
        self.session.cancel()

    def __enter__(self) -> Stream[_T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __aiter__(self) -> AsyncGenerator[_T, None]:
        """Iterate from asyncio (``async for``): a worker thread drives the generation."""
        return async_chunks(self)

    def then(self, transform: Callable[[Stream[_T]], Generator[_U, None, None]]) -> Stream[_U]:
        """A stream of ``transform(self)``, cancelled together with this one."""
        return Stream(transform(self), self.session)


def _settle(worker: asyncio.Future[None]) -> None:
    if not worker.done():
        worker.set_result(None)


async def async_chunks(stream: Stream[_T]) -> AsyncGenerator[_T, None]:
    """Drive a stream from asyncio: one worker thread iterates it and hands each chunk to the
    event loop, which never waits on llama.cpp. Leaving early (or a cancelled task) cancels the
    generation and waits for the worker, which ends within a step.

    The worker is a daemon thread of its own, not the loop's executor: the interpreter joins
    executor threads at exit before any atexit hook runs, so an exit while the loop's thread
    iterated waited for the whole generation; now llamacrab's exit hook cancels it."""
    import asyncio  # loaded already under a running event loop; not for synchronous users

    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[tuple[bool, object]] = asyncio.Queue()
    worker: asyncio.Future[None] = loop.create_future()

    def hand_over(finished: bool, item: object) -> None:
        try:
            loop.call_soon_threadsafe(chunks.put_nowait, (finished, item))
        except RuntimeError:  # the loop is closed: nobody is left to read
            stream.cancel()

    def pump() -> None:
        try:
            for chunk in stream:
                hand_over(False, chunk)
            hand_over(True, None)
        except BaseException as error:  # handed to the consumer, raised there
            hand_over(True, error)
        finally:
            with suppress(RuntimeError):  # the loop is closed: nobody waits for the worker
                loop.call_soon_threadsafe(_settle, worker)

    threading.Thread(target=pump, name="llamacrab-stream", daemon=True).start()
    try:
        while True:
            finished, item = await chunks.get()
            if finished:
                if isinstance(item, BaseException):
                    raise item
                return
            yield item  # type: ignore[misc]
    finally:
        stream.cancel()
        await asyncio.wait([worker])
