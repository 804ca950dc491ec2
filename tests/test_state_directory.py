"""A DiskCache's directory (``_engine/state_directory.py``) as a hostile writer leaves it: what
it plants is read as data and refused, never unpickled or run; no file outside the directory is
read, written or removed; the generation goes on."""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from llamacrab import DiskCache, InvalidParameterError, Llama
from llamacrab._types import common_prefix

PROMPT = "the cat sat on the mat the dog sat on the cat"
# Prompts that each meet a hostile entry of their own tokens, the best match there is.
BRANCHES = (" and a mat", " or a dog", " but a cat", " so a rat", " if a bat")
INDEX = "llamacrab-states.sqlite"
# diskcache's table, as an older llamacrab's DiskCache made it in cache.db.
DISKCACHE_TABLE = (
    "CREATE TABLE IF NOT EXISTS Cache (rowid INTEGER PRIMARY KEY, key BLOB, raw INTEGER, "
    "store_time REAL, expire_time REAL, access_time REAL, access_count INTEGER DEFAULT 0, "
    "tag BLOB, size INTEGER DEFAULT 0, mode INTEGER DEFAULT 0, filename TEXT, value BLOB)"
)


class _Marker:
    """Unpickled, it creates the file ``path``: a stand-in for any code a pickle can run."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[object, ...]:
        return open, (self.path, "w")


def _tokens(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def _plant_diskcache_rows(
    directory: Path, namespace: bytes, keys: list[bytes], marker: Path, outside: Path
) -> None:
    """What the red team planted in an older llamacrab's index: a pickled key that runs code
    when the keys are listed, a pickled value, a file named by an absolute path and one that
    leaves the directory (read, refused as corrupt, then deleted)."""
    with sqlite3.connect(directory / "cache.db") as db:
        db.execute(DISKCACHE_TABLE)
        insert = "INSERT INTO Cache (key, raw, mode, filename, value) VALUES (?, 0, ?, ?, ?)"
        db.execute(insert, (pickle.dumps(_Marker(marker)), 1, None, b"x"))
        db.execute(insert, (pickle.dumps((namespace, keys[0])), 4, None,
                            pickle.dumps(_Marker(marker))))  # fmt: skip
        db.execute(insert, (pickle.dumps((namespace, keys[1])), 2, str(outside), None))
        db.execute(insert, (pickle.dumps((namespace, keys[2])), 2, f"../{outside.name}", None))
    db.close()


def _plant_index_rows(
    directory: Path, namespace: bytes, keys: list[bytes], marker: Path, outside: Path
) -> None:
    """The same in this llamacrab's index (none in an older one's directory): a pickle as a
    state file, an absolute file name, one leaving the directory, a file name that is a link
    to a file outside, the state of other tokens; and rows no lookup can use (a pickle as a
    key, tokens as text or of a length no token list has)."""
    index = directory / INDEX
    if not index.exists():
        return
    (legit,) = directory.glob("*.state")
    (directory / f"{'a' * 32}.state").write_bytes(pickle.dumps(_Marker(marker)))
    (directory / f"{'b' * 32}.state").symlink_to(outside)
    shutil.copy(legit, directory / f"{'c' * 32}.state")
    pickled_key = pickle.dumps(_Marker(marker))
    pickled_key += bytes(-len(pickled_key) % 4)  # listed as tokens, if anything
    rows = [
        (keys[0], f"{'a' * 32}.state"), (keys[1], str(outside)),
        (keys[2], f"../{outside.name}"), (keys[3], f"{'b' * 32}.state"),
        (keys[4], f"{'c' * 32}.state"), (pickled_key, legit.name), ("1234", legit.name),
        (b"12345", legit.name),
    ]  # fmt: skip
    with sqlite3.connect(index) as db:
        db.executemany(
            "INSERT INTO states VALUES (?, ?, ?, 1, 0)",
            [(namespace, tokens, name) for tokens, name in rows],
        )
    db.close()


def _outside_files(root: Path, directory: Path) -> dict[str, bytes | str]:
    """Every file under ``root`` but in ``directory``, with its bytes (a link: its target)."""
    found: dict[str, bytes | str] = {}
    for path in root.rglob("*"):
        if directory in path.parents or path == directory or path.is_dir():
            continue
        found[str(path)] = os.readlink(path) if path.is_symlink() else path.read_bytes()
    return found


def test_a_hostile_cache_directory_runs_nothing_and_touches_nothing_outside(
    tmp_path: Path, tiny_model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory, marker = tmp_path / "cache", tmp_path / "marker"
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    with Llama(tiny_model_path, n_ctx=128, n_threads=1, cache=DiskCache(directory)) as llm:
        llm.create_completion(PROMPT, max_tokens=2, temperature=0)
        llm.cache.close()  # type: ignore[union-attr]
        namespace = llm.context.fingerprint({})  # what a prompt without adapters looks under
        keys = [_tokens(llm.tokenize(PROMPT + branch)) for branch in BRANCHES]
    _plant_diskcache_rows(directory, namespace, keys, marker, outside)
    _plant_index_rows(directory, namespace, keys, marker, outside)
    before = _outside_files(tmp_path, directory)
    cache = DiskCache(directory)
    with Llama(tiny_model_path, n_ctx=128, n_threads=1, cache=cache) as llm:
        with pytest.warns(UserWarning, match="discarding a corrupt prompt-cache entry") as warned:
            for branch in BRANCHES:  # each meets its hostile entry first: dropped, a miss
                llm.reset()
                answer = llm.create_completion(PROMPT + branch, max_tokens=2, temperature=0)
                assert not marker.exists()  # (an older llamacrab's first lookup made it)
                assert answer.usage.completion_tokens == 2 and answer.usage.cached_tokens == 0
        llm.reset()
        again = llm.create_completion(PROMPT, max_tokens=2, temperature=0)
        assert again.usage.cached_tokens > 0  # the honest entry still serves
    cache.close()
    reasons = " | ".join(str(w.message) for w in warned)
    for reason in (
        "not a llamacrab state", f"{str(outside)!r} is not one", "'../outside.txt' is not one",
        "is a symbolic link", "other tokens",
    ):  # fmt: skip
        assert reason in reasons
    assert _outside_files(tmp_path, directory) == before
    assert outside.read_text() == "precious\n"
    assert "older llamacrab" in caplog.text  # cache.db: never read
    with sqlite3.connect(directory / INDEX) as db:  # the first state, each branch's, and
        # the 3 rows no lookup could use (left be)
        assert db.execute("SELECT count(*) FROM states").fetchone() == (1 + len(BRANCHES) + 3,)
    db.close()


@pytest.mark.parametrize("change", ["trigger", "view", "link", "journal link"])
def test_an_index_of_another_making_is_refused(tmp_path: Path, change: str) -> None:
    directory = tmp_path / "cache"
    DiskCache(directory).close()
    index = directory / INDEX
    with sqlite3.connect(index) as db:
        if change == "trigger":
            db.execute("CREATE TRIGGER t AFTER DELETE ON states BEGIN SELECT 1; END")
        elif change == "view":
            db.execute("DROP TABLE states")
            db.execute("CREATE VIEW states AS SELECT 1")
    db.close()
    if change == "link":
        index.rename(tmp_path / "elsewhere.sqlite")
        index.symlink_to(tmp_path / "elsewhere.sqlite")
    elif change == "journal link":
        (directory / f"{INDEX}-wal").symlink_to(tmp_path / "victim")
    reason = "is a symbolic link" if "link" in change else "not a llamacrab prompt cache index"
    with pytest.raises(InvalidParameterError, match=reason):
        DiskCache(directory)
    assert not (tmp_path / "victim").exists()


def test_an_index_made_to_stall_is_interrupted_and_the_generation_goes_on(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """Changed once the cache is open (its schema is checked only then), the index's table
    becomes a view without end: the lookup is interrupted after STATEMENT_SECONDS."""
    from llamacrab._engine import state_directory

    monkeypatch.setattr(state_directory, "STATEMENT_SECONDS", 0.3)
    cache = DiskCache(tmp_path / "cache")
    with sqlite3.connect(tmp_path / "cache" / INDEX) as db:
        db.execute("DROP TABLE states")
        db.execute(
            "CREATE VIEW states (namespace, tokens, file, size, used) AS WITH RECURSIVE "
            "n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) "
            "SELECT zeroblob(i % 1), x'', '', 0, i FROM n WHERE i < 0"  # per row: no shortcut
        )
    db.close()
    with pytest.raises(sqlite3.OperationalError, match="interrupted"):
        cache.longest_prefix([1, 2, 3])
    with (
        Llama(tiny_model_path, n_ctx=128, n_threads=1, cache=cache) as llm,
        caplog.at_level(logging.WARNING, logger="llamacrab"),
    ):
        answer = llm.create_completion(PROMPT, max_tokens=2, temperature=0)
    assert answer.usage.completion_tokens == 2
    assert "prompt cache lookup failed; treated as a miss" in caplog.text
    cache.close()


def _in_child(script: str, timeout: float = 60) -> str:
    """``script``'s output, run by a child Python (a hang fails the test instead of hanging it)."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() only")
def test_a_child_forked_while_a_thread_is_inside_sqlite_uses_the_cache(tmp_path: Path) -> None:
    """fork() while another thread ran SQLite on the shared connection: the child's first call
    waited forever on the mutex that thread held (37 children of 200)."""
    output = _in_child(f"""
        import os, signal, threading, time
        from llamacrab._engine.state_directory import StateDirectory
        files = StateDirectory({str(tmp_path)!r}, 1 << 40)
        for i in range(100):
            files.put(b"ns", i.to_bytes(4, "little") * 64, [b"x" * 100])
        stop = False
        def hammer():
            i = 0
            while not stop:
                i += 1
                len(files)
                files.holds(b"ns", (i % 100).to_bytes(4, "little") * 64)
                if i % 7 == 0:
                    files.put(b"ns", (i % 50).to_bytes(4, "little"), [b"y" * 50])
        thread = threading.Thread(target=hammer)
        thread.start()
        outcomes = []
        for _ in range(100):
            time.sleep(0.003)
            pid = os.fork()
            if pid == 0:
                signal.alarm(3)
                files.put(b"ns", b"child", [b"c"])
                os._exit(0 if len(files) >= 100 else 3)
            _, status = os.waitpid(pid, 0)
            outcomes.append(os.waitstatus_to_exitcode(status))
            if outcomes[-1]:
                break
        stop = True
        thread.join()
        print(outcomes[-1], len(outcomes))
    """)  # fmt: skip
    assert output.split() == ["0", "100"]  # (-14: the child hung till its alarm)


def test_opening_the_directory_again_keeps_the_locks_of_this_process(tmp_path: Path) -> None:
    """A second StateDirectory on the directory (two caches, a cache reopened) opened and
    closed a descriptor of the index: POSIX drops every lock the process holds on a file when
    any descriptor of it is closed, so another process changed the index under a read (here:
    out of WAL mode; in use, SQLITE_IOERR_SHORT_READ and SQLITE_CORRUPT by the ten thousand)."""
    from llamacrab._engine.state_directory import StateDirectory

    first = StateDirectory(tmp_path, 1 << 30)
    first.put(b"ns", b"abcd", [b"x"])
    first._db.execute("BEGIN")  # a read under way: a shared lock on the index
    first._db.execute("SELECT count(*) FROM states").fetchall()
    probe = f"""
        import sqlite3
        db = sqlite3.connect({str(tmp_path / INDEX)!r}, timeout=0, isolation_level=None)
        try:
            print(db.execute("PRAGMA journal_mode = DELETE").fetchall())
        except sqlite3.OperationalError as error:
            print(error)
    """
    assert _in_child(probe).strip() == "database is locked"
    StateDirectory(tmp_path, 1 << 30).close()
    assert _in_child(probe).strip() == "database is locked"  # (old: [('delete',)])
    first._db.execute("COMMIT")
    first.close()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs only")
@pytest.mark.parametrize("suffix", ["", "-journal", "-wal", "-shm"])
def test_a_fifo_for_the_index_or_a_journal_is_refused(tmp_path: Path, suffix: str) -> None:
    """SQLite's open of a FIFO waits for a writer: forever, and Ctrl-C cannot stop it."""
    directory = tmp_path / "cache"
    DiskCache(directory).close()
    (directory / f"{INDEX}{suffix}").unlink(missing_ok=True)
    os.mkfifo(directory / f"{INDEX}{suffix}")
    output = _in_child(f"""
        from llamacrab import DiskCache, InvalidParameterError
        try:
            DiskCache({str(directory)!r}).longest_prefix([1, 2, 3])
        except InvalidParameterError as error:
            print(error)
    """, timeout=20)  # fmt: skip
    assert f"{INDEX}{suffix} is not a regular file" in output


def test_a_lookup_does_not_wait_for_another_process_writing_the_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holding the write lock: a lookup waited for it twice, updating its use
    counter, and behind this process's write waiting with the index held (10 to 20 s a
    generation)."""
    from llamacrab._engine import state_directory

    monkeypatch.setattr(state_directory, "BUSY_SECONDS", 3.0)
    files = state_directory.StateDirectory(tmp_path, 1 << 30)
    files.put(b"ns", b"abcd", [b"state"])
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sqlite3, sys, time\n"
         f"db = sqlite3.connect({str(tmp_path / INDEX)!r}, isolation_level=None)\n"
         "db.execute('BEGIN IMMEDIATE'); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        writer = threading.Thread(target=lambda: files.put(b"ns", b"efgh", [b"x"]))
        writer.start()
        time.sleep(0.3)  # the write waits for the holder's
        started = time.monotonic()
        entry = files.open(b"ns", b"abcd")
        took = time.monotonic() - started
    finally:
        holder.kill()
        holder.wait()
    writer.join()
    assert entry is not None and entry[1].read() == b"state"
    entry[1].close()
    assert took < 1.0  # (old: 5.7 s)
    files.close()


def test_a_hit_stays_a_hit_when_its_use_cannot_be_written(tmp_path: Path) -> None:
    """A full disk (here: the index made read-only) failed the use counter's update, and with
    it every lookup."""
    from llamacrab._engine.state_directory import StateDirectory

    files = StateDirectory(tmp_path, 1 << 30)
    files.put(b"ns", b"abcd", [b"state"])
    files._db.execute("PRAGMA query_only = ON")
    entry = files.open(b"ns", b"abcd")
    assert entry is not None and entry[1].read() == b"state"
    entry[1].close()
    files.close()


def _plant(directory: Path, rows: list[tuple[bytes, bytes]]) -> None:
    """Index rows (namespace, tokens) of no file, as a writer of the directory can."""
    with sqlite3.connect(directory / INDEX) as db:
        db.executemany(
            "INSERT INTO states VALUES (?, ?, ?, 1, 0)",
            [(space, tokens, f"{i:032x}.state") for i, (space, tokens) in enumerate(rows)],
        )
    db.close()


def test_a_lookup_finds_the_longest_shared_prefix_reading_few_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every lookup turned every key of the namespace into a tuple of ints: a million rows
    cost 6.6 to 8.5 s a generation, one key of 128 MiB 1.6 s and 1.7 GB. Now the keys next to
    the prompt's in byte order are read (the one sharing most is among them), and a key longer
    than the bound is left out."""
    from llamacrab._engine import cache as cache_module

    monkeypatch.setattr(cache_module, "MAX_KEY_TOKENS", 100)
    DiskCache(tmp_path).close()
    rng = np.random.default_rng(0)
    keys = [_tokens(rng.integers(0, 4, size=rng.integers(1, 12)).tolist()) for _ in range(400)]
    too_long = _tokens([1, 2, 3, 0, 1, 2, 3, 0] + [1] * 100)
    _plant(tmp_path, [(b"ns", key) for key in {*keys}] + [(b"ns", too_long), (b"other", b"x" * 4)])
    cache = DiskCache(tmp_path)
    found = []
    monkeypatch.setattr(cache, "_get", lambda space, tokens: found.append(tokens))
    for _ in range(50):
        prompt = rng.integers(0, 4, size=10).tolist()
        cache.longest_prefix(prompt, b"ns")
        best = max(common_prefix(np.frombuffer(key, "<i4").tolist(), prompt) for key in keys)
        assert common_prefix(found.pop(), prompt) == best if best else not found
    cache.longest_prefix([1, 2, 3, 0, 1, 2, 3, 0, 1, 1], b"ns")
    assert found and len(found[0]) <= 100  # (old: the longest, past the bound)
    cache.close()


def test_a_lookup_among_many_rows_reads_few(tmp_path: Path) -> None:
    DiskCache(tmp_path).close()
    _plant(tmp_path, [(b"ns", _tokens([i, 1, 2])) for i in range(200_000)])
    cache = DiskCache(tmp_path)
    started = time.monotonic()
    assert cache.longest_prefix([5, 5, 5], b"ns") is None  # (the key's state file is missing)
    assert time.monotonic() - started < 0.05  # (old: 0.3 s; now 1 ms)
    cache.close()


@pytest.mark.parametrize("linked", [True, False])
def test_a_foreign_database_is_refused_unchanged(tmp_path: Path, linked: bool) -> None:
    """A database of someone else's, hard-linked in as the index (or copied): switched to WAL
    mode before its schema was refused."""
    foreign = tmp_path / "foreign.sqlite"
    with sqlite3.connect(foreign) as db:
        db.execute("CREATE TABLE precious (x)")
    db.close()
    before = foreign.read_bytes()
    (tmp_path / "cache").mkdir()
    index = tmp_path / "cache" / INDEX
    if linked:
        os.link(foreign, index)
    else:
        shutil.copy(foreign, index)
    reason = "has other hard links" if linked else "not a llamacrab prompt cache index"
    with pytest.raises(InvalidParameterError, match=reason):
        DiskCache(tmp_path / "cache")
    assert index.read_bytes() == before  # (old: in WAL mode)
    assert not (tmp_path / "cache" / f"{INDEX}-wal").exists()


def test_an_index_swapped_for_a_link_while_it_opens_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The link checks look at the names before SQLite opens them: a writer that swaps the
    index for a link in between had the cache write the file it points to."""
    victim = tmp_path / "victim.sqlite"
    DiskCache(tmp_path / "cache").close()
    index = tmp_path / "cache" / INDEX
    shutil.copy(index, victim)  # (its schema passes: the database a writer points at)
    before = victim.read_bytes()
    connect = sqlite3.connect

    def swapped_then_connect(path: str, *args: object, **kwargs: object) -> sqlite3.Connection:
        if path == str(index):
            index.unlink()
            index.symlink_to(victim)
        return connect(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sqlite3, "connect", swapped_then_connect)
    with pytest.raises(InvalidParameterError, match="was opened as"):
        DiskCache(tmp_path / "cache")
    assert victim.read_bytes() == before
    assert not (tmp_path / "victim.sqlite-wal").exists()  # (old: opened for writing)


def test_a_state_larger_than_the_capacity_is_not_stored(tmp_path: Path) -> None:
    """It evicted every other state, then itself (RamCache skips it)."""
    from llamacrab._engine.state_directory import StateDirectory

    files = StateDirectory(tmp_path, 1_000_000)
    for i in range(4):
        files.put(b"ns", bytes([i, 0, 0, 0]), [b"x" * 100_000])
    files.put(b"ns", b"\x09\0\0\0", [b"y" * 600_000, memoryview(b"y" * 600_000)])
    assert len(files) == 4  # (old: 0)
    assert len(list(tmp_path.glob("*.state"))) == 4
    files.close()
