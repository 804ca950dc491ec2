"""The server under load and faults, and memory leaks: sections of the reliability suite.

Usage: python scripts/reliability_server.py [--long] [--json OUT] [--workdir DIR] [--markdown]

``run_server_sections(short)`` runs every section and returns its counts (scripts/reliability.py
writes them into RELIABILITY.md; tests/test_reliability_server.py runs the short versions in CI):

- ``load``: 64 concurrent clients (httpx, asyncio) for 15 s (long: 60 s) mixing completions,
  streamed chat, embeddings (a second server, all-MiniLM-L6-v2) and tokenization: every request
  answered, no 5xx, every stream ends with ``data: [DONE]``, each server's RSS stable after
  warm-up.
- ``disconnect_storm``: 100 streams dropped mid-way (some while still queued for a slot): every
  slot free, and the queue empty, within a second of the last drop.
- ``models`` and ``isolated``: 16 clients against a server of several models under churn, the
  second with models in processes of their own killed at random moments
  (scripts/reliability_models.py).
- ``lora_mix``: per-request LoRA sets on two slots, one request in four with a scale that
  overflows: every other request answers the Python API's text (scripts/reliability_lora.py).
- ``schemathesis``: requests generated from ``/openapi.json`` for every operation, valid and
  invalid: no 5xx.
- ``leaks``: short completions (``max_tokens=1``) through the Python API and through the server:
  RSS growth after warm-up under 5 MB per 10,000 (long: 10,000 each; short: fewer, bound in
  proportion).

Each server is a process of its own on loopback (its RSS is its own, and a signal death is
seen), and a traceback in its log fails its section; every loop is bounded by a count or a
deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import convert_bert  # noqa: E402
from reliability_lora import lora_mix  # noqa: E402
from reliability_models import isolated_churn, model_churn  # noqa: E402
from server_process import (  # noqa: E402
    ServerProcess,
    kept_or_temporary,
    server_errors,
    status_counts,
    tiny_model,
)

MIB = 1024 * 1024
# The bound: 10,000 short completions grow RSS by less than 5 MB.
LEAK_BOUND_BYTES = 5_000_000
LEAK_BOUND_PER = 10_000
# Growth of a server's RSS between the end of warm-up and the end of the load test that still
# counts as stable: allocator arenas of the worker threads settle in the first quarter; a leak
# of one small object per request (~100,000 requests in a long run) shows well above this.
LOAD_RSS_BOUND_BYTES = 16 * MIB


def generation_flags(model: Path, parallel: int, **extra: object) -> list[str]:
    """Flags of a tiny-model server: chatml for chat, one thread per core at most."""
    flags = [str(model), "--model-alias", "tiny", "--parallel", str(parallel), "--n-ctx",
             str(parallel * 512), "--n-threads", "1", "--chat-template", "chatml"]  # fmt: skip
    for name, value in extra.items():
        flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


# -- load ----------------------------------------------------------------------------------------


class BrokenStreamError(Exception):
    """A stream whose connection broke after its answer began (not a keep-alive race)."""


async def _completion(client: httpx.AsyncClient, urls: dict[str, str], tag: str) -> int | None:
    body = {"prompt": f"the cat sat on the mat {tag}", "max_tokens": 8, "temperature": 0.7}
    answer = await client.post(urls["gen"] + "/v1/completions", json=body)
    if answer.status_code != 200:
        return answer.status_code
    choices = answer.json()["choices"]
    return 200 if len(choices) == 1 and isinstance(choices[0]["text"], str) else None


async def _chat_stream(client: httpx.AsyncClient, urls: dict[str, str], tag: str) -> int | None:
    body = {"messages": [{"role": "user", "content": f"hello {tag}"}], "max_tokens": 8,
            "stream": True}  # fmt: skip
    events: list[str] = []
    async with client.stream("POST", urls["gen"] + "/v1/chat/completions", json=body) as answer:
        try:
            async for line in answer.aiter_lines():
                if line.startswith("data: "):
                    events.append(line)
        except httpx.HTTPError as error:
            raise BrokenStreamError(f"{type(error).__name__} after {len(events)} events: "
                                    f"{error}") from error  # fmt: skip
    if answer.status_code != 200:
        return answer.status_code
    if not events or events[-1] != "data: [DONE]":
        return None  # a stream must end with [DONE]
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    if any("error" in c for c in chunks) or chunks[-1]["choices"][0]["finish_reason"] is None:
        return None
    return 200


async def _embeddings(client: httpx.AsyncClient, urls: dict[str, str], tag: str) -> int | None:
    body = {"input": [f"a cat number {tag}", "the stock market"], "encoding_format": "float"}
    answer = await client.post(urls["emb"] + "/v1/embeddings", json=body)
    if answer.status_code != 200:
        return answer.status_code
    data = answer.json()["data"]
    return 200 if [len(d["embedding"]) for d in data] == [384, 384] else None


async def _tokenize(client: httpx.AsyncClient, urls: dict[str, str], tag: str) -> int | None:
    if hash(tag) % 2:  # ours and llama-server's route
        answer = await client.post(urls["gen"] + "/extras/tokenize", json={"input": f"hi {tag}"})
    else:
        answer = await client.post(urls["gen"] + "/tokenize", json={"content": f"hi {tag}"})
    if answer.status_code != 200:
        return answer.status_code
    tokens = answer.json()["tokens"]
    return 200 if tokens and all(isinstance(t, int) for t in tokens) else None


_KINDS: dict[str, Callable[[httpx.AsyncClient, dict[str, str], str], Awaitable[int | None]]] = {
    "completion": _completion,
    "chat_stream": _chat_stream,
    "embeddings": _embeddings,
    "tokenize": _tokenize,
}


def _percentile_ms(values: list[float], percent: int) -> float | None:
    if len(values) < 2:
        return None
    return round(1000 * statistics.quantiles(values, n=100)[percent - 1], 1)


def _rss_growth(samples: list[tuple[float, int]], seconds: float) -> dict[str, float]:
    """RSS (MiB) at the end of warm-up (median over the second quarter of the run), at the end
    (median over the last tenth) and its peak."""

    def median(lo: float, hi: float) -> int:
        window = [r for t, r in samples if lo * seconds <= t <= hi * seconds]
        return int(statistics.median(window)) if window else samples[-1][1]

    warm, end = median(0.25, 0.5), median(0.9, 1.1)
    return {"after_warm_up_mib": round(warm / MIB, 2), "end_mib": round(end / MIB, 2),
            "peak_mib": round(max(r for _, r in samples) / MIB, 2),
            "growth_mib": round((end - warm) / MIB, 2)}  # fmt: skip


async def _load(servers: dict[str, ServerProcess], clients: int, seconds: float) -> dict[str, Any]:
    urls = {name: server.url for name, server in servers.items()}
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + seconds
    statuses: Counter[int] = Counter()
    kinds: Counter[str] = Counter()
    unanswered: list[str] = []
    malformed: list[str] = []
    latencies: list[float] = []
    rss: dict[str, list[tuple[float, int]]] = {name: [] for name in servers}

    async def sample_rss() -> None:
        while loop.time() < deadline:
            for name, server in servers.items():
                rss[name].append((loop.time() - started, server.rss()))
            await asyncio.sleep(0.25)

    # Idle connections are dropped before the server's keep-alive timeout (uvicorn: 5 s) could
    # close one under a request being sent on it.
    limits = httpx.Limits(max_connections=2 * clients, max_keepalive_connections=2 * clients,
                          keepalive_expiry=2.0)  # fmt: skip
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def worker(k: int) -> None:
            i = 0
            names = list(_KINDS)
            while loop.time() < deadline:
                kind = names[(k + i) % len(names)]
                i += 1
                began = time.perf_counter()
                kinds[kind] += 1
                try:
                    status = await _KINDS[kind](client, urls, f"{k}-{i}")
                except (httpx.HTTPError, BrokenStreamError, json.JSONDecodeError,
                        KeyError) as error:  # fmt: skip
                    unanswered.append(f"{kind}: {type(error).__name__}: {error}")
                    continue
                latencies.append(time.perf_counter() - began)
                if status is None:
                    malformed.append(kind)
                    status = 200
                statuses[status] += 1

        sampler = asyncio.ensure_future(sample_rss())
        await asyncio.gather(*(worker(k) for k in range(clients)))
        await sampler
    elapsed = loop.time() - started
    requests = sum(kinds.values())
    growth = {name: _rss_growth(samples, seconds) for name, samples in rss.items()}
    worst = max(g["growth_mib"] for g in growth.values())
    return {
        "clients": clients,
        "seconds": round(elapsed, 1),
        "requests": requests,
        "by_kind": dict(kinds),
        "statuses": status_counts(statuses),
        "server_errors": server_errors(statuses),
        "unanswered": len(unanswered),
        "unanswered_examples": unanswered[:5],
        "malformed": len(malformed),
        "requests_per_second": round(requests / elapsed, 1),
        "latency_p50_ms": _percentile_ms(latencies, 50),
        "latency_p99_ms": _percentile_ms(latencies, 99),
        "rss": growth,
        "rss_growth_mib": worst,
        "rss_bound_mib": LOAD_RSS_BOUND_BYTES / MIB,
    }


def load_test(workdir: Path, clients: int = 64, seconds: float = 15) -> dict[str, Any]:
    """``clients`` concurrent clients for ``seconds`` against a tiny-model server (4 slots) and a
    MiniLM embeddings server."""
    model = tiny_model(workdir)
    gen = ServerProcess(generation_flags(model, 4, max_queue=4 * clients),
                        workdir / "load-gen.log")  # fmt: skip
    try:
        flags = [str(convert_bert.minilm()), "--model-alias", "minilm", "--embeddings",
                 "--n-threads", "1"]  # fmt: skip
        emb = ServerProcess(flags, workdir / "load-emb.log")
    except BaseException:
        gen.close()
        raise
    servers = {"gen": gen, "emb": emb}
    try:
        result = asyncio.run(_load(servers, clients, seconds))
    finally:
        exits = {name: server.close() for name, server in servers.items()}
    result["servers"] = exits
    result["crashes"] = sum(e["crashed"] or e["signal_death"] for e in exits.values())
    result["hangs"] = sum(e["hung_at_exit"] for e in exits.values())
    result["ok"] = (
        result["server_errors"] == result["unanswered"] == result["malformed"] == 0
        and result["crashes"] == result["hangs"] == 0
        and not any(e["tracebacks"] for e in exits.values())
        and result["rss_growth_mib"] * MIB < LOAD_RSS_BOUND_BYTES
    )
    return result


# -- disconnect storm ----------------------------------------------------------------------------


def _gauges(url: str) -> tuple[int, int]:
    text = httpx.get(url + "/metrics", timeout=10).text
    busy = re.search(r"^llamacrab_slots_busy (\d+)", text, re.MULTILINE)
    queued = re.search(r"^llamacrab_queue_depth (\d+)", text, re.MULTILINE)
    assert busy is not None and queued is not None, text
    return int(busy.group(1)), int(queued.group(1))


async def _storm(url: str, streams: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    # Each would run 1,500 tokens (seconds per slot): only dropping it frees its slot in time.
    body = {"prompt": "the cat", "max_tokens": 1500, "min_tokens": 1500, "stream": True}
    statuses: Counter[int] = Counter()
    dropped = Counter[str]()
    limits = httpx.Limits(max_connections=2 * streams, max_keepalive_connections=0)

    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def one(i: int) -> None:
            # A quarter give up while queued (before their first event), at a random moment;
            # the rest read 1-5 events and leave mid-stream.
            if i % 4 == 0:
                try:
                    await asyncio.wait_for(read(rng.randint(1, 5)), timeout=rng.uniform(0, 0.5))
                except asyncio.TimeoutError:
                    dropped["before_first_event"] += 1
                    return
            else:
                await read(rng.randint(1, 5))
            dropped["mid_stream"] += 1

        async def read(events: int) -> None:
            async with client.stream("POST", url + "/v1/completions", json=body) as answer:
                statuses[answer.status_code] += 1
                seen = 0
                async for line in answer.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= events:
                        break  # leaving the block drops the connection mid-stream

        await asyncio.gather(*(one(i) for i in range(streams)))
    return {"statuses": statuses, "dropped": dropped}


def disconnect_storm(workdir: Path, streams: int = 100, seed: int = 0) -> dict[str, Any]:
    """``streams`` streams against an 8-slot server, each dropped mid-way (or while queued);
    how long after the last drop every slot is free and the queue empty."""
    server = ServerProcess(generation_flags(tiny_model(workdir), 8, max_queue=2 * streams),
                           workdir / "storm.log")  # fmt: skip
    try:
        rss_before = server.rss()
        storm = asyncio.run(_storm(server.url, streams, seed))
        last_drop = time.perf_counter()
        free_after = None
        while time.perf_counter() - last_drop < 30:
            if _gauges(server.url) == (0, 0):
                free_after = time.perf_counter() - last_drop
                break
            time.sleep(0.01)
        follow = httpx.post(server.url + "/v1/completions", timeout=60,
                            json={"prompt": "hello", "max_tokens": 4})  # fmt: skip
        statuses: Counter[int] = storm["statuses"]
        statuses[follow.status_code] += 1
        rss_after = server.rss()
    finally:
        exit_info = server.close()
    result = {
        "streams": streams,
        "dropped_mid_stream": storm["dropped"]["mid_stream"],
        "dropped_while_queued": storm["dropped"]["before_first_event"],
        "statuses": status_counts(statuses),
        "server_errors": server_errors(statuses),
        "slots_free_after_s": None if free_after is None else round(free_after, 3),
        "follow_up_status": follow.status_code,
        "rss_growth_mib": round((rss_after - rss_before) / MIB, 2),
        "server": exit_info,
        "crashes": int(exit_info["crashed"] or exit_info["signal_death"]),
        "hangs": int(exit_info["hung_at_exit"]),
    }
    result["ok"] = (
        free_after is not None and free_after <= 1.0 and result["server_errors"] == 0
        and follow.status_code == 200 and result["crashes"] == result["hangs"] == 0
        and not exit_info["tracebacks"]
    )  # fmt: skip
    return result


# -- schemathesis --------------------------------------------------------------------------------


def _examples(
    strategy: Any, label: str, url: str, max_examples: int, seed: int,
    statuses: Counter[int], failures: list[str],
) -> None:  # fmt: skip
    """Send ``max_examples`` cases drawn from ``strategy``; count each answer's status."""
    import hypothesis

    @hypothesis.settings(
        max_examples=max_examples, deadline=None, database=None, derandomize=True,
        suppress_health_check=list(hypothesis.HealthCheck),
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
    )  # fmt: skip
    @hypothesis.given(case=strategy)
    @hypothesis.seed(seed)
    def call(case: Any) -> None:
        response = case.call(base_url=url, timeout=60)
        statuses[response.status_code] += 1
        if response.status_code >= 500 and len(failures) < 20:
            failures.append(f"{label} -> {response.status_code}: {response.text[:300]}")

    call()


def schemathesis_run(workdir: Path, max_examples: int = 10, seed: int = 0) -> dict[str, Any]:
    """Requests generated by schemathesis from the server's /openapi.json, valid (positive) and
    invalid (negative), ``max_examples`` of each per operation: none may get a 5xx."""
    import hypothesis
    import schemathesis
    from schemathesis import GenerationMode

    # Small limits keep every generated request short (a generated max_tokens or n is capped);
    # slot files are enabled so that their routes run too (otherwise they answer 501).
    slots = workdir / "schemathesis-slots"
    slots.mkdir(exist_ok=True)
    flags = generation_flags(tiny_model(workdir), 2, max_tokens_limit=16, max_n=2,
                             slot_save_path=slots)  # fmt: skip
    server = ServerProcess(flags, workdir / "schemathesis.log")
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    operations = 0
    try:
        schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
        for found in schema.get_all_operations():
            operation = found.ok()
            operations += 1
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                strategy = operation.as_strategy(generation_mode=mode)
                # Unsatisfiable: nothing (of this mode) to generate for this operation.
                with contextlib.suppress(hypothesis.errors.Unsatisfiable):
                    _examples(strategy, operation.label, server.url, max_examples, seed,
                              statuses, failures)  # fmt: skip
    finally:
        exit_info = server.close()
    result = {
        "operations": operations,
        "cases": sum(statuses.values()),
        "max_examples": max_examples,
        "statuses": status_counts(statuses),
        "server_errors": server_errors(statuses),
        "failures": failures,
        "server": exit_info,
        "crashes": int(exit_info["crashed"] or exit_info["signal_death"]),
        "hangs": int(exit_info["hung_at_exit"]),
    }
    result["ok"] = (
        result["server_errors"] == result["crashes"] == result["hangs"] == 0
        and not exit_info["tracebacks"]
    )
    return result


# -- leaks ---------------------------------------------------------------------------------------

# The Python API in a child of its own: its RSS is only the library's.
_LEAK_CHILD = textwrap.dedent("""\
    import gc, json, sys
    from llamacrab import Llama
    path, warm_up, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024

    with Llama(path, n_ctx=256, n_threads=1) as llm:
        for i in range(warm_up):
            llm.create_completion(f"the cat sat {i}", max_tokens=1)
        gc.collect()
        before = rss()
        for i in range(count):
            llm.create_completion(f"the dog sat on the mat {i}", max_tokens=1)
        gc.collect()
        print(json.dumps({"before": before, "after": rss()}))
""")


def _leak_verdict(count: int, before: int, after: int, seconds: float) -> dict[str, Any]:
    bound = LEAK_BOUND_BYTES * count / LEAK_BOUND_PER
    return {"completions": count, "seconds": round(seconds, 1),
            "rss_before_mib": round(before / MIB, 2), "rss_after_mib": round(after / MIB, 2),
            "rss_growth_mib": round((after - before) / MIB, 3),
            "bound_mib": round(bound / MIB, 3), "ok": after - before < bound}  # fmt: skip


def leak_test(workdir: Path, count: int = 10_000, warm_up: int = 1_000) -> dict[str, Any]:
    """``count`` completions of one token each, after ``warm_up`` more, through the Python API
    (a child process) and through a one-slot server; the RSS growth of each."""
    model = tiny_model(workdir)
    started = time.perf_counter()
    child = subprocess.run([sys.executable, "-c", _LEAK_CHILD, str(model), str(warm_up),
                            str(count)], capture_output=True, text=True, timeout=1800)  # fmt: skip
    if child.returncode != 0:
        library: dict[str, Any] = {"ok": False, "exit_code": child.returncode,
                                   "error": child.stderr[-2000:]}  # fmt: skip
    else:
        measured = json.loads(child.stdout.strip().splitlines()[-1])
        library = _leak_verdict(count, measured["before"], measured["after"],
                                time.perf_counter() - started)  # fmt: skip

    server = ServerProcess(generation_flags(model, 1), workdir / "leaks.log")
    statuses: Counter[int] = Counter()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:

            def complete(i: int, word: str) -> None:
                body = {"prompt": f"the {word} sat {i}", "max_tokens": 1}
                statuses[client.post("/v1/completions", json=body).status_code] += 1

            for i in range(warm_up):
                complete(i, "cat")
            before, started = server.rss(), time.perf_counter()
            for i in range(count):
                complete(i, "dog")
            after = server.rss()
    finally:
        exit_info = server.close()
    served = _leak_verdict(count, before, after, time.perf_counter() - started)
    served["statuses"] = status_counts(statuses)
    served["ok"] = served["ok"] and set(statuses) == {200}
    return {
        "library": library,
        "server": served,
        "crashes": int(child.returncode < 0)
        + int(exit_info["crashed"] or exit_info["signal_death"]),
        "server_errors": server_errors(statuses),
        "ok": library["ok"]
        and served["ok"]
        and not exit_info["crashed"]
        and not exit_info["tracebacks"],
    }


# -- all sections --------------------------------------------------------------------------------

SHORT = {
    "load_seconds": 15.0,
    "schemathesis_examples": 5,
    "leak_count": 2_000,
    "churn_seconds": 15.0,
    "lora_seconds": 15.0,
}
LONG = {
    "load_seconds": 60.0,
    "schemathesis_examples": 50,
    "leak_count": 10_000,
    "churn_seconds": 120.0,
    "lora_seconds": 120.0,
}


def run_server_sections(
    short: bool = True, workdir: Path | None = None, seed: int = 0
) -> dict[str, Any]:
    """Every section (short: CI's sizes; long: the issue's), as a dict of counts per section;
    ``ok`` overall and per section. ``workdir`` keeps the models and server logs (default: a
    temporary directory); ``seed`` draws the storm's drop points and schemathesis' requests."""
    sizes = SHORT if short else LONG
    with kept_or_temporary(workdir) as work:
        sections = {
            "load": load_test(work, 64, sizes["load_seconds"]),
            "disconnect_storm": disconnect_storm(work, 100, seed),
            "models": model_churn(work, 16, sizes["churn_seconds"], seed),
            "isolated": isolated_churn(work, 16, sizes["churn_seconds"], seed),
            "lora_mix": lora_mix(work, 3, sizes["lora_seconds"], seed),
            "schemathesis": schemathesis_run(work, int(sizes["schemathesis_examples"]), seed),
            "leaks": leak_test(work, int(sizes["leak_count"]), warm_up=1_000),
        }
    return {"short": short, **sections, "ok": all(s["ok"] for s in sections.values())}


def _churn_row(name: str, churn: dict[str, Any], models: str) -> tuple[object, ...]:
    codes = ", ".join(f"{n} x {code}" for code, n in churn["codes"].items())
    afterwards = ", ".join(f"{m} {s}" for m, s in churn["afterwards"].items())
    return (name, f"{churn['requests']:,} requests, {churn['clients']} clients, "
            f"{churn['ran_seconds']:.0f} s, {models}", churn["crashes"], churn["hangs"],
            churn["server_errors"], f"{codes}; afterwards {afterwards}")  # fmt: skip


def lora_row(mix: dict[str, Any]) -> tuple[object, ...]:
    verdicts = Counter(mix["verdicts"])
    return ("LoRA mix", f"{mix['requests']:,} completions, {mix['clients']} clients, "
            f"{mix['seconds']:.0f} s, 2 slots", mix["crashes"], mix["hangs"],
            mix["server_errors"], f"{verdicts['right']:,} of a set, each the Python API's "
            f"text, {verdicts['wrong']} not; overflowing: {verdicts['overflow_refused']:,} "
            f"refused (400), {verdicts['overflow_answered']} of 1e30 answered from its finite "
            "nonsense")  # fmt: skip


def server_sections_markdown(result: dict[str, Any]) -> str:
    """A Markdown section for RELIABILITY.md from ``run_server_sections``' result."""
    load, storm, churn = result["load"], result["disconnect_storm"], result["models"]
    isolated = result["isolated"]
    fuzz, leaks, mix = result["schemathesis"], result["leaks"], result["lora_mix"]
    size = "short" if result["short"] else "long"
    rows = [
        ("load", f"{load['requests']:,} requests, {load['clients']} clients, "
         f"{load['seconds']:.0f} s ({load['requests_per_second']:.0f}/s)",
         load["crashes"], load["hangs"], load["server_errors"],
         f"{load['unanswered']} unanswered, {load['malformed']} malformed; RSS +"
         f"{load['rss']['gen']['growth_mib']:.2f} MiB (generation), "
         f"+{load['rss']['emb']['growth_mib']:.2f} MiB (embeddings) after warm-up"),
        ("disconnect storm", f"{storm['streams']} streams dropped "
         f"({storm['dropped_while_queued']} while queued)", storm["crashes"], storm["hangs"],
         storm["server_errors"], f"every slot free {storm['slots_free_after_s']} s after the "
         "last drop"),
        _churn_row("models", churn, "4 models with room for 1"),
        _churn_row("isolated", isolated, "3 models in processes of their own and 1 in the "
                   f"server's, room for 2; {isolated['killed']} model processes killed"),
        lora_row(mix),
        ("schemathesis", f"{fuzz['cases']:,} generated requests, {fuzz['operations']} "
         "operations", fuzz["crashes"], fuzz["hangs"], fuzz["server_errors"],
         ", ".join(f"{n} x {status}" for status, n in fuzz["statuses"].items())),
        ("leaks", f"{leaks['library']['completions']:,} + {leaks['server']['completions']:,} "
         "one-token completions (library + server)", leaks["crashes"], 0,
         leaks["server_errors"], f"RSS +{leaks['library']['rss_growth_mib']:.3f} MiB (library), "
         f"+{leaks['server']['rss_growth_mib']:.3f} MiB (server); bound "
         f"{leaks['server']['bound_mib']:.2f} MiB"),
    ]  # fmt: skip
    lines = [
        f"## The server under load and faults, and leaks ({size})",
        "",
        "`scripts/reliability_server.py` (`run_server_sections`); each server its own process "
        "on loopback.",
        "",
        "| section | cases | signal deaths | hangs | 5xx | notes |",
        "| --- | --- | --- | --- | --- | --- |",
        *(f"| {' | '.join(str(c) for c in row)} |" for row in rows),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", action="store_true", help="the issue's sizes (several minutes)")
    parser.add_argument("--json", type=Path, help="write the counts here")
    parser.add_argument("--workdir", type=Path, help="keep models and server logs here")
    parser.add_argument("--markdown", action="store_true", help="print the report's section")
    parser.add_argument("--seed", type=int, default=0, help="a fresh set of generated cases")
    args = parser.parse_args()
    result = run_server_sections(short=not args.long, workdir=args.workdir, seed=args.seed)
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(server_sections_markdown(result) if args.markdown else text)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    main()
