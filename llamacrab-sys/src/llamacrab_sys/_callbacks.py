"""Route llama.cpp's log, progress and abort callbacks to Python callables.

The C side only ever sees three fixed trampolines (cffi ``extern "Python"``). Per-call state travels
through the ``user_data`` pointer as a cffi handle, which a ``CallbackHandle`` keeps alive: hold the
handle for as long as C may call back.
"""

from __future__ import annotations

import atexit
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llamacrab_sys._native import ffi, lib

LogHandler = Callable[[int, str], None]

_log_handler: LogHandler | None = None

_interrupts = threading.local()  # .caught: the first interrupt a callback on this thread took


def _report_callback_error(exc_type: type, exc: BaseException, tb: Any) -> None:
    if not issubclass(exc_type, Exception):  # KeyboardInterrupt, SystemExit: the caller's
        if getattr(_interrupts, "caught", None) is None:
            _interrupts.caught = exc
        return
    print("llamacrab_sys: exception in a callback from llama.cpp:", file=sys.stderr)
    traceback.print_exception(exc_type, exc, tb)


def _abort_on_interrupt(exc_type: type, exc: BaseException, tb: Any) -> bool:
    # An abort callback's default is to go on; a Ctrl-C stops the computation too.
    _report_callback_error(exc_type, exc, tb)
    return not issubclass(exc_type, Exception)


def raise_callback_interrupt() -> None:
    """Raise, once, the KeyboardInterrupt or SystemExit a callback from C took on this thread
    (a signal handler's, run while C called back into Python). Call it after a native call
    that may call back has returned; it does nothing if there is none."""
    caught = getattr(_interrupts, "caught", None)
    if caught is not None:
        _interrupts.caught = None
        raise caught


@ffi.def_extern(onerror=_report_callback_error)  # type: ignore[misc]
def llamacrab_log_callback(level: int, text: Any, user_data: Any) -> None:
    handler = _log_handler
    if handler is not None and text != ffi.NULL:
        handler(int(level), ffi.string(text).decode("utf-8", "replace"))


@ffi.def_extern(onerror=_report_callback_error)  # type: ignore[misc]
def llamacrab_progress_callback(progress: float, user_data: Any) -> bool:
    if getattr(_interrupts, "caught", None) is not None:
        return False  # interrupted in an earlier callback (a log line): stop loading
    return bool(ffi.from_handle(user_data)(float(progress)))


@ffi.def_extern(onerror=_abort_on_interrupt)  # type: ignore[misc]
def llamacrab_abort_callback(user_data: Any) -> bool:
    return bool(ffi.from_handle(user_data)())


def set_log_handler(handler: LogHandler | None) -> None:
    """Send llama.cpp and libmtmd log lines to ``handler(level, text)``; None restores stderr.

    ``level`` is a ``GGML_LOG_LEVEL_*`` value. The handler may be called from llama.cpp's threads.
    """
    global _log_handler
    _log_handler = handler
    function = ffi.NULL if handler is None else lib.llamacrab_log_callback
    lib.llama_log_set(function, ffi.NULL)
    if hasattr(lib, "mtmd_helper_log_set"):  # a user's llama.cpp may come without libmtmd
        lib.mtmd_helper_log_set(function, ffi.NULL)


def log_handler() -> LogHandler | None:
    """The handler set_log_handler installed last (None: llama.cpp prints to stderr)."""
    return _log_handler


@dataclass(frozen=True)
class CallbackHandle:
    """A C function pointer plus the ``user_data`` that routes it to a Python callable."""

    function: Any
    user_data: Any


def progress_callback(fn: Callable[[float], bool]) -> CallbackHandle:
    """For ``llama_model_params.progress_callback``: ``fn(fraction)`` returns False to cancel."""
    return CallbackHandle(lib.llamacrab_progress_callback, ffi.new_handle(fn))


def abort_callback(fn: Callable[[], bool]) -> CallbackHandle:
    """For ``llama_set_abort_callback`` and the like: ``fn()`` returns True to abort compute."""
    return CallbackHandle(lib.llamacrab_abort_callback, ffi.new_handle(fn))


@atexit.register
def _restore_default_logging() -> None:
    # C may still log while the interpreter shuts down; it must not call into a dying Python.
    if _log_handler is not None:
        set_log_handler(None)
