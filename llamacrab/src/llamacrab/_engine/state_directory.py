"""A directory of saved-state files and the SQLite index of what each holds: DiskCache's storage.

Whoever can write the directory decides what is read back from it, so nothing read back is
trusted more than plain data: the index's rows are bytes, text and numbers, checked before
use, never unpickled or run (the ``diskcache`` package this replaces unpickled every key on
every lookup, and applied its database's settings as PRAGMAs and attributes). A state file's
name must be one this module makes (hex, no separator: nothing outside the directory), it is
opened without following a link and only if it is a regular file, and a file is removed only
under such a name. The index must hold exactly the tables this module creates (no triggers or
views of someone else's), SQLite runs with ``trusted_schema`` off, a statement is
interrupted after STATEMENT_SECONDS, and the index and its journals must not be links when the
directory is opened. What the files hold is SavedState's to check.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import secrets
import sqlite3
import stat
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from llamacrab._exceptions import InvalidParameterError, StateError
from llamacrab._native.fork import abandon, hold_across_fork, reset_in_child
from llamacrab._native.signals import held_signals

log = logging.getLogger("llamacrab")
_T = TypeVar("_T")

INDEX_NAME = "llamacrab-states.sqlite"
# What SQLite may open next to the index: none may be a link to a file elsewhere.
_INDEX_FILES = ("", "-wal", "-shm", "-journal")
_STATE_FILE = re.compile(r"[0-9a-f]{32}\.state")
_CREATE = (
    "CREATE TABLE states (namespace BLOB NOT NULL, tokens BLOB NOT NULL, file TEXT NOT NULL, "
    "size INTEGER NOT NULL, used INTEGER NOT NULL, PRIMARY KEY (namespace, tokens))",
    "CREATE INDEX states_used ON states (used)",
)
# The index as SQLite records it (type, name, table, statement), and nothing else.
_SCHEMA = {
    ("table", "states", "states", _CREATE[0]),
    ("index", "sqlite_autoindex_states_1", "states", None),
    ("index", "states_used", "states", _CREATE[1]),
}
# diskcache's index: an older llamacrab's prompt cache, never read (its keys are pickles).
_LEGACY_INDEX = "cache.db"
BUSY_SECONDS = 10.0  # a write waiting for another process's
_BUSY_PAUSE = (0.001, 0.05)  # between two tries of a write: the first, the longest
STATEMENT_SECONDS = 10.0  # a statement running longer works on an index made to stall it
_NEIGHBOURS = 4  # keys read on each side of a lookup's tokens
_PROGRESS_STEPS = 10_000  # SQLite's instructions between two looks at the clock


# Held from making an index to closing the descriptor that made it (see _create).
_creating = threading.Lock()
reset_in_child(_creating)


def _create(index: str) -> None:
    """Make the file ``index`` if there is none: here, for its mode, and for an OSError saying
    why it cannot be (SQLite's says "unable to open database file" whatever the reason).
    Never a descriptor of an index that exists: closing it would drop every POSIX lock this
    process holds on the file, a connection's of another StateDirectory's among them, and
    another process would then write under its reads. One this makes was open nowhere, and is
    closed before another thread here can connect to it (each tries to make it first)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    with _creating:
        try:
            descriptor = os.open(index, flags | getattr(os, "O_BINARY", 0), 0o600)
        except FileExistsError:  # (a link too: O_EXCL does not follow it)
            return
        os.close(descriptor)


def _check_index_files(index: str) -> None:
    """InvalidParameterError unless each file SQLite may open next to ``index`` is missing or a
    regular file: not a link to a file elsewhere, nor a FIFO or device, whose open waits (for
    a writer: forever, and a Ctrl-C cannot stop it), nor a hard link to a file elsewhere."""
    for path in (index + suffix for suffix in _INDEX_FILES):
        try:
            found = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(found.st_mode):
            raise InvalidParameterError(f"{path} is a symbolic link")
        if not stat.S_ISREG(found.st_mode):
            raise InvalidParameterError(f"{path} is not a regular file")
        if found.st_nlink != 1:
            raise InvalidParameterError(f"{path} has other hard links")


class StateDirectory:
    """State files in ``directory``, each under a (namespace, tokens) key, least recently used
    removed first beyond ``capacity_bytes`` (the index's own pages count too). Thread-safe and
    shared safely between processes (SQLite's locks); every call holds signal handlers until it
    returns, so no Ctrl-C lands inside a transaction."""

    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: float) -> None:
        self.directory = os.fspath(directory)
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        hold_across_fork(self._lock)  # fork() waits for a thread of ours inside SQLite
        # SQLite asks it between instructions; not a method of ours: the connection holding
        # it would make a cycle, keeping a dropped Llama's cache until the collector ran.
        self._clock = _Clock()
        # A connection is in a cycle of its own until closed: closed when this is dropped.
        self._open = _Open()
        weakref.finalize(self, self._open.close)
        self.locked_out = False  # a write waits for another process's (see _writing)
        with held_signals():
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            self._connect()
        if os.path.exists(os.path.join(self.directory, _LEGACY_INDEX)):
            log.warning(
                "%s holds a prompt cache of an older llamacrab (diskcache's %s and its .val "
                "files): its states are not read, and take room until they are deleted",
                self.directory, _LEGACY_INDEX,
            )  # fmt: skip

    def _connect(self) -> None:
        """Open the index as ``_db`` for this process (``_pid``), made if it is new."""
        index = os.path.join(self.directory, INDEX_NAME)
        _create(index)
        _check_index_files(index)
        # SQLite waits for another process only while the index is being opened; a write
        # waits in _writing, without holding the index, and nothing else waits (a lookup
        # reads WAL's snapshot; its use counter is left as it is when it cannot be written).
        self._db = sqlite3.connect(
            index, timeout=BUSY_SECONDS, isolation_level=None, check_same_thread=False
        )
        try:
            self._db.set_progress_handler(self._clock.overdue, _PROGRESS_STEPS)
            self._run("PRAGMA trusted_schema = OFF")  # (older SQLite: an unknown pragma, a no-op)
            # What SQLite opened (links resolved): the checks above looked at the name before,
            # and a writer of the directory may have swapped in a link meanwhile.
            ((_, _, opened),) = self._run("PRAGMA database_list")
            if opened != os.path.join(os.path.realpath(self.directory), INDEX_NAME):
                raise InvalidParameterError(f"{index} was opened as {opened}")
            self._check_schema(index)  # read only: a database not ours is refused unchanged
            self._run("PRAGMA journal_mode = WAL")
            self._run("PRAGMA synchronous = NORMAL")  # no sync per commit (a lookup commits)
            with self._transaction():
                if not self._check_schema(index):
                    for statement in _CREATE:
                        self._run(statement)
            self._run("PRAGMA busy_timeout = 0")
        except BaseException:
            self._db.close()
            raise
        self._pid: int | None = os.getpid()
        self._open.db, self._open.pid = self._db, self._pid

    def _check_schema(self, index: str) -> bool:
        """Whether the index holds this module's tables (False: nothing yet); else an
        InvalidParameterError."""
        schema = set(self._run("SELECT type, name, tbl_name, sql FROM sqlite_master"))
        if schema and schema != _SCHEMA:
            raise InvalidParameterError(f"{index} is not a llamacrab prompt cache index")
        return bool(schema)

    def _run(self, statement: str, parameters: Sequence[object] = ()) -> list[Any]:
        """``statement``'s rows, all of them within STATEMENT_SECONDS."""
        self._clock.deadline = time.monotonic() + STATEMENT_SECONDS
        try:
            return self._db.execute(statement, parameters).fetchall()
        finally:
            self._clock.deadline = float("inf")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        self._run("BEGIN IMMEDIATE")
        try:
            yield
            self._run("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._run("ROLLBACK")
            raise

    def _writing(self, work: Callable[[], _T]) -> _T:
        """``work()``'s result, run in a write transaction. While another process writes, it
        tries again (for up to BUSY_SECONDS) without holding the index meanwhile: lookups of
        other threads go on, and fork() does not wait."""
        deadline = time.monotonic() + BUSY_SECONDS
        pause = _BUSY_PAUSE[0]
        try:
            while True:
                with self._using():
                    try:
                        with self._transaction():
                            return work()
                    except sqlite3.OperationalError as error:
                        if not _busy(error) or time.monotonic() > deadline:
                            raise
                self.locked_out = True
                time.sleep(pause)
                pause = min(pause * 2, _BUSY_PAUSE[1])
        finally:
            self.locked_out = False

    @contextlib.contextmanager
    def _using(self) -> Iterator[None]:
        """The index, for this thread alone, in this process (a forked child opens its own,
        and a closed one is opened again, as diskcache did)."""
        with held_signals(), self._lock:
            if self._pid != os.getpid():
                if self._pid is not None:  # the parent's: closing it here would act on the
                    abandon(self._db)  # parent's locks, journal and shared memory
                self._connect()
            yield

    def nearest(self, namespace: bytes, tokens: bytes, max_bytes: int) -> list[bytes]:
        """The keys' tokens (packed, 4 bytes each) in ``namespace`` that come nearest to
        ``tokens`` in byte order, on either side: the one sharing most leading tokens with
        ``tokens`` is among them (a key between it and ``tokens`` would share as many).
        Each side's first _NEIGHBOURS rows are read, whatever the index holds; keys longer
        than ``max_bytes`` and rows of another form are left out."""
        found = []
        with self._using():
            for where, order in (("tokens <= ?", "DESC"), ("tokens > ?", "")):
                found += self._run(
                    "SELECT CASE WHEN length(tokens) <= ? THEN tokens END FROM states "
                    f"WHERE namespace = ? AND tokens >= x'' AND {where} "  # (blobs only)
                    f"ORDER BY tokens {order} LIMIT {_NEIGHBOURS}",
                    (max_bytes, namespace, tokens),
                )
        return [t for (t,) in found if isinstance(t, bytes) and t and len(t) % 4 == 0]

    def holds(self, namespace: bytes, tokens: bytes) -> bool:
        with self._using():
            found = self._run(
                "SELECT 1 FROM states WHERE namespace = ? AND tokens = ?", (namespace, tokens)
            )
        return bool(found)

    def open(self, namespace: bytes, tokens: bytes) -> tuple[str, io.BufferedReader] | None:
        """The name and the open file of the state under the key, marked used; None when there
        is none (or its file is gone). StateError for a row that names no file of ours, or a
        file that is not a regular one: the row is dropped, nothing else touched."""
        key = (namespace, tokens)
        with self._using():
            rows = self._run("SELECT file FROM states WHERE namespace = ? AND tokens = ?", key)
            if not rows:
                return None
            (name,) = rows[0]
            if not (isinstance(name, str) and _STATE_FILE.fullmatch(name)):
                self._drop(key, name)
                raise StateError(f"its file name {name!r} is not one a prompt cache makes")
            try:
                file = self._open_file(name)
            except FileNotFoundError:  # removed meanwhile (evicted by another process)
                self._drop(key, name)
                return None
            except StateError:
                self._drop(key, name)
                raise
            # Best effort: a use that cannot be written now (another process writes, a full
            # disk) neither waits nor fails the hit; the entry is evicted a little sooner.
            with contextlib.suppress(sqlite3.OperationalError):
                self._run(
                    "UPDATE states SET used = (SELECT ifnull(max(used), 0) + 1 FROM states) "
                    "WHERE namespace = ? AND tokens = ?", key,
                )  # fmt: skip
        return name, file

    def _open_file(self, name: str) -> io.BufferedReader:
        path = os.path.join(self.directory, name)
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            descriptor = os.open(path, flags | getattr(os, "O_BINARY", 0))
        except OSError:
            if os.path.islink(path):
                raise StateError(f"{name} is a symbolic link") from None
            raise
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):  # a FIFO would wait for a writer
            os.close(descriptor)
            raise StateError(f"{name} is not a regular file")
        return open(descriptor, "rb")

    def discard(self, namespace: bytes, tokens: bytes, name: str) -> None:
        """Remove the entry under the key if it still names the file ``name``, and its file."""
        with self._using():
            self._drop((namespace, tokens), name)

    def _drop(self, key: tuple[bytes, bytes], name: object) -> None:
        self._run("DELETE FROM states WHERE namespace = ? AND tokens = ? AND file IS ?",
                  (*key, name))  # fmt: skip
        if self._run("SELECT changes()") == [(1,)]:  # else: replaced meanwhile, the file too
            self._remove_files([name])

    def put(self, namespace: bytes, tokens: bytes, parts: Sequence[bytes | memoryview]) -> None:
        """Write a state file of ``parts`` and index it under the key (replacing the entry
        there), then remove the least recently used beyond the capacity. A failed write
        leaves no file behind. A state larger than the capacity is not written: it would
        evict every other, then itself."""
        if sum(memoryview(part).nbytes for part in parts) > self.capacity_bytes:
            return
        name = f"{secrets.token_hex(16)}.state"
        path = os.path.join(self.directory, name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        with held_signals():  # (the index is not held while the file is written)
            descriptor = os.open(path, flags | getattr(os, "O_BINARY", 0), 0o600)
            try:
                with open(descriptor, "wb") as file:
                    for part in parts:
                        file.write(part)
                    size = file.tell()
                gone = self._writing(lambda: self._index(namespace, tokens, name, size))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(path)
                raise
        self._remove_files(gone)

    def _index(self, namespace: bytes, tokens: bytes, name: str, size: int) -> list[object]:
        """Index the file ``name`` under the key; the names of the files no longer indexed."""
        replaced = self._run(
            "SELECT file FROM states WHERE namespace = ? AND tokens = ?", (namespace, tokens)
        )
        self._run(
            "INSERT OR REPLACE INTO states VALUES "
            "(?, ?, ?, ?, (SELECT ifnull(max(used), 0) + 1 FROM states))",
            (namespace, tokens, name, size),
        )
        return [old for (old,) in replaced] + self._evict()

    def _evict(self) -> list[object]:
        """Remove the least recently used rows while the whole exceeds the capacity; their
        files' names (removed once the transaction commits)."""
        gone = []
        while self._size() > self.capacity_bytes:
            rows = self._run("SELECT rowid, file FROM states ORDER BY used LIMIT 1")
            if not rows:
                break
            ((rowid, file),) = rows
            self._run("DELETE FROM states WHERE rowid = ?", (rowid,))
            gone.append(file)
        return gone

    def _remove_files(self, names: Sequence[object]) -> None:
        for name in names:
            if isinstance(name, str) and _STATE_FILE.fullmatch(name):  # else: not ours
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.directory, name))

    def _size(self) -> float:
        ((stored,),) = self._run("SELECT total(size) FROM states")
        ((pages,),) = self._run("PRAGMA page_count")
        ((page_size,),) = self._run("PRAGMA page_size")
        return float(stored) + int(pages) * int(page_size)

    def size_bytes(self) -> int:
        with self._using():
            return int(self._size())

    def __len__(self) -> int:
        with self._using():
            ((count,),) = self._run("SELECT count(*) FROM states")
        return int(count)

    def close(self) -> None:
        """Close the index (a later call opens it again)."""
        with self._using():
            self._db.close()
            self._pid = None


class _Open:
    """The connection this process opened last, for closing it once its StateDirectory is
    dropped (never in a forked child: it is the parent's there)."""

    def __init__(self) -> None:
        self.db: sqlite3.Connection | None = None
        self.pid: int | None = None

    def close(self) -> None:
        if self.db is not None and self.pid == os.getpid():
            with held_signals(), contextlib.suppress(sqlite3.Error):
                self.db.close()


class _Clock:
    """When the statement running now is overdue (SQLite's progress handler asks)."""

    def __init__(self) -> None:
        self.deadline = float("inf")

    def overdue(self) -> bool:
        return time.monotonic() > self.deadline


def _busy(error: sqlite3.OperationalError) -> bool:
    """Whether ``error`` says another connection holds the lock (SQLITE_BUSY)."""
    code = getattr(error, "sqlite_errorcode", None)  # (Python 3.11 on)
    return code & 0xFF == 5 if code is not None else "locked" in str(error)
