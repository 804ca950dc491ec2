"""Registry fuzzing: programs of operations on one ``ModelRegistry`` from several threads.

A registry serves several models by name and unloads them to keep within its limits, while
other threads hold leases, stream, complete, or unload by force: the orders a multi-model
server meets. Each program makes a registry with drawn limits (``max_loaded``, a memory
budget, ``keep_alive``) over four entries of the tiny model (one slot, two parallel slots, a
truncated file, a context llama.cpp could not hold), then runs operations on it, each on the
program's thread or a new one: complete, complete inside ``use``, acquire / release a lease,
open a stream and read it a little (left open), unload (by force or not), load, list
``entries`` (checking that no more models are loaded than ``max_loaded`` allows), sleep past
``keep_alive``, add an entry with drawn options, close the registry. One program in
``EXIT_EVERY`` leaves the interpreter with its threads and streams in flight.

Run in a child: a LlamaError is a refusal; any other exception, or a count past
``max_loaded``, is unclean; a thread that does not finish is a hang. After the program the
threads are joined, the streams closed, the leases released, and the registry (or, once
closed, a new one over the same entries) must load the one-slot entry and answer.
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path
from typing import Any

from reliability_kit.programs import Program, stacks

NAMES = ("one", "two", "broken", "huge", "unknown")
EXIT_EVERY = 40
# Ordinary limits (the tiny model's estimate is ~1 MiB); one program in five has one a registry
# refuses.
LIMITS: dict[str, list[Any]] = {
    "max_loaded": [None, 1, 1, 2],
    "memory_budget": [None, None, "2MiB", "40MiB", 3 << 20],
    "keep_alive": [None, None, 0.0, 0.05, 1.0],
}
BAD_LIMITS: dict[str, list[Any]] = {
    "max_loaded": [0, -1, "2", 2.5, True],
    "memory_budget": ["lots", -1, 0, "0MiB"],
    "keep_alive": [-1.0, float("nan"), float("inf"), "1"],
}
ADDED_OPTIONS: list[dict[str, Any]] = [
    {}, {"parallel": 3}, {"n_ctx": 2**31 - 1}, {"n_ctx": 0}, {"preset": "low-ram"},
    {"preset": "bogus"}, {"embeddings": True}, {"keep_alive": -1}, {"keep_alive": "1"},
    {"keep_alive": float("nan")}, {"pinned": True}, {"pinned": "yes"}, {"n_threads": 4097},
    {"max_queue": 0}, {"isolate": True}, {"bogus_option": 1},
]  # fmt: skip


# -- generation (parent) -----------------------------------------------------------------------


def generate(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        limits = {key: rng.choice(values) for key, values in LIMITS.items()}
        if rng.random() < 0.2:
            bad = rng.choice(sorted(BAD_LIMITS))
            limits[bad] = rng.choice(BAD_LIMITS[bad])
        ops = [_op(rng) for _ in range(rng.randint(3, 24))]
        ends_in_exit = i % EXIT_EVERY == EXIT_EVERY - 1
        cases.append({"id": f"registry-{seed}-{i}", "limits": limits, "ops": ops,
                      "exit": ends_in_exit})  # fmt: skip
    return cases


def _op(rng: random.Random) -> dict[str, Any]:
    name = rng.choice([*NAMES[:2] * 4, *NAMES])  # mostly the entries that load
    kind = rng.choices(
        ["complete", "use", "acquire", "release", "stream", "read", "unload", "load", "entries",
         "sleep", "add", "close"],
        weights=[6, 4, 3, 3, 3, 3, 4, 2, 3, 2, 1, 0.3],
    )[0]  # fmt: skip
    op: dict[str, Any] = {"op": kind, "name": name, "thread": rng.random() < 0.4}
    if kind in ("complete", "use", "stream", "read"):
        op["tokens"] = rng.choice([0, 1, 2, 8, 32])
    if kind == "unload":
        op["force"] = rng.random() < 0.5
    if kind == "sleep":
        op["seconds"] = rng.choice([0.0, 0.02, 0.1])
    if kind == "add":
        op["options"] = rng.choice(ADDED_OPTIONS)
        op["name"] = rng.choice(["one", "extra", "extra2"])
    return op


# -- execution (child) -------------------------------------------------------------------------


def setup(config: dict[str, Any], slot: int) -> dict[str, Any]:
    model = Path(config["model"])
    broken = Path(config["workdir"]) / f"broken-{slot}.gguf"
    broken.parent.mkdir(parents=True, exist_ok=True)
    if not broken.exists():
        shutil.copyfile(model, broken)
        with broken.open("r+b") as file:
            file.truncate(broken.stat().st_size // 2)
    return {"model": model, "broken": broken}


def entries(state: dict[str, Any]) -> list[Any]:
    from llamacrab import ModelEntry

    model, common = str(state["model"]), {"n_ctx": 256, "n_threads": 1}
    return [
        ModelEntry("one", model, options=common),
        ModelEntry("two", model, options={**common, "parallel": 2}),
        ModelEntry("broken", str(state["broken"]), options=common),
        ModelEntry("huge", model, options={"n_ctx": 2**31 - 1, "n_threads": 1}),
    ]


# An "exit" program's objects, alive while the interpreter leaves.
_EXITING: list[RegistryProgram] = []


def run_case(case: dict[str, Any], state: dict[str, Any]) -> tuple[str, str]:
    from llamacrab import ModelRegistry

    registry = ModelRegistry(entries(state), **case["limits"])  # may refuse the limits
    program = RegistryProgram(registry, case["limits"]["max_loaded"], state)
    for op in case["ops"]:
        program.dispatch(op)
    if case.get("exit"):
        _EXITING.append(program)
        return program.outcome()
    stuck = program.join_threads()
    if stuck:
        return "hang", f"threads never finished: {program.summary()}\n{stacks(stuck)}"
    program.still_answers()
    return program.outcome()


class RegistryProgram(Program):
    """One program's registry, its leases and streams, and its operations."""

    def __init__(self, registry: Any, max_loaded: int | None, state: dict[str, Any]) -> None:
        super().__init__()
        self.registry, self.max_loaded, self.state = registry, max_loaded, state
        self.leases: list[str] = []
        self.closed = False
        self.streams: list[Any] = []

    def dispatch(self, op: dict[str, Any]) -> None:
        if op["thread"]:
            self.spawn(self.run, op)
        else:
            self.run(op)

    # -- operations ----------------------------------------------------------------------------

    def op_complete(self, op: dict[str, Any]) -> None:
        llm = self.registry.get(op["name"])
        llm.create_completion("the cat", max_tokens=op["tokens"], temperature=0)

    def op_use(self, op: dict[str, Any]) -> None:
        with self.registry.use(op["name"]) as llm:
            llm.create_completion("the cat", max_tokens=op["tokens"], temperature=0)

    def op_acquire(self, op: dict[str, Any]) -> None:
        self.registry.acquire(op["name"])
        with self.lock:
            self.leases.append(op["name"])

    def op_release(self, op: dict[str, Any]) -> None:
        with self.lock:  # only a lease this program holds: another would take a use's
            if op["name"] not in self.leases:
                return
            self.leases.remove(op["name"])
        self.registry.release(op["name"])

    def op_stream(self, op: dict[str, Any]) -> None:
        stream = self.registry.get(op["name"]).stream_completion("the cat", max_tokens=64)
        with self.lock:
            self.streams.append(stream)
        for _, _ in zip(range(op["tokens"]), stream, strict=False):
            pass

    def op_read(self, op: dict[str, Any]) -> None:
        with self.lock:
            if not self.streams:
                return
            stream = self.streams[op["tokens"] % len(self.streams)]
        for _, _ in zip(range(op["tokens"]), stream, strict=False):
            pass

    def op_unload(self, op: dict[str, Any]) -> None:
        self.registry.unload(op["name"], force=op["force"])

    def op_load(self, op: dict[str, Any]) -> None:
        self.registry.load(op["name"])

    def op_entries(self, op: dict[str, Any]) -> None:
        loaded = [e.name for e in self.registry.entries() if e.status == "loaded"]
        if self.max_loaded is not None and len(loaded) > self.max_loaded:
            raise AssertionError(f"{loaded} loaded at once with max_loaded {self.max_loaded}")
        self.registry.status(op["name"])

    def op_sleep(self, op: dict[str, Any]) -> None:
        time.sleep(op["seconds"])

    def op_add(self, op: dict[str, Any]) -> None:
        options = {"n_threads": 1, **op["options"]}
        self.registry.add(op["name"], str(self.state["model"]), **options)

    def op_close(self, op: dict[str, Any]) -> None:
        self.closed = True
        self.registry.close()

    # -- the end -------------------------------------------------------------------------------

    def still_answers(self) -> None:
        """Close the streams and release the leases: then nothing is in use, so every other
        model unloads without force, and the one-slot entry loads and answers (in a new
        registry over the same entries once this one is closed)."""
        from llamacrab import LlamaError

        try:
            self._settle_and_ask()
        except LlamaError as error:  # not a refusal: the registry broke
            self.unclean.append(f"after the program: {type(error).__name__}: {error}")

    def _settle_and_ask(self) -> None:
        from llamacrab import ModelRegistry

        for stream in self.streams:
            stream.close()
        for name in self.leases:
            self.registry.release(name)
        registry = ModelRegistry(entries(self.state)) if self.closed else self.registry
        for entry in registry.entries():
            if entry.status == "loaded" and entry.name != "one":
                _unload_once_settled(registry, entry.name)
        with registry.use("one") as llm:
            answer = llm.create_completion("the cat", max_tokens=2, min_tokens=1, temperature=0)
        if answer.usage.completion_tokens < 1:
            self.unclean.append(f"the registry's model answered nothing: {answer}")
        registry.close()
        self.registry.close()


def _unload_once_settled(registry: Any, name: str, seconds: float = 5.0) -> None:
    """Unload without force: a closed stream's parallel slot is freed at the engine's next
    step, so a refusal may last a moment; past ``seconds`` it is a use count left behind."""
    from llamacrab import ConcurrentUseError

    deadline = time.monotonic() + seconds
    while True:
        try:
            registry.unload(name)
            return
        except ConcurrentUseError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
