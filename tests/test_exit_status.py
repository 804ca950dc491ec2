"""How a child process ended, in words (llamacrab/_exit_status.py): the server's isolated
models, the RPC worker and the projector probe all report a child's death with it."""

from __future__ import annotations

import signal

import pytest

from llamacrab._exit_status import describe


@pytest.mark.parametrize(
    ("status", "words"),
    [
        (0, "exited with 0"),
        (3, "exited with 3"),  # abort() on Windows
        (0xC0000005, "exited with 0xc0000005"),  # an access violation on Windows
        (-signal.SIGSEGV, "killed by SIGSEGV"),
        (-signal.SIGABRT, "killed by SIGABRT"),
        (-200, "killed by signal 200"),  # no such signal: its number, not a ValueError
    ],
)
def test_an_exit_status_is_described_in_words(status: int, words: str) -> None:
    assert describe(status) == words
