"""Signal handlers held back while a native object is made, and run once it has its handle.

Python runs a signal's handler at the next bytecode of the main thread: Ctrl-C raises
KeyboardInterrupt there, and a service's SIGTERM handler often raises SystemExit. Landing
between C returning a new pointer and the handle that will free it, that exception leaks the
object (a whole model, for a Ctrl-C during its load); landing inside a callback from C, it
cannot propagate at all. ``held_signals()`` swaps the Python handlers for a recorder while
the object is made, and sends the caught signals again once it is wrapped, so their handlers
run where an exception is safe. A load's progress callback may run them earlier
(``Hold.run_caught``): a handler that raises then cancels the load instead of waiting for it.

A decode makes no callback into Python: a Ctrl-C would wait for it to return, seconds for a long
prompt on a small model, minutes on a large one. ``arm_sigint`` lets it abort the decode at
ggml's next graph node instead, where the KeyboardInterrupt is sure to follow.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from llamacrab._native.call import ffi, lib

Handler = Callable[[int, FrameType | None], Any]

# The signals programs give Python handlers (Ctrl-C, a service manager's stop, timers,
# profilers, child processes, terminal resizes): looking at every valid signal cost ~300 us
# a hold, this ~20 us. Those this platform lacks are left out.
_HOLDABLE_NAMES = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGVTALRM", "SIGPROF",
                   "SIGUSR1", "SIGUSR2", "SIGCHLD", "SIGWINCH", "SIGBREAK")  # fmt: skip
_HOLDABLE = tuple(getattr(signal, name) for name in _HOLDABLE_NAMES if hasattr(signal, name))


class Hold:
    """The handlers one ``held_signals()`` replaced, and the signals caught meanwhile."""

    def __init__(self) -> None:
        self.saved: dict[int, Handler] = {}
        self.caught: list[tuple[int, FrameType | None]] = []

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.caught.append((signum, frame))

    def install(self) -> None:
        for signum in _HOLDABLE:
            handler = signal.getsignal(signum)
            if callable(handler):  # a Python handler (SIG_DFL and SIG_IGN act in C: untouched)
                self.saved[signum] = handler
                signal.signal(signum, self._record)

    def run_caught(self) -> None:
        """Run the handlers of the signals caught so far, now (their exceptions propagate)."""
        while self.caught:
            signum, frame = self.caught.pop(0)
            self.saved[signum](signum, frame)

    def release(self) -> None:
        for signum, handler in self.saved.items():
            signal.signal(signum, handler)
        caught = {signum for signum, _ in self.caught}
        if not caught:
            return
        # Their handlers run at the next bytecode, as they would have. Sent one by one, the
        # first handler to raise would run before the next was sent, losing it; sent blocked,
        # all arrive when unblocked, and Python runs each (one that raises defers the rest to
        # its next check). Windows has no signal mask: one by one there.
        masking = hasattr(signal, "pthread_sigmask")
        before = signal.pthread_sigmask(signal.SIG_BLOCK, caught) if masking else None
        try:
            for signum in sorted(caught):
                signal.raise_signal(signum)
        finally:
            if before is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, before)


@contextmanager
def held_signals() -> Iterator[Hold | None]:
    """Hold Python's signal handlers for the block (the main thread only: handlers never run
    on another, so nothing can land there). Yields the Hold, or None off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    hold = Hold()
    try:
        hold.install()  # inside the try: a signal landing midway still gets the handlers back
        yield hold
    finally:
        hold.release()


def arm_sigint(flags: Any) -> None:
    """Have a Ctrl-C abort the native call about to start with ``flags``
    (``llamacrab_abort_flags *``), when it will raise KeyboardInterrupt right after: on the
    main thread under Python's own SIGINT handler. Another handler (a server's graceful stop,
    one that only counts) may not mean to stop the call, and other threads never see it."""
    flags.sigint_armed = int(
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        and lib.llamacrab_watch_sigint(ffi.addressof(flags, "sigint_seen")) == 1
    )
