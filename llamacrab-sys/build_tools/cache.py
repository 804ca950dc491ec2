"""Where build artefacts are cached outside the repository, and a cross-process lock for them."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO

if sys.platform == "win32":
    import msvcrt

    def _lock(handle: IO[str]) -> None:
        # LK_LOCK gives up after ten one-second tries; another build may hold it for minutes.
        while True:
            try:
                msvcrt.locking(handle.fileno(), msvcrt.LK_LOCK, 1)
                return
            except OSError:
                continue

    def _unlock(handle: IO[str]) -> None:
        msvcrt.locking(handle.fileno(), msvcrt.LK_UNLCK, 1)

else:
    import fcntl

    def _lock(handle: IO[str]) -> None:
        fcntl.flock(handle, fcntl.LOCK_EX)

    def _unlock(handle: IO[str]) -> None:
        fcntl.flock(handle, fcntl.LOCK_UN)


CACHE_ENV = "LLAMACRAB_CACHE_DIR"


def cache_root() -> Path:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        root = Path(explicit).expanduser()
    else:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        root = Path(base) / "llamacrab"
    root.mkdir(parents=True, exist_ok=True)
    return root.resolve()


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive lock so two concurrent builds never write the same cache entry."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as handle:
        _lock(handle)  # at offset 0 of an empty file: where _unlock releases it
        try:
            yield
        finally:
            _unlock(handle)
