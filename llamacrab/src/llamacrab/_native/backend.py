"""llama.cpp backend lifetime: initialised once per process, freed after every live handle."""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from typing import Protocol

from llamacrab._native import logging as _logging
from llamacrab_sys import lib


class _Closable(Protocol):
    def close(self) -> None: ...


_lock = threading.Lock()
_initialised = False
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
            atexit.register(_shutdown)
            _initialised = True


def register_root(handle: _Closable) -> None:
    _live_roots.add(handle)


def _shutdown() -> None:
    # atexit order between us and weakref.finalize is not ours to choose: close what is still
    # alive explicitly (children first, through each root's close), then free the backend.
    for handle in list(_live_roots):
        handle.close()
    lib.llama_backend_free()
