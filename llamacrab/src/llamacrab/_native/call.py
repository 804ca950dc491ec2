"""The one boundary to llamacrab_sys: calls through the exception-safe shims, C++ errors raised."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from llamacrab._exceptions import InvalidParameterError, LlamaError, NativeError
from llamacrab._field_types import utf8
from llamacrab_sys import ffi, lib

_local = threading.local()


def _error_slot() -> Any:
    slot = getattr(_local, "error", None)
    if slot is None:
        slot = _local.error = ffi.new("llamacrab_error *")
    return slot


def call(name: str, *args: Any) -> Any:
    """Call llama.cpp's ``name`` through its ``safe_`` shim; raise NativeError if it threw."""
    err = _error_slot()
    result = getattr(lib, "safe_" + name)(*args, err)
    if err.code != 0:
        raise _native_error(name, err)
    return result


def call_helper(name: str, *args: Any) -> Any:
    """Call llamacrab-sys's own C++ helper ``name`` (build_tools/shims.py), which reports C++
    errors in the error slot it takes last, as the ``safe_`` shims do."""
    err = _error_slot()
    result = getattr(lib, name)(*args, err)
    if err.code != 0:
        raise _native_error(name, err)
    return result


def call_each(name: str, first: Any, items: Iterable[Any]) -> None:
    """``call(name, first, item)`` for each of ``items``, its shim and error slot looked up
    once: for thousands of calls (a prompt's tokens) those lookups cost more than the calls."""
    shim, err = getattr(lib, "safe_" + name), _error_slot()
    for item in items:
        shim(first, item, err)
        if err.code != 0:
            raise _native_error(name, err)


def _native_error(name: str, err: Any) -> NativeError:
    """The C++ exception the shim of ``name`` caught, as the error slot ``err`` holds it."""
    return NativeError(name, err.code, ffi.string(err.message).decode("utf-8", "replace"))


# How the C++ exceptions thrown by llamacrab-sys's patches to llama.cpp begin
# (llamacrab-sys/build_tools/patches.py): each bounds what hostile input could make endless.
PATCH_REFUSAL = "llamacrab: "


def call_bounded(
    name: str, *args: Any, refusal: type[LlamaError], explain: Mapping[str, str] | None = None
) -> Any:
    """``call`` for an entry point patches bound: a patch's refusal becomes ``refusal`` (its
    message, then the ``explain`` value whose key it contains: entry points that several
    patches bound tell their refusals apart); any other C++ error stays a NativeError."""
    try:
        return call(name, *args)
    except NativeError as error:
        if not error.message.startswith(PATCH_REFUSAL):
            raise
        message = error.message.removeprefix(PATCH_REFUSAL)
        why = next((why for key, why in (explain or {}).items() if key in message), "")
        raise refusal(message + why) from error


def c_string(text: str, what: str) -> bytes:
    """Encode text for C: UTF-8, NUL-terminated by cffi, so an embedded NUL would truncate it."""
    if "\0" in text:
        raise InvalidParameterError(f"{what} contains a NUL character: {text!r}")
    return utf8(text, what)


def c_path(path: str | os.PathLike[str], what: str) -> bytes:
    """A file name for C as the system spells it (os.fsencode: a name that is not UTF-8, which
    Python decodes with surrogateescape, gets its own bytes back)."""
    raw = os.fsencode(path)
    if b"\0" in raw:
        raise InvalidParameterError(f"{what} contains a NUL character: {os.fspath(path)!r}")
    return raw


def read_string(fill: Any, initial: int = 256) -> str:
    """Read a string from a C function that fills a buffer and returns the full length needed."""
    size = initial
    while True:
        buf = ffi.new("char[]", size)
        needed = fill(buf, size)
        if needed < 0:
            return ""
        if needed < size:
            return bytes(ffi.buffer(buf, needed)).decode("utf-8", "replace")
        size = needed + 1


__all__ = [
    "PATCH_REFUSAL",
    "c_path",
    "c_string",
    "call",
    "call_bounded",
    "call_each",
    "call_helper",
    "ffi",
    "lib",
    "read_string",
    "utf8",
]
