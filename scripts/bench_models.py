"""The multi-model section of the benchmark suite (``python scripts/bench.py --sections models``):
the multi-model server against llama-server's router mode on the same files.

Two models (Gemma 3 270M under two names, so each is its own load) in a --models-dir, served by
``llamacrab serve --models-dir`` and by ``llama-server --models-dir`` (router mode: a child
process per model), both with -c 1024, one slot and the suite's threads. Per round and server,
each a streamed one-token /v1/completions, timed to its first token:
- cold load: the first request to a model that is not loaded (load + prompt + first token);
- warm switch: --models-max 2, both loaded, requests alternating between them;
- switch with eviction: --models-max 1, alternating, so each request unloads one model and
  loads the other before its first token.
A round's value is the median of its requests (one cold load, four switches of each kind).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cache import free_port
from bench_server import Running

NAMES = ("gemma-a", "gemma-b")
Starter = Callable[[Path, int, int], Running]  # (models folder, threads, --models-max)
SWITCHES = 4


def first_token(url: str, model: str) -> float:
    """Seconds from sending a streamed one-token completion to its first content event."""
    body = {"model": model, "prompt": "Paris is the capital of", "max_tokens": 1,
            "temperature": 0, "stream": True}  # fmt: skip
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.perf_counter() - start
    raise RuntimeError(f"{model}: no token")


def llamacrab_server(folder: Path, threads: int, most: int) -> Running:
    port = free_port()
    return Running([sys.executable, "-m", "llamacrab.server", "--models-dir", str(folder),
                    "--models-max", str(most), "--n-threads", str(threads), "--n-ctx", "1024",
                    "--parallel", "1", "--port", str(port)], port)  # fmt: skip


def native_server(binary: Path) -> Starter:
    def start(folder: Path, threads: int, most: int) -> Running:
        port = free_port()
        return Running([str(binary), "--models-dir", str(folder), "--models-max", str(most),
                        "-t", str(threads), "-tb", str(threads), "-c", "1024", "-np", "1",
                        "--host", "127.0.0.1", "--port", str(port)], port)  # fmt: skip

    return start


def measure(start: Starter, folder: Path, threads: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"cold load": [], "warm switch": [], "switch with eviction": []}
    with start(folder, threads, 2) as server:
        out["cold load"].append(first_token(server.url, NAMES[0]))
        first_token(server.url, NAMES[1])  # both loaded now
        for i in range(SWITCHES):
            out["warm switch"].append(first_token(server.url, NAMES[i % 2]))
    with start(folder, threads, 1) as server:
        first_token(server.url, NAMES[0])
        for i in range(SWITCHES):
            out["switch with eviction"].append(first_token(server.url, NAMES[(i + 1) % 2]))
    return out


def models_folder(model: Path) -> Path:
    """A folder serving ``model`` under each of NAMES (links, so each name is its own load)."""
    folder = Path(tempfile.mkdtemp(prefix="bench-models-"))
    for name in NAMES:
        (folder / f"{name}.gguf").symlink_to(model)
    return folder


def round_row(start: Starter, folder: Path, threads: int) -> dict[str, float]:
    """One round of one server: each measure's median, in seconds."""
    rows = measure(start, folder, threads)
    return {f"models {key} s": statistics.median(values) for key, values in rows.items()}
