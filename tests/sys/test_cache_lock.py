"""The build cache's cross-process lock: a second holder waits for the first to let go."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from build_tools.cache import locked

SYS_DIR = Path(__file__).resolve().parents[2] / "llamacrab-sys"

# Takes the lock, then says when it got it (after the parent let go, if the lock works).
_SECOND_HOLDER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from build_tools.cache import locked
print("started", flush=True)
with locked(Path(sys.argv[2])):
    print(time.monotonic(), flush=True)
"""


def test_a_second_process_waits_for_the_lock(tmp_path: Path) -> None:
    lock = tmp_path / "entry.lock"
    with locked(lock):
        second = subprocess.Popen([sys.executable, "-c", _SECOND_HOLDER, str(SYS_DIR), str(lock)],
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert second.stdout is not None and second.stdout.readline() == "started\n"
        time.sleep(0.5)  # long enough for it to take the lock, were it free
        released = time.monotonic()
    got = float(second.stdout.readline())
    assert second.wait(30) == 0
    assert got >= released
    with locked(lock):  # and it was let go again
        pass
