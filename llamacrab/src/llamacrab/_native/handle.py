"""Ownership of one native pointer: freed exactly once, children before parents, never reused,
and never while a native call that uses it is in flight (cffi releases the GIL around C calls,
so another thread can be inside llama.cpp when ``close()`` runs)."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from llamacrab._exceptions import ClosedHandleError, ConcurrentUseError, ForkedHandleError
from llamacrab._native import fork as _fork
from llamacrab._native.claims import POLL_SECONDS, Claim, Claims, refuse_reentry
from llamacrab_sys import ffi, raise_callback_interrupt

# Tests observe every free through this: ``observer(kind, address)`` right after the pointer is
# freed (tests/test_handles.py). None outside tests: one global lookup per free.
free_observer: Callable[[str, int], None] | None = None


def _release(
    kind: str, free: Callable[[Any], None], pointer: Any, generation: int, *keep_alive: object
) -> None:
    # `keep_alive` is unused here: holding the parent (and any memory C points into) in the
    # finalizer's arguments keeps them alive until this object is freed, whatever the GC order.
    if generation != _fork.generation:
        return  # made before a fork(): the parent frees its own; this copy ends with the process
    free(pointer)
    if free_observer is not None:
        free_observer(kind, address(pointer))


def address(pointer: Any) -> int:
    """A pointer's address, to tell handles apart."""
    return int(ffi.cast("uintptr_t", pointer))


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
        self._generation = _fork.generation
        self._children: weakref.WeakSet[NativeHandle] = weakref.WeakSet()
        self._finalizer = weakref.finalize(
            self, _release, self.kind, free, pointer, self._generation, parent, keep_alive
        )
        # weakref's own exit hook would free every live handle at exit without waiting for the
        # calls in flight; the backend's exit hook closes the roots, which waits.
        self._finalizer.atexit = False
        # Entered as ``with self._mutex`` (the C lock: atomic), never through the Condition,
        # whose Python __enter__ a Ctrl-C can leave holding it (claims.py).
        self._mutex = threading.RLock()
        self._calls = threading.Condition(self._mutex)
        # Held while the finalizer runs from close(): weakref.finalize hands the free to the
        # first caller and returns at once to the others, so a second close() (another thread
        # closing the same parent) would go on to free the parent while the first is still
        # inside this object's free, which reads the parent (ASan: llama_free reading a freed
        # model). Waiting here makes every close() return only once the memory is freed.
        self._freeing = threading.RLock()
        self._callers = Claims()  # the native calls in flight, by thread
        self._closing = False
        if parent is not None:
            try:
                parent._adopt(self)
            except BaseException:
                self._finalizer()  # not adopted (the parent is closing): freed now, not at GC
                raise

    def _adopt(self, child: NativeHandle) -> None:
        # Under the lock close() sets _closing with: a child is either refused, or adopted
        # before close() lists the children it closes first.
        self.check_own()
        refuse_reentry(self._mutex, self.kind)
        with self._mutex:
            self.pointer  # noqa: B018 - a closed or closing parent must not gain children
            self._children.add(child)

    @property
    def pointer(self) -> Any:
        if self.closed:
            raise self._closed_error()
        return self._pointer

    @property
    def closed(self) -> bool:
        return self._closing or not self._finalizer.alive or self._foreign

    @property
    def _foreign(self) -> bool:
        """Made before this process was forked: the parent's."""
        return self._generation != _fork.generation

    def check_own(self) -> None:
        """Raise ForkedHandleError if this handle was made before this process was forked:
        before anything waits on a lock another thread of the parent may have held."""
        if self._foreign:
            raise self._closed_error()

    def _closed_error(self) -> ClosedHandleError:
        if self._foreign:
            return ForkedHandleError(
                f"this {self.kind} was made before os.fork(), in the parent process, which owns "
                "it: load the model again in this process (with multiprocessing: in each "
                "worker, or start workers with the 'spawn' method)"
            )
        return ClosedHandleError(f"this {self.kind} is closed")

    def read(self, getter: Callable[[Any], int]) -> int:
        """``getter(pointer)`` as an int: one quick native read (a size, a count), the handle
        held open meanwhile so a close on another thread waits for it."""
        with self.in_flight() as pointer:
            return int(getter(pointer))

    @contextmanager
    def in_flight(self) -> Iterator[Any]:
        """Yield the pointer for one native call; ``close()`` waits until the call returns."""
        self.check_own()
        refuse_reentry(self._mutex, self.kind)
        claim = Claim()
        try:
            with self._mutex:
                if self._closing or not self._finalizer.alive:
                    raise self._closed_error()
                self._callers.add(claim)
            yield self._pointer
        finally:
            with self._mutex:
                self._callers.discard(claim)
                self._calls.notify_all()
            raise_callback_interrupt()  # a Ctrl-C that landed in a log line during the call

    def check_closable(self) -> None:
        """Raise ConcurrentUseError, changing nothing, if this thread is inside a native call
        on this handle or one of its children (a Python sampler's callback, say): the close
        would wait for that call forever, and a refused close must leave everything usable."""
        me = threading.get_ident()
        pending: list[NativeHandle] = [self]
        while pending:
            handle = pending.pop()
            refuse_reentry(handle._mutex, handle.kind)
            with handle._mutex:  # children are adopted under it
                inside, children = me in handle._callers.threads(), list(handle._children)
            if inside:
                where = "its call" if handle is self else f"a call on its {handle.kind}"
                raise ConcurrentUseError(f"this {self.kind} cannot be closed from inside {where}")
            pending.extend(children)

    def _interrupt(self) -> None:
        """Ask a native call in flight to return early (a context sets its abort flag)."""

    def close(self) -> None:
        """Free the native object now (children first). Calling it again does nothing. A native
        call in flight on another thread is interrupted where possible and waited for."""
        self._close(timeout=None)

    def _close(self, timeout: float | None) -> bool:
        """Close; False if a call was still in flight after ``timeout`` seconds: the memory is
        then left allocated (a leak at exit is better than freeing memory in use)."""
        if self._foreign:
            # The parent's: nothing to wait for (its threads are not here), nothing to free.
            self._closing = True
            self._finalizer.detach()
            return True
        self.check_closable()
        with self._mutex:
            self._closing = True
        self._interrupt()
        closed = all([child._close(timeout) for child in list(self._children)])
        if not self._calls_ended(timeout):
            return False
        if closed:
            with self._freeing:
                self._finalizer()
        return closed

    def _calls_ended(self, timeout: float | None) -> bool:
        """Wait until no native call is in flight; False if one still is after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._mutex:
            while self._callers:
                left = POLL_SECONDS if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    return False
                self._calls.wait(min(left, POLL_SECONDS))
        return True

    def __reduce__(self) -> Any:
        # copy.copy and copy.deepcopy come here too: a copy would share the pointer.
        raise TypeError(
            f"a {self.kind} cannot be pickled or copied: it is llama.cpp's memory in this "
            "process (load the model where it is needed, or pickle a SavedState)"
        )

    def __enter__(self: _H) -> _H:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
