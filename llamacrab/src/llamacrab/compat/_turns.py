"""One generation at a time on a compat Llama, across threads.

llamacrab's one-slot Llama lets a new call supersede an unfinished stream. Code written for
llama-cpp-python, such as LangChain's ``batch`` (a thread per input, each streaming), calls
one Llama from several threads at once; there each call must wait for the one running rather
than cut it short. Within one thread nothing waits: a second stream started while the first is
unread supersedes it, as llamacrab does.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Turns:
    def __init__(self) -> None:
        # Re-entrant: a stream abandoned mid-way may be collected (its turn returned) while
        # this thread holds the lock.
        self._changed = threading.Condition(threading.RLock())
        self._owner: int | None = None
        self._depth = 0

    def acquire(self) -> None:
        me = threading.get_ident()
        with self._changed:
            while self._owner not in (None, me):
                self._changed.wait()
            self._owner = me
            self._depth += 1

    def release(self) -> None:
        with self._changed:
            self._depth -= 1
            if self._depth <= 0:
                self._owner, self._depth = None, 0
                self._changed.notify_all()

    @contextmanager
    def turn(self) -> Iterator[None]:
        self.acquire()
        try:
            yield
        finally:
            self.release()
