"""One generation at a time on a compat Llama, across threads.

llamacrab's one-slot Llama lets a new call supersede an unfinished stream. Code written for
llama-cpp-python, such as LangChain's ``batch`` (a thread per input, each streaming), calls
one Llama from several threads at once; there each call must wait for the one running rather
than cut it short. Within one thread nothing waits: a second stream started while the first is
unread supersedes it, as llamacrab does; nor does anyone wait for a thread that has ended (a
stream it left unfinished is superseded too).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

# How often a waiting thread looks whether the owner has ended: a thread that ends holding a
# turn (its stream kept, unfinished, by someone else) never notifies.
_POLL_SECONDS = 0.05


class Turns:
    """Turns handed out per thread: ``acquire`` returns a ticket that ``release`` takes back.
    The turns of a thread that has ended are void: the next thread takes over (its new call
    supersedes the stream left unfinished), and releasing a void ticket changes nothing."""

    def __init__(self) -> None:
        # Re-entrant: a stream abandoned mid-way may be collected (its turn returned) while
        # this thread holds the lock.
        # Entered as ``with self._mutex`` (the C lock: atomic), never through the Condition,
        # whose Python __enter__ a Ctrl-C can leave holding it.
        self._mutex = threading.RLock()
        self._changed = threading.Condition(self._mutex)
        self._owner: threading.Thread | None = None
        self._held: set[object] = set()

    def acquire(self) -> object:
        me, ticket = threading.current_thread(), object()
        with self._mutex:
            while self._owner not in (None, me) and self._owner.is_alive():
                self._changed.wait(_POLL_SECONDS)
            if self._owner is not me:
                self._held.clear()  # none, or an ended thread's: void
            self._owner = me
            self._held.add(ticket)
        return ticket

    def release(self, ticket: object) -> None:
        with self._mutex:
            self._held.discard(ticket)
            if not self._held:
                self._owner = None
                self._changed.notify_all()

    @contextmanager
    def turn(self) -> Iterator[None]:
        ticket = self.acquire()
        try:
            yield
        finally:
            self.release(ticket)
