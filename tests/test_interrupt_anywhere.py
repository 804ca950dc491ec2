"""A Ctrl-C landing at any bytecode of a call leaves the Llama usable, closable and the process
able to exit; a signal handler that uses the Llama it interrupted is refused, never deadlocked.

The kernel delivers the timer's SIGALRM at a random moment and its handler raises
KeyboardInterrupt, as Ctrl-C's does: between any two bytecodes of the main thread, inside
``threading.Condition.__enter__`` after it took its lock, between counting a native call in and
the ``try`` that counts it out. Before claims.py, one such landing in a few hundred left a lock
or a count behind: another thread's next call, ``close()`` and the exit hook waited for ever,
or every later call said the context was "in use by another thread". (A signal sent by a
Python thread lands almost only where that thread gives up the GIL, never in those windows.)
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")

PRELUDE = """
import faulthandler, random, signal, sys, threading, time
from llamacrab import Llama, LlamaError
path, mode, parallel = sys.argv[1], sys.argv[2], int(sys.argv[3]) or None
faulthandler.dump_traceback_later(100, exit=True)  # a hang prints where, and fails the test
"""

ANYWHERE = """
llm = Llama(path, n_ctx=256, n_threads=1, parallel=parallel)

def work():
    if mode == "complete":
        llm.create_completion("hello", max_tokens=2)
    elif mode == "stream":
        for _ in llm.stream_completion("hello", max_tokens=3):
            pass
    else:
        llm.tokenize("hello world")

def interrupt(signum, frame):
    raise KeyboardInterrupt

signal.signal(signal.SIGALRM, interrupt)
rnd = random.Random(7)
landed = 0
for attempt in range(150):
    signal.setitimer(signal.ITIMER_REAL, rnd.uniform(0.0001, 0.003))
    try:
        started = time.monotonic()
        while time.monotonic() - started < 0.5:
            work()
        signal.setitimer(signal.ITIMER_REAL, 0)
    except KeyboardInterrupt:
        landed += 1
    answers = []
    def probe():
        try:
            work()
            answers.append("ok")
        except LlamaError as error:
            answers.append(repr(error))
    other = threading.Thread(target=probe, daemon=True)
    other.start()
    other.join(10)
    if answers != ["ok"]:
        sys.exit(f"after interrupt {attempt}, another thread's call: {answers or 'no answer'}")
    work()  # and this thread's
print("landed", landed)
llm.close()
print("closed")
"""


def run(
    program: str, model: Path, mode: str, parallel: int = 0
) -> subprocess.CompletedProcess[str]:
    code = PRELUDE + textwrap.dedent(program)
    command = [sys.executable, "-c", code, str(model), mode, str(parallel)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tiny.write_tiny_llama(tmp_path_factory.mktemp("anywhere") / "tiny.gguf")
    return path


@pytest.mark.parametrize(
    ("mode", "parallel"),
    [("tokenize", 0), ("complete", 0), ("stream", 0), ("complete", 2), ("stream", 2)],
)
def test_a_ctrl_c_anywhere_leaves_the_llama_usable(model: Path, mode: str, parallel: int) -> None:
    child = run(ANYWHERE, model, mode, parallel)
    assert child.returncode == 0, child.stdout + child.stderr[-3000:]
    landed, closed = child.stdout.split("\n")[:2]
    assert int(landed.split()[1]) >= 100 and closed == "closed", child.stdout
    assert "left open at exit" not in child.stderr


HANDLER_CLOSES = """
counts = {"closed": 0, "refused": 0}
current = []

def stop(signum, frame):
    try:
        current[-1].close()
        counts["closed"] += 1
    except LlamaError:
        counts["refused"] += 1  # it interrupted a call on this Llama: refused, not a deadlock

signal.signal(signal.SIGALRM, stop)
rnd = random.Random(3)
for round in range(60):
    llm = Llama(path, n_ctx=256, n_threads=1)
    current.append(llm)
    signal.setitimer(signal.ITIMER_REAL, rnd.uniform(0.0001, 0.003))
    started = time.monotonic()
    while time.monotonic() - started < 0.02:
        try:
            llm.tokenize("hello world")
        except LlamaError:
            pass  # closed by the handler
    signal.setitimer(signal.ITIMER_REAL, 0)
    llm.close()
print(counts["closed"], counts["refused"])
"""


def test_a_handler_closing_the_llama_it_interrupted_never_deadlocks(model: Path) -> None:
    child = run(HANDLER_CLOSES, model, "tokenize")
    assert child.returncode == 0, child.stdout + child.stderr[-3000:]
    closed, refused = map(int, child.stdout.split())
    assert closed + refused >= 50, child.stdout  # the handler ran in most rounds
