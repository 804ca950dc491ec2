"""What a process forked from one that used llama.cpp may use of it.

``fork()`` copies the memory but only the thread that called it. A native object made before
the fork is the parent's: its locks may be held by threads the child does not have, and a GPU
context does not survive the copy, so in the child it is foreign (ForkedHandleError on use, and
never freed there). And GNU OpenMP, which ggml's CPU backend computes with, keeps the parent's
idle thread pool in its state: a child's next parallel region waits for those threads forever.
A child of a process that may have started that pool computes on one thread.

fork() waits for the locks a child could otherwise inherit held by a thread it does not have:
those of ours that guard native calls (``hold_across_fork``), then ggml's process-wide mutex,
which every ``ggml_init`` takes for a moment (each graph of a decode on another thread)."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from llamacrab._native import host_limits
from llamacrab._native.host_limits import threads_within_room
from llamacrab_sys import _native as native_module

logger = logging.getLogger("llamacrab")

# Bumped in every forked child: a handle made under an older value belongs to an ancestor.
generation = 0

_lock = threading.Lock()
_compute_threads_started = False  # this process (or an ancestor) made a context or projector
_forked_after_compute = False  # an ancestor's OpenMP pool may be in this copy of libgomp
_warned = False
# Locks of objects a child inherits (a Llama's): held at fork() by a thread the child does not
# have, they would never be released; reset in the child, they let a call go on to the
# handle it uses, which raises ForkedHandleError.
_inherited_locks: weakref.WeakSet[Any] = weakref.WeakSet()
# Locks fork() waits for (a StateDirectory's: no thread of ours is inside SQLite when the child
# is made, whose copy of a mutex that thread held would never be released); held meanwhile.
_held_across_fork: weakref.WeakSet[Any] = weakref.WeakSet()
_held_now: list[Any] = []
_holding_ggml_mutex = False


def reset_in_child(*locks: Any) -> None:
    """Have a forked child start with ``locks`` (Lock, RLock or Condition) released."""
    _inherited_locks.update(locks)


_T = TypeVar("_T")


def cached_property(function: Callable[[Any], _T]) -> functools.cached_property[_T]:
    """``functools.cached_property``, which a forked child can read. Before Python 3.12 such
    a property holds one lock, shared by every instance, while it computes a value: a thread
    of the parent inside it at fork() left the child's first read of that property, on any
    object, waiting for ever (a model's metadata, as the child loaded a model of its own)."""
    prop = functools.cached_property(function)
    lock = getattr(prop, "lock", None)  # none from 3.12 on
    if lock is not None:
        reset_in_child(lock)
    return prop


def hold_across_fork(lock: Any) -> None:
    """Have fork() wait until no other thread holds ``lock`` (a Lock held for bounded times,
    never while taking another), and the child start with it released."""
    _held_across_fork.add(lock)
    reset_in_child(lock)


def abandon(thing: object) -> None:
    """Keep ``thing`` (a parent's object in a forked child) alive to the end of the process:
    neither closed nor finalized here, where it would act on the parent's state."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(thing))


reset_in_child(_lock)
# host_limits' own (it cannot import this module, which imports it).
reset_in_child(host_limits._warned_lock)


def note_compute_threads() -> None:
    """A context or projector is being made: computing with it may start OpenMP's pool."""
    global _compute_threads_started
    _compute_threads_started = True


def thread_limit(n_threads: int) -> int:
    """``n_threads``, or fewer: 1 in a forked child whose OpenMP pool is the parent's, and no
    more than this process's pids cgroups leave room for (each said once)."""
    global _warned
    n_threads = threads_within_room(n_threads)
    if not _forked_after_compute or n_threads <= 1 or not _openmp_is_gnu():
        return n_threads
    with _lock:
        warn, _warned = not _warned, True
    if warn:
        logger.warning(
            "this process was forked from one that had computed with llama.cpp: GNU OpenMP's "
            "threads do not survive fork(), so llama.cpp computes on 1 thread here instead of "
            "%d (start worker processes with multiprocessing's 'spawn' or 'forkserver' method "
            "for all of them)",
            n_threads,
        )
    return 1


@functools.cache
def _openmp_is_gnu() -> bool:
    """Whether GNU OpenMP is loaded (LLVM's libomp and the ggml thread pool are fork-safe)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            return any("libgomp" in line for line in maps)
    except OSError:  # not Linux: ggml is built without GNU OpenMP there
        return False


def _ggml_mutex_calls() -> tuple[Callable[[], int], Callable[[], None]]:
    """llamacrab-sys's try-take and give-back of ggml's mutex, called keeping the GIL."""
    library = ctypes.PyDLL(native_module.__file__)  # the loaded module, not a second copy
    try_take, give_back = (
        library.llamacrab_try_take_ggml_mutex,
        library.llamacrab_give_back_ggml_mutex,
    )
    try_take.argtypes, try_take.restype = [], ctypes.c_int
    give_back.argtypes, give_back.restype = [], None
    return try_take, give_back


def _before_fork() -> None:
    global _holding_ggml_mutex
    for lock in list(_held_across_fork):
        lock.acquire()
        _held_now.append(lock)
    # Last: a thread holding one of ours may be on its way into ggml, never the other way
    # round. Tried keeping the GIL (the shim says why); only while another thread holds it
    # do the others run, as the holder may log through Python before it gives it back.
    while (taken := _try_take_ggml_mutex()) == 0:
        time.sleep(0.0001)
    _holding_ggml_mutex = taken == 1


def _give_back_ggml_mutex_taken() -> None:
    global _holding_ggml_mutex
    if _holding_ggml_mutex:
        _holding_ggml_mutex = False
        _give_back_ggml_mutex()


def _after_fork_in_parent() -> None:
    _give_back_ggml_mutex_taken()
    while _held_now:
        _held_now.pop().release()


def _after_fork_in_child() -> None:
    global generation, _forked_after_compute, _warned
    _give_back_ggml_mutex_taken()  # the child's one thread is the one that took it
    _held_now.clear()  # (reset below, with the other inherited locks)
    generation += 1
    _warned = False  # each process says it once
    for lock in list(_inherited_locks):
        lock._at_fork_reinit()  # what threading and logging do with their own locks
    _forked_after_compute = _compute_threads_started


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    _try_take_ggml_mutex, _give_back_ggml_mutex = _ggml_mutex_calls()
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )
