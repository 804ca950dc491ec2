"""Prefill and decode on a GPU: llamacrab beside native llama.cpp from the same build.

Usage: python scripts/bench_gpu.py --prefix DIR --model MODEL.gguf [--rounds 7] [--threads 4]
                                   [--out DIR]

DIR is the llama.cpp install llamacrab-sys was built against (LLAMACRAB_LLAMA_CPP_PREFIX: a
`cmake --install`-shaped tree with a GPU backend, and llama-bench in its bin/), so both sides run
the same machine code; scripts/gpu_check.sh makes both. Every side offloads every layer
(llama.cpp's default). Each round runs, the side going first alternating:

- native: llama-bench (pp512; tg128 at a depth of 512, where the others decode) and the C loop of
  scripts/bench/native_loop.c (prefill, then greedy decode sampled on the CPU, as llama.cpp's
  own examples do);
- llamacrab: the benchmark worker's speed task, greedy and with llama.cpp's default top-k/top-p
  chain, each with the chain on the CPU (graph_sampling="off") and inside the compute graph
  ("on"; what "auto" picks where the output layer is on a GPU).

Prints and writes (gpu.json, gpu.md under --out) the medians, each metric's min-max over rounds
and the per-round llamacrab / native ratios, as scripts/bench.py does.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import bench
from bench import CRAB, N_GEN, NATIVE, TOP_K, Row

from llamacrab import Model, ModelParams


class GpuRounds:
    def __init__(self, prefix: Path, model: Path, threads: int) -> None:
        self.model, self.threads = model, threads
        self.llama_bench = prefix / "bin" / "llama-bench"
        # Linked to the install's own, upstream-named libraries.
        self.loop = bench.compile_native_loop(prefix / "include", prefix / "lib",
                                              ["-lllama", "-lggml", "-lggml-base"],
                                              Path(tempfile.mkdtemp()) / "native_loop")  # fmt: skip
        with Model.load(model, ModelParams(vocab_only=True)) as loaded:
            vocab = loaded.vocab
            assert vocab.bos is not None
            self.prompt = bench.synthetic_prompt(vocab.bos, vocab.n_tokens)
            self.banned = list(vocab.eog_tokens)

    def native(self) -> Row:
        tools = bench.llama_bench(self.llama_bench, self.model, self.threads)
        loop = bench.native_loop(self.loop, self.model, self.threads, N_GEN)
        return {"prefill t/s": tools["pp"], "decode t/s": loop["tg"],
                "llama-bench tg t/s": tools["tg"]}  # fmt: skip

    def _speed(self, **extra: object) -> Row:
        return bench.worker(
            Path(sys.executable), CRAB, "speed", model=str(self.model), threads=self.threads,
            prompt=self.prompt, n_gen=N_GEN, banned=self.banned, **extra,
        )  # fmt: skip

    def llamacrab(self) -> Row:
        greedy_cpu = self._speed(graph_sampling="off")
        return {
            "prefill t/s": greedy_cpu["pp"],
            "decode t/s": greedy_cpu["tg"],
            "decode in graph t/s": self._speed(graph_sampling="on")["tg"],
            "decode top-k t/s": self._speed(graph_sampling="off", sampling=TOP_K)["tg"],
            "decode top-k in graph t/s": self._speed(graph_sampling="on", sampling=TOP_K)["tg"],
        }

    def round(self, index: int) -> dict[str, Row]:
        sides = [(NATIVE, self.native), (CRAB, self.llamacrab)]
        if index % 2:
            sides.reverse()
        rows = {name: measure() for name, measure in sides}
        return {NATIVE: rows[NATIVE], CRAB: rows[CRAB]}


def gpu_name() -> str:
    try:
        query = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
        out = subprocess.run(query, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown GPU"
    return out.strip().replace("\n", "; ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=Path, required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--out", type=Path, default=bench.REPO / "benchmarks" / "results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    suite = GpuRounds(args.prefix.resolve(), args.model.resolve(), args.threads)
    rounds = []
    for index in range(args.rounds):
        rounds.append(suite.round(index))
        print(f"round {index + 1}: {json.dumps(rounds[-1])}", flush=True)
    result = bench.medians(rounds)
    heading = (
        f"GPU: {gpu_name()}; model {args.model.name}; {args.threads} threads; {args.rounds} rounds"
    )
    text = f"{heading}\n\n{bench.markdown(result)}\n{bench.spread(rounds)}"
    (args.out / "gpu.json").write_text(json.dumps({"rounds": rounds, "medians": result}, indent=2))
    (args.out / "gpu.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
