"""Where build artefacts are cached outside the repository, and a cross-process lock for them."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

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
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
