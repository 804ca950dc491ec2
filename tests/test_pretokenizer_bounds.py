"""run_bounded's decisions and its big-stack thread, without a model: the refusal follows the
longest match a text can make, and a thread that cannot start leaves the process as it was."""

from __future__ import annotations

import threading

import pytest

from llamacrab import TokenizeError
from llamacrab._native import pretokenizer
from llamacrab._native.pretokenizer import MAX_CHARS, longest_match_bound, run_bounded

PROSE = "a few short words,\nand lines. " * (MAX_CHARS // 30 + 1)


def test_the_longest_match_spans_three_runs_at_most() -> None:
    assert longest_match_bound("ab  cdef\n") == 12
    assert longest_match_bound(b"ab \xff\xfe\xfd") == 9
    assert longest_match_bound("") == 0


def test_long_prose_is_tokenized_and_one_long_run_refused() -> None:
    # The recursion follows one match, not the text: a book past MAX_CHARS was refused.
    assert len(PROSE) > MAX_CHARS
    assert run_bounded(PROSE, lambda: 7) == 7
    one_run = "a" * (MAX_CHARS // 3 + 1)
    with pytest.raises(TokenizeError, match=f"up to {len(one_run) * 3} characters"):
        run_bounded(PROSE + one_run, lambda: 7)


def _refuse(*_: object) -> None:
    raise RuntimeError("can't start new thread")


@pytest.mark.parametrize("where", ["start_new_thread", "stack_size"])
def test_a_thread_that_cannot_start_is_a_tokenize_error(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    before = threading.stack_size()
    if where == "stack_size":
        monkeypatch.setattr(pretokenizer.threading, "stack_size", _refuse)
    else:
        monkeypatch.setattr(pretokenizer, "start_new_thread", _refuse)
    for _ in range(3):  # more than the threads allowed at once: none is left taken
        with pytest.raises(TokenizeError, match="could not start a tokenizer thread"):
            run_bounded("a" * 3000, lambda: 7)
    monkeypatch.undo()
    assert threading.stack_size() == before
    assert run_bounded("a" * 3000, lambda: 7) == 7


def test_two_big_stack_threads_run_at_once_and_the_others_wait() -> None:
    running, release = threading.Semaphore(0), threading.Event()

    def work() -> int:
        running.release()
        release.wait()
        return 7

    callers = [threading.Thread(target=run_bounded, args=("a" * 3000, work)) for _ in range(3)]
    for caller in callers:
        caller.start()
    assert running.acquire(timeout=10) and running.acquire(timeout=10)
    assert not running.acquire(timeout=0.3)  # the third waits for a slot
    release.set()
    assert running.acquire(timeout=10)
    for caller in callers:
        caller.join(timeout=10)
        assert not caller.is_alive()
