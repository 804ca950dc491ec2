"""Ownership of one native pointer: freed exactly once, children before parents, never reused."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from llamacrab._exceptions import ClosedHandleError
from llamacrab_sys import ffi


def _release(free: Callable[[Any], None], pointer: Any, *keep_alive: object) -> None:
    # `keep_alive` is unused here: holding the parent (and any memory C points into) in the
    # finalizer's arguments keeps them alive until this object is freed, whatever the GC order.
    free(pointer)


_H = TypeVar("_H", bound="NativeHandle")


class NativeHandle:
    """Base of every safe handle. ``pointer`` raises ClosedHandleError once the handle is closed."""

    kind = "handle"

    def __init__(
        self,
        pointer: Any,
        free: Callable[[Any], None],
        parent: NativeHandle | None,
        keep_alive: object = None,
    ) -> None:
        assert pointer != ffi.NULL, "callers turn NULL into a typed error before wrapping"
        self._pointer = pointer
        self._children: weakref.WeakSet[NativeHandle] = weakref.WeakSet()
        self._finalizer = weakref.finalize(self, _release, free, pointer, parent, keep_alive)
        if parent is not None:
            parent._adopt(self)

    def _adopt(self, child: NativeHandle) -> None:
        self.pointer  # noqa: B018 - a closed parent must not gain children
        self._children.add(child)

    @property
    def pointer(self) -> Any:
        if not self._finalizer.alive:
            raise ClosedHandleError(f"this {self.kind} is closed")
        return self._pointer

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Free the native object now (children first). Calling it again does nothing."""
        for child in list(self._children):
            child.close()
        self._finalizer()

    def __enter__(self: _H) -> _H:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
