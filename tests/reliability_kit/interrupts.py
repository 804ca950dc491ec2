"""Signals at random moments: Ctrl-C (SIGINT) or a handler that only counts (SIGUSR1), sent
to the process while an operation on Gemma 3 270M runs.

Python runs a signal's handler on the main thread at its next bytecode: inside a callback
from C (a log line, a load's progress), between C returning a new object and the handle
that frees it, inside a lock's bookkeeping or a generator's cleanup. Each case picks one of
four Llamas (one slot, two parallel slots, a RAM or a disk prompt cache; kept across cases),
an operation (load a new Llama with or without mmap and drop it, complete, a prompt of
350-910 tokens that one decode takes up to a second over (a Ctrl-C aborts it mid-graph),
stream and stop early, chat, a JSON-schema completion, save or load a state, tokenize, reset,
two threads completing at once) and a moment (a timer thread sends the signal, or in every
other case the kernel's interval timer, whose SIGALRM lands at any bytecode of the main
thread, where a thread's signal lands almost only where it can take the GIL); or a
completion with an image on one of two more Llamas (one slot, two slots) whose projector
takes most of a second to encode it (a Ctrl-C aborts the encode mid-graph). Each case that
raised notes how long after the signal.

Invariants: every SIGINT raises exactly one KeyboardInterrupt in the case and every SIGUSR1
runs its handler exactly once (none lost inside a callback, none twice), but for one rule of
CPython: an exception raised inside a finalizer is printed and dropped, so a Ctrl-C landing
while a dropped Llama's finalizers free it is lost (counted, and only then allowed: a
``weakref.finalize`` reports a KeyboardInterrupt); nothing else is printed as an exception
swallowed in a callback or a finalizer; the kept Llama's next-token
log-probability for a fixed prompt stays what it was (its memory and bookkeeping agree);
after a collection the model file is mapped as often as the four Llamas map it, and the
process's memory stays within LEAK_BYTES of theirs (an interrupted load may not leak a model).
"""

from __future__ import annotations

import gc
import os
import random
import shutil
import signal
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from reliability_kit.repo import made_once, script

CONFIGS = ("plain", "parallel", "ram", "disk")
OPERATIONS = ("load", "load-no-mmap", "complete", "long-prompt", "stream", "chat", "schema",
              "save", "restore", "tokenize", "reset", "threads", "media")  # fmt: skip
# The Llamas with a projector (one slot, two slots) that the media operation uses
VISION_CONFIGS = ("vision", "vision-parallel")
# Made at import: numpy.random's first import inside a case (numpy loads it lazily) took a
# case's Ctrl-C and lost it (the only handler run was there; no KeyboardInterrupt came out).
PIXELS = np.random.default_rng(7).integers(0, 256, (48, 64, 3), np.uint8)
PROMPTS = ("The capital of France is", "Once upon a time there was a", "def fibonacci(n):")
REFERENCE = "List three colours:"
# The model read into memory is ~250 MiB; the heap of a process that loads and frees models on
# several threads drifts by up to ~200 MiB (glibc keeps arenas), so the file's mappings are the
# exact count and this bound catches models read into memory and kept.
LEAK_BYTES = 600 << 20
TOLERANCE = 0.05  # the logprob moves by ~1e-3 between batch shapes; wrong memory moves it more


def generate(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        operation = rng.choice(OPERATIONS)
        cases.append({
            "id": f"interrupts-{seed}-{i}",
            "config": rng.choice(VISION_CONFIGS if operation == "media" else CONFIGS),
            "operation": operation,
            "signal": rng.choice(("SIGINT", "SIGINT", "SIGINT", "SIGUSR1")),
            "delay": round(rng.random() ** 2 * 0.5, 4),  # mostly early: inside the native call
            "prompt": rng.choice(PROMPTS),
            # Not drawn from rng: the cases of a seed stay the ones they were
            "delivery": "kernel" if i % 2 else "thread",
        })  # fmt: skip
    return cases


class _Sender:
    """Sends the case's signal after its delay: from a timer thread, or from the handler of
    the kernel's SIGALRM (which then runs where the main thread is, at any bytecode)."""

    def __init__(self, case: dict[str, Any], number: int) -> None:
        self.sent: list[float] = []
        self.number, self.delay = number, case["delay"]
        self.kernel = case.get("delivery") == "kernel"
        self.timer = threading.Timer(self.delay, self.send)
        self.previous: Any = None

    def send(self, *_: object) -> None:
        self.sent.append(time.perf_counter())
        os.kill(os.getpid(), self.number)

    def start(self) -> None:
        if self.kernel:
            self.previous = signal.signal(signal.SIGALRM, self.send)
            signal.setitimer(signal.ITIMER_REAL, max(self.delay, 1e-6))
        else:
            self.timer.start()  # (a delay of 0 may fire before start returns)

    def join(self) -> None:
        if not self.kernel:
            self.timer.join()
            return
        while not self.sent:  # the delays are at most 0.5 s
            time.sleep(0.001)
        if self.previous is not None:
            signal.signal(signal.SIGALRM, self.previous)
            self.previous = None


def projector(workdir: Path, model: Path) -> str:
    """A Gemma 3-style projector for ``model`` (Gemma 3 270M, 640 wide) that encodes 4,096
    patches into 16 embeddings: most of a second's work to interrupt (make_tiny_mmproj)."""
    make_mmproj = script("make_tiny_mmproj")

    def write(path: Path) -> object:
        import gguf

        width = gguf.GGUFReader(model).fields["gemma3.embedding_length"].contents()
        return make_mmproj.write_tiny_gemma3_mmproj(
            path, n_embd_text=int(width), merge=16, vision=make_mmproj.SLOW_VISION
        )

    return made_once(workdir, "interrupts-{}-mmproj.gguf", {"slow": write})["slow"]


# -- the child's side ---------------------------------------------------------------------------


class _Swallowed:
    """stderr, counting what says an exception was swallowed (a callback's, a finalizer's)."""

    MARKS = ("exception in a callback", "Exception ignored")

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.lines: list[str] = []

    def write(self, text: str) -> int:
        if any(mark in text for mark in self.MARKS):
            self.lines.append(text.strip()[:200])
        return int(self.stream.write(text))

    def flush(self) -> None:
        self.stream.flush()


class _LostInFinalizers:
    """sys.unraisablehook: counts the KeyboardInterrupts CPython drops in a ``weakref.finalize``
    (every handle frees through one; raised there, they cannot propagate); prints everything
    else as Python would."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, unraisable: Any) -> None:
        if issubclass(unraisable.exc_type, KeyboardInterrupt) and isinstance(
            unraisable.object, weakref.finalize
        ):
            self.count += 1
        else:
            sys.__unraisablehook__(unraisable)


def _mappings(path: str) -> int:
    """How many mappings of ``path`` the process has (a model loaded with mmap holds some)."""
    real = os.path.realpath(path)
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if line.rstrip("\n").endswith(real))


def _rss() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) << 10


def setup(config: dict[str, Any], slot: int) -> dict[str, Any]:
    """The four Llamas (with their reference next token and a saved state), the SIGUSR1
    counter, stderr watched, and the memory they all take: what the cases may not grow."""
    sys.stderr = _Swallowed(sys.stderr)
    sys.unraisablehook = lost = _LostInFinalizers()
    # Python's own Ctrl-C handler, even where the runner was started with SIGINT ignored (a
    # background job of a non-interactive shell is), which Python then leaves ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    usr1 = [0]
    signal.signal(signal.SIGUSR1, lambda signum, frame: usr1.__setitem__(0, usr1[0] + 1))
    # The disk cache lives in the run's work folder: a child killed by a signal cannot remove it.
    cache = Path(config["workdir"]) / f"cache-{slot}"
    llamas = {name: _llama(config["model"], name, config["projector"], cache)
              for name in (*CONFIGS, *VISION_CONFIGS)}  # fmt: skip
    gc.collect()
    return {"model": config["model"], "llamas": llamas, "usr1": usr1, "baseline": _rss(),
            "mapped": _mappings(config["model"]), "lost": lost}  # fmt: skip


def _llama(
    model: str, config: str, projector: str, cache: Path
) -> tuple[Any, tuple[str, float], Any]:
    from llamacrab import Llama

    options: dict[str, Any] = {"n_ctx": 1024, "n_threads": 2}
    if config.endswith("parallel"):
        options["parallel"] = 2
    if config.startswith("vision"):
        options["mmproj"] = projector
    elif config == "ram":
        options["prompt_cache"] = "ram"
    elif config == "disk":
        shutil.rmtree(cache, ignore_errors=True)  # a fresh cache for each child of the slot
        options["prompt_cache"] = str(cache)
    llm = Llama(model, **options)
    return llm, _next_token(llm), llm.save_state(**_slot(config))


def _slot(config: str) -> dict[str, int]:
    return {"slot": 0} if config.endswith("parallel") else {}


def _next_token(llm: Any) -> tuple[str, float]:
    answer = llm.create_completion(REFERENCE, max_tokens=1, temperature=0, logprobs=1)
    logprobs = answer.choices[0].logprobs
    return answer.text, logprobs.token_logprobs[0]


def _operate(
    llm: Any, saved: Any, case: dict[str, Any], model: str, threads: list[threading.Thread]
) -> None:
    """Run the case's operation; ``threads`` gets the threads it starts (joined afterwards:
    an interrupt leaves them running)."""
    from llamacrab import Image, Llama

    operation, prompt, slot = case["operation"], case["prompt"], _slot(case["config"])
    if operation.startswith("load"):
        other = Llama(model, n_ctx=256, n_threads=2, use_mmap=operation == "load")
        other.create_completion(prompt, max_tokens=2)
        del other  # dropped, not closed: the finalizers free it
    elif operation in ("complete", "long-prompt"):
        # 650-910 tokens of the 1024 (350-490 of a parallel slot's 512): one decode
        repeat = (70 if case["config"] == "parallel" else 130) if operation == "long-prompt" else 1
        text = prompt * repeat
        llm.create_completion(text, max_tokens=16, temperature=0)
    elif operation == "media":
        llm.create_completion(f"{prompt} {llm.media_marker} and", media=[Image(pixels=PIXELS)],
                              max_tokens=8, temperature=0)  # fmt: skip
    elif operation == "stream":
        for number, _ in enumerate(llm.stream_completion(prompt, max_tokens=24)):
            if number == 8:
                break  # the stream is dropped open
    elif operation == "chat":
        llm.create_chat_completion([{"role": "user", "content": prompt}], max_tokens=12)
    elif operation == "schema":
        schema = {"type": "object", "properties": {"name": {"type": "string"}}}
        llm.create_chat_completion([{"role": "user", "content": prompt}], max_tokens=12,
                                   response_format={"type": "json_schema",
                                                    "json_schema": {"schema": schema}})  # fmt: skip
    elif operation == "save":
        for _ in range(10):
            llm.save_state(**slot)
    elif operation == "restore":
        for _ in range(10):
            llm.load_state(saved, **slot)
    elif operation == "tokenize":
        for _ in range(50):
            llm.tokenize(prompt * 200)
    elif operation == "reset":
        for _ in range(50):
            llm.reset(**slot)
    else:
        threads += [threading.Thread(target=llm.create_completion, args=(text,),
                                     kwargs={"max_tokens": 8}) for text in PROMPTS[:2]]  # fmt: skip
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def run_case(case: dict[str, Any], state: dict[str, Any]) -> tuple[str, str]:
    llm, expected, saved = state["llamas"][case["config"]]
    usr1, lost = state["usr1"], state["lost"]
    before, lost_before = usr1[0], lost.count
    timer = _Sender(case, getattr(signal, case["signal"]))
    sent = timer.sent
    interrupts, refusal, latency = 0, None, None
    threads: list[threading.Thread] = []
    try:
        timer.start()
        try:
            _operate(llm, saved, case, state["model"], threads)
        except KeyboardInterrupt:
            interrupts += 1
            latency = time.perf_counter() - sent[0]
        except Exception as error:  # a LlamaError is a refusal; anything else is unclean
            refusal = error
        timer.join()
        time.sleep(0.01)  # a signal sent after the operation lands here
    except KeyboardInterrupt:
        interrupts += 1
    timer.join()
    for thread in threads:
        if thread.ident is not None:  # (interrupted before it started: never will)
            thread.join()
    problems = []
    sent_sigint = case["signal"] == "SIGINT"
    lost_here = lost.count - lost_before
    if interrupts + lost_here != int(sent_sigint):
        problems.append(f"{interrupts} KeyboardInterrupts (and {lost_here} lost in a finalizer) "
                        f"for {int(sent_sigint)} SIGINT")  # fmt: skip
    if not sent_sigint and usr1[0] - before != 1:
        problems.append(f"the SIGUSR1 handler ran {usr1[0] - before} times")
    swallowed = sys.stderr.lines  # type: ignore[attr-defined]
    if swallowed:
        problems.append(f"swallowed: {swallowed[:2]}")
        swallowed.clear()
    got = _next_token(llm)
    if got[0] != expected[0] or abs(got[1] - expected[1]) > TOLERANCE:
        problems.append(f"next token {got} after the case, {expected} before")
    gc.collect()
    mapped = _mappings(state["model"]) - state["mapped"]
    if mapped:
        problems.append(f"the model file has {mapped} more mappings than the Llamas' own")
    grown = _rss() - state["baseline"]
    if grown > LEAK_BYTES:
        problems.append(f"memory grew {grown >> 20} MiB over the Llamas' own")
    if problems:
        raise RuntimeError("; ".join(problems))
    if refusal is not None:
        raise refusal
    how = "ran" if not interrupts else "interrupted"
    if lost_here:
        how = "the KeyboardInterrupt lost in a finalizer (CPython drops exceptions raised there)"
    if latency is not None:  # raised by the operation (not in the pause after it)
        how += f" {latency * 1000:.0f} ms after the signal"
    return "ok", f"{how}; memory {grown / 2**20:+.0f} MiB"
