"""A process forked from one that uses llama.cpp (os.fork, multiprocessing's default start
method on Linux): the parent's objects are refused in the child, never hang or crash it; a
model loaded in the child works (on one thread where GNU OpenMP's pool is the parent's); the
parent goes on as before. Each case runs in a child interpreter of its own, which forks."""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import pkgutil
import threading
from pathlib import Path

import pytest
from test_crash_proof import assert_clean_exit, run_child

import llamacrab
from llamacrab._native import fork

# argv: model path, parallel ("none" or a count), whether a thread generates during the fork.
_FORK_CHILD = """
    import json, logging, os, sys, threading, time
    from llamacrab import ForkedHandleError, Llama

    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("llamacrab").addHandler(handler)

    path, parallel, busy = sys.argv[1], sys.argv[2], sys.argv[3] == "busy"
    parallel = None if parallel == "none" else int(parallel)
    llm = Llama(path, n_ctx=256, n_threads=2, parallel=parallel)
    greedy = dict(max_tokens=8, temperature=0)
    expected = llm.create_completion("the cat", **greedy).choices[0].text
    open_stream = llm.stream_completion("the cat", max_tokens=64)
    next(open_stream)

    stop = threading.Event()
    def generate():
        while not stop.is_set():
            llm.create_completion("the dog", max_tokens=32, temperature=0)
    worker = threading.Thread(target=generate, daemon=True)
    if busy:
        worker.start()
        time.sleep(0.2)

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        seen = {}
        for name, use in [
            ("complete", lambda: llm.create_completion("the cat", **greedy)),
            ("stream", lambda: next(iter(llm.stream_completion("the cat", **greedy)))),
            ("open_stream", lambda: list(open_stream)),
            ("tokenize", lambda: llm.tokenize("the cat")),
            ("save_state", lambda: llm.save_state(slot=0 if parallel else None)),
            ("reset", lambda: llm.reset()),
        ]:
            try:
                use()
                seen[name] = "worked"
            except ForkedHandleError as error:
                seen[name] = "forked" if "before os.fork()" in str(error) else str(error)
        seen["closed"] = llm.closed
        llm.close()  # the parent's: nothing freed here, nothing waited for
        with Llama(path, n_ctx=256, n_threads=2) as own:
            seen["own"] = own.create_completion("the cat", **greedy).choices[0].text
        seen["warnings"] = [w for w in warnings if "fork" in w]
        os.write(write_end, json.dumps(seen).encode())
        os.close(write_end)
        sys.exit(0)  # runs the exit hooks, which close what is left

    os.close(write_end)
    started = time.monotonic()
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() - started > 60:
            os.kill(pid, 9)
            raise SystemExit("the forked child hung")
        time.sleep(0.05)
    child_seconds = time.monotonic() - started
    seen = json.loads(os.read(read_end, 1 << 16) or b"{}")
    stop.set()
    if busy:
        worker.join()
    again = llm.create_completion("the cat", **greedy).choices[0].text
    print(json.dumps({"child": seen, "child_seconds": child_seconds,
                      "expected": expected, "again": again}))
"""


@pytest.mark.parametrize(
    ("parallel", "busy"), [("none", "idle"), ("none", "busy"), ("2", "idle"), ("2", "busy")]
)
def test_a_forked_child_refuses_the_parents_llama_and_loads_its_own(
    tiny_model_path: Path, parallel: str, busy: str
) -> None:
    # Before: the child's first decode waited forever in libgomp for the parent's OpenMP
    # threads (even with a model of its own), and its exit waited 10 s for the parent's
    # generation in flight.
    child = run_child(_FORK_CHILD, str(tiny_model_path), parallel, busy, timeout=180)
    assert_clean_exit(child)
    result = json.loads(child.stdout.strip().splitlines()[-1])
    seen = result["child"]
    uses = ("complete", "stream", "open_stream", "tokenize", "save_state", "reset")
    if parallel == "none" and busy == "busy":  # the busy thread superseded the open stream:
        assert seen.pop("open_stream") == "worked"  # it ends, cancelled, without llama.cpp
        uses = tuple(name for name in uses if name != "open_stream")
    assert {name: seen[name] for name in uses} == dict.fromkeys(uses, "forked")
    assert seen["closed"] is True
    assert seen["own"] == result["expected"]  # one thread computes the same greedy tokens
    assert len(seen["warnings"]) == 1 and "1 thread here instead of 2" in seen["warnings"][0]
    assert result["child_seconds"] < 5  # it waited 10 s for the parent's calls in flight
    assert result["again"] == result["expected"]


_POOL_CHILD = """
    import multiprocessing, sys
    from llamacrab import ForkedHandleError, Llama

    path = sys.argv[1]
    inherited = Llama(path, n_ctx=256, n_threads=2)
    inherited.create_completion("the cat", max_tokens=2)
    own = None

    def with_inherited(prompt):
        try:
            return inherited.create_completion(prompt, max_tokens=4, temperature=0).choices[0].text
        except ForkedHandleError:
            return "refused"

    def load_own():
        global own
        own = Llama(path, n_ctx=256, n_threads=2)

    def with_own(prompt):
        return own.create_completion(prompt, max_tokens=4, temperature=0).choices[0].text

    expected = inherited.create_completion("the cat", max_tokens=4, temperature=0).choices[0].text
    fork = multiprocessing.get_context("fork")
    with fork.Pool(2) as pool:
        print(pool.map(with_inherited, ["the cat"] * 2, chunksize=1))
    with fork.Pool(2, initializer=load_own) as pool:
        print(pool.map(with_own, ["the cat"] * 2, chunksize=1) == [expected] * 2)
"""


def test_a_fork_pool_gets_an_error_for_a_global_llama_and_works_with_its_own(
    tiny_model_path: Path,
) -> None:
    child = run_child(_POOL_CHILD, str(tiny_model_path), timeout=180)
    assert_clean_exit(child)
    assert child.stdout.split() == ["['refused',", "'refused']", "True"]


def test_a_platform_without_fork_imports_and_generates(tiny_model_path: Path) -> None:
    # Windows has neither os.register_at_fork nor os.sysconf: import and a model without mmap
    # (its weights checked against the memory left) must not need them.
    child = run_child(
        """
        import os, sys
        del os.fork, os.register_at_fork, os.sysconf
        from llamacrab import Llama
        from llamacrab._native import host_limits
        print(host_limits.host_memory_left(meminfo=host_limits.Path("/no/meminfo")).source)
        with Llama(sys.argv[1], n_ctx=64, n_threads=1, use_mmap=False) as llm:
            answer = llm.create_completion("a b", max_tokens=3, temperature=0)
            print(answer.choices[0].finish_reason)
        """,
        str(tiny_model_path),
    )
    assert_clean_exit(child)
    unread, finished = child.stdout.split("\n")[:2]
    assert (unread, finished) == ("no memory size could be read on this machine:", "length")


# What the scripts below fork: a child that loads a model of its own; its exit code, -14
# (SIGALRM) where that load hung.
_FORK_A_CHILD_THAT_LOADS = """
    import os, signal, sys
    from llamacrab import Llama

    def fork_a_child_that_loads():
        pid = os.fork()
        if pid == 0:
            signal.alarm(30)  # a hung child ends, and says so by its status
            with Llama(sys.argv[1], n_ctx=64, n_threads=1) as own:
                own.create_completion("the cat", max_tokens=2)
            os._exit(0)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
"""


def _forked_child_exit(script: str, model: Path) -> int:
    child = run_child(_FORK_A_CHILD_THAT_LOADS + script, str(model), timeout=120)
    assert_clean_exit(child)
    return int(child.stdout.strip().splitlines()[-1])


_FORK_WHILE_LOADING = """
    import threading
    from llamacrab._native.gguf.arch_rules import _Model as Rules
    from llamacrab._native.model import Model

    # Threads of the parent inside cached properties (a model's metadata read at load, the
    # GGUF check's rules): before Python 3.12 each property holds one lock for every instance
    # while it computes, so these stand for another thread loading a model at fork().
    locks = [getattr(vars(cls)[name], "lock", None)
             for cls, name in [(Model, "_metadata"), (Model, "_loaded_metadata"),
                               (Model, "identity"), (Rules, "heads")]]
    inside, leave = threading.Event(), threading.Event()
    def compute():
        for lock in filter(None, locks):
            lock.acquire()
        inside.set()
        leave.wait(60)
        for lock in filter(None, locks):
            lock.release()
    threading.Thread(target=compute, daemon=True).start()
    inside.wait(10)
    code = fork_a_child_that_loads()
    leave.set()
    print(code)
"""


def test_a_child_forked_while_another_thread_reads_a_model_loads_its_own(
    tiny_model_path: Path,
) -> None:
    # Found by the lifecycle fuzzer (1 program in 10,000): a fork while another thread loaded a
    # Llama left the child's own load waiting for ever on functools.cached_property's lock.
    assert _forked_child_exit(_FORK_WHILE_LOADING, tiny_model_path) == 0


_FORK_WHILE_GGML_INITS = """
    import threading, time
    from llamacrab_sys import lib

    # A thread of the parent inside ggml's critical section, as every ggml_init is for a
    # moment (each graph a decode on another thread builds) and ggml_quantize_init for longer.
    inside = threading.Event()
    def hold():
        assert lib.llamacrab_try_take_ggml_mutex() == 1
        inside.set()
        time.sleep(0.5)
        lib.llamacrab_give_back_ggml_mutex()
    threading.Thread(target=hold, daemon=True).start()
    inside.wait(10)
    code = fork_a_child_that_loads()
    with Llama(sys.argv[1], n_ctx=64, n_threads=1) as mine:  # the parent's mutex given back
        mine.create_completion("the cat", max_tokens=2)
    print(code)
"""


def test_a_child_forked_while_another_thread_is_inside_ggml_loads_a_model(
    tiny_model_path: Path,
) -> None:
    # fork() waits for ggml's process-wide mutex; before, the child inherited it held by a
    # thread it does not have, and its first ggml_init (its model load) waited for ever.
    assert _forked_child_exit(_FORK_WHILE_GGML_INITS, tiny_model_path) == 0


def test_every_lock_a_module_holds_is_released_in_a_forked_child() -> None:
    # A module's lock (or a cached property's, shared by every instance before Python 3.12)
    # that another thread holds at fork() is held for ever in the child: each is registered
    # with _native/fork.py (the adapters, which may not import it, use os.register_at_fork).
    lock_types = (type(threading.Lock()), type(threading.RLock()), threading.Condition)
    adapters = ("llamacrab.server", "llamacrab.cli", "llamacrab.compat", "llamacrab.__main__")
    held_for_ever = []
    for info in pkgutil.walk_packages(llamacrab.__path__, "llamacrab."):
        if info.name.startswith(adapters):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, lock_types) and value not in fork._inherited_locks:
                held_for_ever.append(f"{info.name}.{name}")
            if inspect.isclass(value) and value.__module__ == info.name:
                for attribute, member in vars(value).items():
                    lock = getattr(member, "lock", None)  # none from Python 3.12 on
                    cached = isinstance(member, functools.cached_property)
                    if cached and lock is not None and lock not in fork._inherited_locks:
                        held_for_ever.append(f"{info.name}.{name}.{attribute}")
    assert held_for_ever == []


_FORK_DURING_A_LARGE_BODY = """
    import gc, os, threading
    from llamacrab.server import _json_body

    reading, leave = threading.Event(), threading.Event()
    def read():
        reading.set()
        leave.wait(30)
    threading.Thread(target=_json_body._collector_paused, args=(read,), daemon=True).start()
    reading.wait(10)
    assert not gc.isenabled()  # paused while the body is read
    pid = os.fork()
    if pid == 0:
        free = _json_body._paused_lock.acquire(timeout=5)
        os._exit(0 if free and gc.isenabled() else 1)
    _, status = os.waitpid(pid, 0)
    leave.set()
    print("child", os.waitstatus_to_exitcode(status))
"""


def test_a_server_forked_while_it_reads_a_large_body_collects_garbage_in_the_child() -> None:
    child = run_child(_FORK_DURING_A_LARGE_BODY, timeout=60)
    assert_clean_exit(child)
    assert child.stdout.strip().splitlines()[-1] == "child 0"
