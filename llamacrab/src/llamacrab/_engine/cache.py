"""Prompt caches: saved KV states keyed by their tokens, found by longest shared prefix.

``RamCache`` keeps them in memory (LRU, bounded by bytes); ``DiskCache`` in a directory, as
files indexed in SQLite (``StateDirectory``: bounded, survives restarts, reads nothing back
as more than data). A completion whose prompt shares a prefix
with a cached state restores it and decodes only the rest. States live in namespaces: Llama
uses the fingerprint of what their memory was computed with (``Context.fingerprint``: model,
LoRA adapters and scales, rope and KV settings), so a state computed under other weights or
settings is never found.
"""

from __future__ import annotations

import abc
import logging
import os
import shutil
import sqlite3
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from llamacrab._engine.state_directory import StateDirectory
from llamacrab._exceptions import InvalidParameterError, StateError
from llamacrab._field_types import is_number
from llamacrab._native.fork import reset_in_child
from llamacrab._native.state import SavedState
from llamacrab._types import common_prefix

log = logging.getLogger("llamacrab")

# Free space a DiskCache leaves on its disk beyond a state it writes: its index and the index's
# write-ahead log grow with every entry.
DISK_RESERVE_BYTES = 16 << 20
# The longest key a DiskCache writes or reads back (the context's size bounds a real one): a
# longer row in its index is left out of lookups, whose cost it would set.
MAX_KEY_TOKENS = 1 << 20


class PromptCache(abc.ABC):
    """Where Llama keeps and finds saved prompt states."""

    def longest_prefix(
        self, tokens: Sequence[int], namespace: bytes = b""
    ) -> tuple[int, SavedState] | None:
        """The state in ``namespace`` sharing most leading tokens with ``tokens``, and how many."""
        best: tuple[int, tuple[int, ...]] | None = None
        for key in self._keys(namespace):
            shared = common_prefix(key, tokens)
            if shared and (best is None or shared > best[0]):
                best = (shared, key)
        if best is None:
            return None
        state = self._get(namespace, best[1])
        return None if state is None else (best[0], state)

    @abc.abstractmethod
    def store(self, state: SavedState, namespace: bytes = b"") -> None: ...

    def _keys(self, namespace: bytes) -> Iterable[tuple[int, ...]]:
        """The tokens of the states in ``namespace`` (what ``longest_prefix`` searches, unless
        a subclass searches otherwise)."""
        raise NotImplementedError(f"{type(self).__name__} lists no keys")

    @abc.abstractmethod
    def _get(self, namespace: bytes, tokens: tuple[int, ...]) -> SavedState | None: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...


def _check_capacity(capacity_bytes: int) -> None:
    if not is_number(capacity_bytes) or not capacity_bytes >= 1:  # NaN: nothing ever fits
        raise InvalidParameterError(f"capacity_bytes must be positive, not {capacity_bytes}")


class RamCache(PromptCache):
    """States in memory, least recently used dropped first beyond ``capacity_bytes``. They are
    kept as objects: nothing is serialized or checksummed on the way in or out."""

    def __init__(self, capacity_bytes: int = 2 << 30) -> None:
        _check_capacity(capacity_bytes)
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[tuple[bytes, tuple[int, ...]], SavedState] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        reset_in_child(self._lock)  # a forked child may use it with a model of its own

    @property
    def size_bytes(self) -> int:
        return self._size

    def store(self, state: SavedState, namespace: bytes = b"") -> None:
        size = state.size_bytes
        if size > self.capacity_bytes:
            return  # larger than the whole cache: keeping it would evict everything
        key = (namespace, state.tokens)
        with self._lock:
            old = self._entries.pop(key, None)
            self._size += size - (old.size_bytes if old else 0)
            self._entries[key] = state
            while self._size > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._size -= evicted.size_bytes

    def _keys(self, namespace: bytes) -> list[tuple[int, ...]]:
        with self._lock:
            return [tokens for space, tokens in self._entries if space == namespace]

    def _get(self, namespace: bytes, tokens: tuple[int, ...]) -> SavedState | None:
        with self._lock:
            state = self._entries.get((namespace, tokens))
            if state is not None:
                self._entries.move_to_end((namespace, tokens))
        return state

    def __len__(self) -> int:
        return len(self._entries)


class DiskCache(PromptCache):
    """States in ``directory`` (a ``StateDirectory``), least recently used evicted beyond
    ``capacity_bytes``. A corrupt entry is discarded with a warning. Only the user running
    it should be able to write the directory (SECURITY.md says what a writer can still do).

    States are written behind: ``store`` hands a state to a writer thread and returns, so the
    generation that made it (and, with parallel slots, every other one) does not wait for the
    disk; a lookup finds it at once. A state whose tokens the directory holds already is not
    written again (a repeated greedy request: tens of megabytes a time). At most MAX_PENDING
    states wait to be written (a store beyond that waits for room, or is skipped while another
    process holds the directory's index for writing). ``close()`` and the
    interpreter's exit wait for what is still being written; a write that fails is logged and
    skipped, as a failed store was before."""

    MAX_PENDING = 2

    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int = 8 << 30) -> None:
        _check_capacity(capacity_bytes)
        self.capacity_bytes = capacity_bytes
        try:
            self._files = StateDirectory(directory, capacity_bytes)
        except (OSError, ValueError, sqlite3.Error) as error:
            # Cannot be made or opened; a NUL in the path; a full disk (sqlite); no descriptors;
            # a file that is no index of ours, or a link.
            raise InvalidParameterError(
                f"{directory!r} cannot hold a prompt cache: {error}"
            ) from error
        self._short_of_room = False  # said once, until a state fits again
        self._pending: OrderedDict[tuple[bytes, bytes], SavedState] = OrderedDict()
        # Entered as ``with self._mutex`` (the C lock: atomic), never through the Condition,
        # whose Python __enter__ a Ctrl-C can leave holding it (claims.py).
        self._mutex = threading.RLock()
        self._changed = threading.Condition(self._mutex)
        reset_in_child(self._changed)
        self._writer: threading.Thread | None = None
        self._closed = False

    @property
    def size_bytes(self) -> int:
        with self._mutex:
            waiting = sum(state.size_bytes for state in self._pending.values())
        return self._files.size_bytes() + waiting

    def store(self, state: SavedState, namespace: bytes = b"") -> None:
        if len(state.tokens) > MAX_KEY_TOKENS:
            return  # a lookup would not read it back
        key = _key(namespace, state.tokens)
        with self._mutex:
            self._check_open()
            pending = key in self._pending
        if not pending and self._holds(key):
            return  # the same tokens' state: writing tens of megabytes again would add nothing
        with self._mutex:
            while (
                not self._closed
                and len(self._pending) >= self.MAX_PENDING
                and key not in self._pending
                and self._writing()
            ):
                if self._files.locked_out:  # waiting for it would stall this generation
                    log.warning("prompt cache save skipped: another process is writing its index")
                    return
                self._changed.wait(timeout=0.1)
            self._check_open()
            self._pending[key] = state
            if self._writing():
                return
            # Not a daemon: the interpreter's exit waits for the states still pending.
            self._writer = threading.Thread(
                target=self._write_pending, name="llamacrab-disk-cache", daemon=False
            )
            try:
                self._writer.start()
                return
            except RuntimeError:  # no thread to be had (a pids limit): write it here
                self._writer = None
        self._write_pending()

    def _check_open(self) -> None:
        if self._closed:
            raise StateError("this DiskCache is closed")

    def _holds(self, key: tuple[bytes, bytes]) -> bool:
        """Whether the directory has an entry for ``key`` (a failed lookup: it has not)."""
        try:
            return self._files.holds(*key)
        except Exception:  # a locked or broken database: the write will say what is wrong
            return False

    def _writing(self) -> bool:
        # A forked child inherits the attribute, not the thread: is_alive() tells.
        return self._writer is not None and self._writer.is_alive()

    def _write_pending(self) -> None:
        """Write pending states oldest first; the thread ends when none is left."""
        while True:
            with self._mutex:
                if not self._pending:
                    self._writer = None
                    self._changed.notify_all()
                    return
                key, state = next(iter(self._pending.items()))
            try:
                if self._room_for(state.size_bytes):
                    self._files.put(*key, state.blob_parts())
            except Exception:  # a full disk, a locked database: the generation stands
                log.warning("prompt cache save failed; skipped", exc_info=True)
            with self._mutex:
                if self._pending.get(key) is state:  # not stored again meanwhile
                    del self._pending[key]
                self._changed.notify_all()

    def _room_for(self, size: int) -> bool:
        """Whether the disk has room for a state of ``size`` bytes and DISK_RESERVE_BYTES more;
        when it has not, the state is skipped (said once until one fits again)."""
        try:
            free = shutil.disk_usage(self._files.directory).free
        except OSError:
            return True  # the write will say what is wrong
        if free >= size + DISK_RESERVE_BYTES:
            self._short_of_room = False
            return True
        if not self._short_of_room:
            self._short_of_room = True
            log.warning(
                "prompt cache: the disk holding %s has %.1f MiB free, too little for a "
                "%.1f MiB state and %d MiB for the cache's database; states are not saved "
                "until there is room",
                self._files.directory, free / 2**20, size / 2**20, DISK_RESERVE_BYTES >> 20,
            )  # fmt: skip
        return False

    def flush(self) -> None:
        """Wait until every stored state is on disk (or its write failed and was logged)."""
        with self._mutex:
            while self._writing():
                self._changed.wait(timeout=1.0)

    def longest_prefix(
        self, tokens: Sequence[int], namespace: bytes = b""
    ) -> tuple[int, SavedState] | None:
        """As PromptCache's, reading a bounded number of the index's rows (``nearest``), each
        compared as packed bytes, however many and however long the rows are."""
        _, packed = _key(namespace, tokens)
        with self._mutex:
            pending = [key for space, key in self._pending if space == namespace]
        best = (0, b"")
        for key in [*pending, *self._files.nearest(namespace, packed, 4 * MAX_KEY_TOKENS)]:
            best = max(best, (_shared_tokens(key, packed), key))
        if not best[0]:
            return None
        state = self._get(namespace, tuple(np.frombuffer(best[1], dtype="<i4").tolist()))
        return None if state is None else (best[0], state)

    def _get(self, namespace: bytes, tokens: tuple[int, ...]) -> SavedState | None:
        key = _key(namespace, tokens)
        with self._mutex:
            pending = self._pending.get(key)
        if pending is not None:
            return pending
        try:
            entry = self._files.open(*key)  # a file to map, not bytes read into memory
            if entry is None:
                return None
            name, file = entry
            with file:
                try:
                    state = SavedState.from_file(file)
                    if state.tokens != tokens:
                        raise StateError("it holds the state of other tokens than its key's")
                except StateError:
                    self._files.discard(*key, name)
                    raise
            return state
        except StateError as error:
            warnings.warn(f"discarding a corrupt prompt-cache entry: {error}", stacklevel=3)
            return None

    def close(self) -> None:
        """Write what is pending, then close the directory; later stores raise StateError."""
        with self._mutex:
            self._closed = True
        self.flush()
        self._files.close()

    def __len__(self) -> int:
        with self._mutex:
            pending = list(self._pending)
        return len(self._files) + sum(not self._holds(key) for key in pending)


def _key(namespace: bytes, tokens: Sequence[int]) -> tuple[bytes, bytes]:
    return namespace, np.asarray(tokens, dtype="<i4").tobytes()


def _shared_tokens(a: bytes, b: bytes) -> int:
    """How many leading tokens the packed ``a`` and ``b`` share (their shared bytes, by 4)."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.frombuffer(a, np.uint8, n) != np.frombuffer(b, np.uint8, n))
    return int(differ[0] if differ.size else n) // 4
