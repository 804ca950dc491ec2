"""llama.cpp backend lifetime: initialised once per process, freed after every live handle."""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from typing import Protocol

from llamacrab._exceptions import LlamaError
from llamacrab._native import logging as _logging
from llamacrab._native.fork import reset_in_child
from llamacrab_sys import lib


class _Closable(Protocol):
    def _close(self, timeout: float | None) -> bool: ...


# How long exit waits for a native call still running on another thread (a daemon thread in
# llama_decode, say) to notice its cancel flag before leaving that memory allocated.
EXIT_WAIT_SECONDS = 10.0


_lock = threading.Lock()
reset_in_child(_lock)
_initialised = False
logger = logging.getLogger("llamacrab")
# Top-level handles (models); each closes its own children before itself.
_live_roots: weakref.WeakSet[_Closable] = weakref.WeakSet()


def ensure_initialised() -> None:
    global _initialised
    with _lock:
        if not _initialised:
            # On GGML_ASSERT, ggml tries to attach a debugger for a backtrace, which can hang the
            # process instead of aborting it. (Read by ggml at abort time; the user may override.)
            os.environ.setdefault("GGML_NO_BACKTRACE", "1")
            _logging.install()
            lib.llama_backend_init()
            # weakref.finalize registers its own exit hook with the first finalizer made, and
            # once that hook has run no finalizer frees anything. Made first, it runs after ours
            # (atexit is last in, first out), so our closes at exit still free.
            weakref.finalize(ensure_initialised, _no_op)
            atexit.register(_shutdown)
            _initialised = True


def _no_op() -> None:
    pass


def register_root(handle: _Closable) -> None:
    _live_roots.add(handle)


def _shutdown() -> None:
    # atexit order between us and weakref.finalize is not ours to choose: close what is still
    # alive explicitly (children first, through each root's close), then free the backend.
    # A handle still in use after the wait is leaked, and then the backend too: the process is
    # ending, and freeing memory a running call reads would crash it.
    freed = [_close_at_exit(handle) for handle in list(_live_roots)]
    if all(freed):
        lib.llama_backend_free()


def _close_at_exit(handle: _Closable) -> bool:
    # One that cannot be closed (the exit hook runs on a thread a signal handler interrupted
    # inside a call on it) is leaked; the others are still closed.
    try:
        return handle._close(timeout=EXIT_WAIT_SECONDS)
    except LlamaError as error:
        logger.warning("a %s was left open at exit: %s", type(handle).__name__, error)
        return False
