"""Several models in one server under churn: sections of the reliability suite
(``run_server_sections`` in scripts/reliability_server.py runs them; CI runs the short sizes
through tests/test_reliability_server.py).

- ``models`` (``model_churn``): four entries with room for one loaded (two that load, one and
  two slots; a truncated file; a context too large for any machine), idle ones unloaded after
  0.2 s.
- ``isolated`` (``isolated_churn``): entries in processes of their own (``isolate = true``: one
  and two slots, a truncated file) beside one in the server's process, room for two, while a
  killer sends SIGKILL to a model process at random moments (mid-request, mid-stream, mid-load).

Clients send OpenAI completions (some streamed, and some of those dropped after 0-6 events),
chats, Anthropic messages and Responses (streamed or not), embeddings of a text model,
``/models/load`` and ``/models/unload`` (forced or not) and model lists, naming any entry, an
unknown one or none.
Asserted: no 5xx and no error event in a stream but the plan's expected refusals, in the shape
of the route's API; a model that loads never reported failed (unless its process was killed
while it loaded); no traceback in the server's log; afterwards each loadable model answers;
the server alive; no model process left after it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import signal
import sys
import textwrap
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from server_process import ServerProcess, status_counts, tiny_model

KEY = "reliability"
HEADERS = {"Authorization": f"Bearer {KEY}"}
# Refusals with a 5xx that a plan may expect: a file that cannot load, no room for a model
# (every loaded one busy), a request cut by a forced unload (503), a model process killed (502).
LOAD_FAILED, NO_ROOM, CUT, PROCESS_DIED = (
    "model_load_failed", "model_busy", "shutting_down", "model_process_failed"
)  # fmt: skip
# Anthropic's error body has no code: the message says which refusal it is.
_ANTHROPIC_MESSAGES = (("failed to load", LOAD_FAILED), ("no room for model", NO_ROOM),
                       ("was closed while", CUT), ("its process", PROCESS_DIED))  # fmt: skip
_KINDS = (["complete"] * 3 + ["stream"] * 3 + ["chat", "messages", "responses", "embed", "load",
          "unload", "list"])  # fmt: skip
_STREAMABLE = ("messages", "responses")
# Kinds a churn must have served at least once (an embedding of a text model is always refused).
_SERVED = tuple(kind for kind in dict.fromkeys(_KINDS) if kind != "embed")


@dataclasses.dataclass(frozen=True)
class Plan:
    """One churn: its registry file (``{model}`` and ``{broken}`` filled in), the entries that
    load, the names requests draw from, the 5xx codes it expects, the error codes it must
    reach, and whether model processes are killed."""

    registry: str
    loadable: tuple[str, ...]
    names: tuple[str | None, ...]
    expected_5xx: frozenset[str]
    sought: frozenset[str]
    kills: bool = False


MODELS = Plan(
    registry="""\
        max_loaded = 1
        keep_alive = 0.2
        [models.alpha]
        model = "{model}"
        n_ctx = 256
        [models.beta]
        model = "{model}"
        n_ctx = 512
        parallel = 2
        [models.broken]
        model = "{broken}"
        [models.huge]
        model = "{model}"
        n_ctx = 2147483647
    """,
    loadable=("alpha", "beta"),
    names=("alpha", "beta", "broken", "huge", "nope", None),
    expected_5xx=frozenset({LOAD_FAILED, NO_ROOM, CUT}),
    sought=frozenset({"model_not_found", LOAD_FAILED, NO_ROOM}),
)
ISOLATED = Plan(
    registry="""\
        max_loaded = 2
        keep_alive = 0.5
        [models.alpha]
        model = "{model}"
        n_ctx = 256
        [models.gamma]
        model = "{model}"
        n_ctx = 256
        isolate = true
        [models.delta]
        model = "{model}"
        n_ctx = 512
        parallel = 2
        isolate = true
        [models.broken]
        model = "{broken}"
        isolate = true
    """,
    loadable=("alpha", "gamma", "delta"),
    names=("alpha", "gamma", "delta", "broken", "nope", None),
    expected_5xx=frozenset({LOAD_FAILED, NO_ROOM, CUT, PROCESS_DIED}),
    sought=frozenset({PROCESS_DIED}),  # a request (or stream) saw its model's process die
    kills=True,
)


def _registry_file(workdir: Path, plan: Plan, name: str) -> Path:
    model = tiny_model(workdir)
    broken = workdir / "churn-broken.gguf"
    broken.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    config = workdir / f"{name}.toml"
    config.write_text(textwrap.dedent(plan.registry).format(model=model, broken=broken))
    return config


def error_code(payload: object) -> str | None:
    """The code of an error body or error event in any of the three APIs' shapes; None when
    ``payload`` is not an error."""
    if not isinstance(payload, dict):
        return None
    error = payload.get("error")
    if payload.get("type") == "error" and "code" in payload:  # a Responses stream's event
        return str(payload["code"] or "error")
    if not isinstance(error, dict):
        return None
    if error.get("code"):
        return str(error["code"])
    if payload.get("type") == "error":  # Anthropic's shape
        message = str(error.get("message", ""))
        return next((code for text, code in _ANTHROPIC_MESSAGES if text in message),
                    str(error.get("type")))  # fmt: skip
    return str(error.get("type") or "error")


def stream_errors(lines: list[str], anthropic: bool) -> list[str]:
    """The codes of the error events in a stream's lines; ``malformed_error_event`` for an
    Anthropic error without its ``event: error`` line (its SDK would skip it)."""
    codes, event = [], ""
    for line in lines:
        if line.startswith("event: "):
            event = line.removeprefix("event: ")
        elif line.startswith("data: ") and line != "data: [DONE]":
            with contextlib.suppress(ValueError):
                code = error_code(json.loads(line.removeprefix("data: ")))
                if code is not None:
                    codes.append(code if event == "error" or not anthropic
                                 else "malformed_error_event")  # fmt: skip
    return codes


def _body(kind: str, model: str | None, rng: random.Random) -> tuple[str, dict[str, Any]]:
    """The route and body of one request of ``kind``."""
    body: dict[str, Any] = {} if model is None else {"model": model}
    tokens = rng.choice([1, 4, 16, 200])  # 200: long enough for a kill to land mid-stream
    hello = [{"role": "user", "content": "hi"}]
    if kind in ("complete", "stream"):
        return "/v1/completions", {**body, "prompt": "the cat", "max_tokens": tokens,
                                   "stream": kind == "stream"}  # fmt: skip
    if kind == "chat":
        return "/v1/chat/completions", {**body, "messages": hello, "max_tokens": 2}
    if kind == "messages":
        return "/v1/messages", {**body, "messages": hello, "max_tokens": tokens,
                                "stream": rng.random() < 0.5}  # fmt: skip
    if kind == "responses":
        return "/v1/responses", {**body, "input": "hi", "max_output_tokens": tokens,
                                 "stream": rng.random() < 0.5}  # fmt: skip
    if kind == "embed":
        return "/v1/embeddings", {**body, "input": "hi"}
    return f"/models/{kind}", {**body, "force": rng.random() < 0.5}


class _Tally:
    """What the clients saw: statuses overall and per kind, error codes, failures."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.statuses: Counter[int] = Counter()
        self.by_kind: defaultdict[str, Counter[int]] = defaultdict(Counter)
        self.codes: Counter[str] = Counter()
        self.failures: list[str] = []

    def covered(self) -> bool:
        """Whether every kind was served once and every sought code (in a body or a stream's
        error event) was seen."""
        seen = {code.removesuffix(" (in a stream)") for code in self.codes}
        served = all(self.by_kind.get(kind, {}).get(200) for kind in _SERVED)
        return served and self.plan.sought <= seen

    def fail(self, text: str) -> None:
        if len(self.failures) < 20:
            self.failures.append(text)

    def answer(self, kind: str, model: str | None, status: int, text: str) -> None:
        self.statuses[status] += 1
        self.by_kind[kind][status] += 1
        code = ""
        if status >= 400:
            with contextlib.suppress(ValueError):
                code = error_code(json.loads(text)) or ""
            self.codes[code or str(status)] += 1
        if status >= 500 and code not in self.plan.expected_5xx:
            self.fail(f"{kind} {model} -> {status} {code}: {text[:300]}")
        self.check_load(kind, model, code, text)

    def stream_error(self, kind: str, model: str | None, code: str, text: str) -> None:
        self.codes[f"{code} (in a stream)"] += 1
        if code not in self.plan.expected_5xx:
            self.fail(f"{kind} {model} -> error event {code}: {text[-300:]}")
        self.check_load(kind, model, code, text)

    def check_load(self, kind: str, model: str | None, code: str, text: str) -> None:
        # A model that loads is never reported failed, unless its process was killed loading.
        killed = self.plan.kills and "killed by SIGKILL" in text
        if code == LOAD_FAILED and model in self.plan.loadable and not killed:
            self.fail(f"{kind} {model} -> reported failed: {text[:300]}")


async def _request(client: httpx.AsyncClient, url: str, kind: str, model: str | None,
                   rng: random.Random, tally: _Tally) -> None:  # fmt: skip
    if kind == "list":
        answer = await client.get(url + "/v1/models")
        tally.answer(kind, model, answer.status_code, answer.text)
        return
    route, body = _body(kind, model, rng)
    if not body.get("stream"):
        answer = await client.post(url + route, json=body)
        tally.answer(kind, model, answer.status_code, answer.text)
        return
    async with client.stream("POST", url + route, json=body) as answer:
        events = rng.choice([0, 1, 3, 6, 10**6])  # dropped after so many (0: at once)
        lines: list[str] = []
        async for line in answer.aiter_lines():
            lines.append(line)
            events -= line.startswith("data: ")
            if events < 0:
                break  # leaving the block drops the connection
    text = "\n".join(lines)
    tally.answer(kind, model, answer.status_code, text)
    if answer.status_code == 200:
        for code in stream_errors(lines, anthropic=route == "/v1/messages"):
            tally.stream_error(kind, model, code, text)


def model_processes(server_pid: int) -> list[int]:
    """The pids of the server's isolated-entry processes that still run."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text().rsplit(") ", 1)[1].split()
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if int(stat[1]) == server_pid and stat[0] != "Z" and b"server._child" in cmdline:
            found.append(int(proc.name))
    return found


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (not our child: a zombie no one reaps counts as ended)."""
    try:
        return not Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return False


async def _killer(server_pid: int, churning: Callable[[], bool], rng: random.Random,
                  seen: set[int]) -> int:  # fmt: skip
    """SIGKILL a model process of the server every 0.2-1.5 s while ``churning()``; how many
    were killed."""
    kills = 0
    while churning():
        await asyncio.sleep(rng.uniform(0.2, 1.5))
        running = model_processes(server_pid)
        seen.update(running)
        if running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rng.choice(running), signal.SIGKILL)
                kills += 1
    return kills


async def _churn(server: ServerProcess, plan: Plan, clients: int, seconds: float,
                 seed: int, seen: set[int]) -> tuple[_Tally, int, float]:  # fmt: skip
    """What the clients saw, how many model processes were killed, and the seconds it ran."""
    rng = random.Random(seed)
    tally = _Tally(plan)
    start = time.monotonic()

    def churning() -> bool:
        """For ``seconds``, then up to twice as long again until the churn covered its plan
        (each kind served, each sought code seen: what the short runs' tests look for)."""
        elapsed = time.monotonic() - start
        return elapsed < seconds or (elapsed < 3 * seconds and not tally.covered())

    async with httpx.AsyncClient(timeout=120, headers=HEADERS) as client:

        async def one() -> None:
            while churning():
                try:
                    await _request(client, server.url, rng.choice(_KINDS),
                                   rng.choice(plan.names), rng, tally)  # fmt: skip
                except httpx.TransportError as error:
                    tally.fail(f"transport: {type(error).__name__}: {error}")

        killer = _killer(server.pid, churning, rng, seen) if plan.kills else asyncio.sleep(0, 0)
        *_, kills = await asyncio.gather(*(one() for _ in range(clients)), killer)
    return tally, kills, time.monotonic() - start


def _afterwards(server: ServerProcess, plan: Plan) -> dict[str, int]:
    """Each loadable model, loaded again (a load killed mid-way stays failed until then), then
    asked for a completion: its status."""
    answers = {}
    for name in plan.loadable:
        httpx.post(server.url + "/models/load", json={"model": name}, headers=HEADERS,
                   timeout=120)  # fmt: skip
        body = {"model": name, "prompt": "the cat", "max_tokens": 2, "min_tokens": 1}
        answer = httpx.post(server.url + "/v1/completions", json=body, headers=HEADERS,
                            timeout=120)  # fmt: skip
        answers[name] = answer.status_code
    return answers


def _churn_section(workdir: Path, plan: Plan, name: str, clients: int, seconds: float,
                   seed: int) -> dict[str, Any]:  # fmt: skip
    config = _registry_file(workdir, plan, name)
    flags = ["--models", str(config), "--api-key", KEY, "--n-threads", "1", "--chat-template",
             "chatml"]  # fmt: skip
    server = ServerProcess(flags, workdir / f"{name}.log")
    seen: set[int] = set()
    try:
        tally, kills, ran = asyncio.run(_churn(server, plan, clients, seconds, seed, seen))
        answers = _afterwards(server, plan)
        seen.update(model_processes(server.pid))
    finally:
        exit_info = server.close()
    deadline = time.monotonic() + 15  # a model process ends when it sees its server gone
    while any(_running(pid) for pid in seen) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = sorted(pid for pid in seen if _running(pid))
    result = {
        "clients": clients,
        "seconds": seconds,
        "ran_seconds": round(ran, 1),  # longer until every kind was served, every code seen
        "requests": sum(tally.statuses.values()),
        "statuses": status_counts(tally.statuses),
        "by_kind": {kind: status_counts(c) for kind, c in sorted(tally.by_kind.items())},
        "codes": dict(tally.codes.most_common()),
        "server_errors": len(tally.failures),
        "failures": tally.failures,
        "afterwards": answers,
        "model_processes": len(seen),
        "killed": kills,
        "left_running": left,
        "server": exit_info,
        "crashes": int(exit_info["crashed"] or exit_info["signal_death"]),
        "hangs": int(exit_info["hung_at_exit"]),
    }
    result["ok"] = (
        not tally.failures and not exit_info["tracebacks"]
        and all(status == 200 for status in answers.values())
        and result["crashes"] == result["hangs"] == 0 and not left
    )  # fmt: skip
    return result


def model_churn(
    workdir: Path, clients: int = 16, seconds: float = 15, seed: int = 0
) -> dict[str, Any]:
    """The ``models`` section: ``clients`` clients for ``seconds`` against MODELS."""
    return _churn_section(workdir, MODELS, "churn", clients, seconds, seed)


def isolated_churn(
    workdir: Path, clients: int = 16, seconds: float = 15, seed: int = 0
) -> dict[str, Any]:
    """The ``isolated`` section: ``clients`` clients for ``seconds`` against ISOLATED, model
    processes killed meanwhile."""
    return _churn_section(workdir, ISOLATED, "isolated", clients, seconds, seed)
