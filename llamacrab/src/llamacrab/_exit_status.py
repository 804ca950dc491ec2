"""How a child process ended, in words that hold on every system."""

from __future__ import annotations

import signal


def describe(status: int) -> str:
    """``status`` as ``subprocess`` reports it: "killed by SIGSEGV" for a signal (a negative
    status on POSIX; one without a name, such as a real-time signal, by its number), "exited
    with 3" otherwise, in hex past 16 bits (Windows' crash codes, e.g. 0xc0000005 for an
    access violation, are exit statuses there)."""
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exited with {status:#x}" if status > 0xFFFF else f"exited with {status}"
