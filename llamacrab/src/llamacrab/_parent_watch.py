"""A child process that ends with the process that started it, on every platform.

The parent gives the child a pipe as its stdin and keeps the write end open without writing
more; the system closes it when the parent ends, however it ends (a kill, a crash), and the
child's read of stdin then returns end-of-file. ``os.getppid()`` is watched too on POSIX: it
tells even while a fork of the parent still holds the pipe open. It cannot be the only sign:
on Windows it keeps a dead parent's id.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

POLL_SECONDS = 0.5


def read_first_line() -> bytes:
    """The first line of stdin (what the parent asks of the child; nothing follows it), read
    from the descriptor: a thread still reading sys.stdin at exit would hold its lock."""
    data = bytearray()
    while b"\n" not in data:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            break
        data += chunk
    return bytes(data.split(b"\n", 1)[0])


def watch_parent(parent: int, gone: Callable[[], None]) -> None:
    """Call ``gone`` from a daemon thread once stdin reaches its end or, on POSIX, once this
    process's parent is no longer ``parent``."""

    def read_to_end() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass  # stdin closed under us: as gone as end-of-file
        gone()

    def poll_parent() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_SECONDS)
        gone()

    threading.Thread(target=read_to_end, name="llamacrab-parent-pipe", daemon=True).start()
    if os.name == "posix":
        threading.Thread(target=poll_parent, name="llamacrab-parent-pid", daemon=True).start()
