"""Holds that an exception landing anywhere cannot leak.

Python runs a signal's handler between any two bytecodes of the main thread, and a Ctrl-C's
handler raises KeyboardInterrupt there: inside ``threading.Condition.__enter__`` (Python code)
after it took the lock, or between counting a call in and the ``try`` that counts it out. A
lock or a count left so by one Ctrl-C hung every later call, close and exit. So a hold here is
a ``Claim``: an object only the frame that took it refers to, registered by weak reference. A
release the exception skipped happens anyway once that frame is gone (a dead claim holds
nothing), and the locks are entered with ``with`` on the C lock itself, which takes and
releases atomically around the block. Waits poll, so a notification the exception swallowed
costs one poll interval, not a hang.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from llamacrab._exceptions import ConcurrentUseError

# How often a wait looks again without being notified: a claim that died without a release
# (or a notification lost to an exception) is seen within this.
POLL_SECONDS = 0.05


class Claim:
    """One thread's hold, alive as long as the frame that took it refers to it."""

    __slots__ = ("__weakref__", "thread")

    def __init__(self) -> None:
        self.thread = threading.get_ident()


class Claims:
    """The live claims on one thing (its native calls in flight). Not locked: its owner's
    lock guards it."""

    def __init__(self) -> None:
        self._refs: set[weakref.ref[Claim]] = set()

    def add(self, claim: Claim) -> None:
        self._refs.add(weakref.ref(claim))

    def discard(self, claim: Claim) -> None:
        self._refs.discard(weakref.ref(claim))

    def threads(self) -> list[int]:
        live = [claim.thread for ref in list(self._refs) if (claim := ref()) is not None]
        if len(live) != len(self._refs):
            self._refs = {ref for ref in self._refs if ref() is not None}
        return live

    def __bool__(self) -> bool:
        return bool(self.threads())


class Exclusive:
    """Held by one call at a time; another call is refused at once (ConcurrentUseError), not
    made to wait."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._holder: weakref.ref[Claim] | None = None

    def holder_thread(self) -> int | None:
        holder = self._holder() if self._holder is not None else None
        return None if holder is None else holder.thread

    def locked(self) -> bool:
        """Whether a call holds it now."""
        return self.holder_thread() is not None

    @contextmanager
    def hold(self, here: str, elsewhere: str) -> Iterator[None]:
        """Hold it for the block; refused with ``here`` when this thread holds it already (a
        callback from inside the call), with ``elsewhere`` when another thread does."""
        claim = Claim()
        with self._mutex:
            holder = self.holder_thread()
            if holder is not None:
                raise ConcurrentUseError(here if holder == claim.thread else elsewhere)
            self._holder = weakref.ref(claim)
        try:
            yield
        finally:
            with self._mutex:
                if self._holder is not None and self._holder() is claim:
                    self._holder = None


class Flag:
    """A switch that is only ever turned on, read by other threads: a threading.Event without
    the lock its ``set()`` takes in Python code, where a Ctrl-C can leave it held (the next
    ``set()`` of it then waits for ever). For flags nothing waits on."""

    __slots__ = ("_on",)

    def __init__(self) -> None:
        self._on = False

    def set(self) -> None:
        self._on = True

    def is_set(self) -> bool:
        return self._on


def refuse_reentry(mutex: threading.RLock, what: str) -> None:
    """Raise ConcurrentUseError if this thread holds ``mutex`` already: a signal handler that
    interrupted this thread inside it is using the same object. Entering would deadlock (a
    Lock) or change its state under the interrupted code (an RLock)."""
    if mutex._is_owned():  # type: ignore[attr-defined]
        raise ConcurrentUseError(
            f"this {what} is in use by the code a signal handler interrupted: use it after "
            "the handler returns (or have the handler set a flag)"
        )
