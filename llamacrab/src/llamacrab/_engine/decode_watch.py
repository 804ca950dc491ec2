"""Aborting a long native call (a prompt's decode, an image's encode) once every generation
waiting for it stopped, without ever aborting the call after it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Protocol

from llamacrab._native.context import Context

# How often a watch looks whether its generations passed their deadlines or had their events
# set (a server's client gone), which wake nobody.
WATCH_SECONDS = 0.05


class Stoppable(Protocol):
    """A generation as a watch sees it (generation.Session)."""

    @property
    def deadline(self) -> float | None: ...

    @property
    def external(self) -> threading.Event | None: ...

    def stopped(self) -> bool: ...


class DecodeWatch:
    """Cancels ``context``'s call in flight when every one of ``sessions`` stopped, while it
    is open: the caller closes it once its calls ended, and a cancel after that (a thread that
    looked just before and ran late) would abort the next call, someone else's. ``poke()``
    decides and cancels under a lock that ``close()`` waits for, so none lands after the
    close. A cancel landing between two calls is cleared when the next one is armed:
    ``stopped`` tells that one to abort too (Context.decode's ``stopped=``)."""

    def __init__(self, context: Context, sessions: Sequence[Stoppable]) -> None:
        self.context, self.sessions = context, tuple(sessions)
        # Reentrant: a signal handler cancelling a session may interrupt a poke on its thread.
        self._lock = threading.RLock()
        self.open = True

    def stopped(self) -> bool:
        return bool(self.sessions) and all(session.stopped() for session in self.sessions)

    def poke(self) -> None:
        """Look now (from any thread)."""
        with self._lock:
            if self.open and self.stopped():
                self.context.cancel()

    def close(self) -> None:
        self.open = False  # first: a Ctrl-C in the wait below still leaves it closed
        with self._lock:  # a poke that found it open cancels first
            pass


@contextlib.contextmanager
def watched(
    context: Context, sessions: Sequence[Stoppable], poll: bool = True
) -> Iterator[DecodeWatch]:
    """A watch over the calls made in the block; ``poke()`` it when a session is cancelled.
    With ``poll``, while some session has a deadline or an event, a thread pokes it every
    WATCH_SECONDS (for calls that may take seconds: starting it costs ~0.2 ms)."""
    watch = DecodeWatch(context, sessions)

    def look() -> None:
        # Sleeps, not an Event's wait: a Ctrl-C can leave an Event's lock held (claims.py).
        while watch.open:
            time.sleep(WATCH_SECONDS)
            if watch.stopped():
                watch.poke()  # cancels nothing once the block ended
                return

    if poll and any(s.deadline is not None or s.external is not None for s in watch.sessions):
        looker = threading.Thread(target=look, name="llamacrab-decode-watch", daemon=True)
        with contextlib.suppress(RuntimeError):  # no thread to be had: the calls run their course
            looker.start()
    try:
        yield watch
    finally:
        watch.close()
