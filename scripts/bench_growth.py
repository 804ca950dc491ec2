"""How cost grows with the work: the suite sections context, clients and memory.

Run through scripts/bench.py (``--sections context,clients,memory``), which alternates the side
going first from round to round and reports medians, min-max and per-round ratios. Native
llama.cpp is built from the same source and options as llamacrab-sys.

- context: prefill t/s of a 512, 4096 and 16384-token prompt (``llama-bench -p S -n 0``, after
  a discarded 64-token test that warms the process up) and decode t/s of 128 tokens at a
  context depth of 0, 1024, 4096 and 16384 tokens (``llama-bench -p 0 -n 128 -d D``: no sampling);
  llamacrab: a ``Llama`` with llama.cpp's batch sizes (2048 / 512) and room for the size + 64
  tokens, warmed up by a 512-token prefill, then a prefill timed alone and 129 greedy tokens
  after it (end-of-generation tokens banned; timed from the first streamed token, so 128
  decodes at that depth, the prompt kept in memory). One size at a time, each side in a fresh
  process, the sides alternating size by size: the machine's speed drifts over minutes, and
  a 16384-token prefill takes one and a half.
- clients: the server at 1, 4, 8, 16, 32 and 64 streaming clients, 8 slots of 512 tokens, each
  client one 128-token completion (scripts/bench_server.py), beside llama-server with the same
  slots: aggregate tokens/s and the median and 95th-percentile time to first token.
- memory: the server's peak resident memory (VmHWM, after one 8-token completion) for each
  (context, slots) pair in MEMORY, beside llama-server with the same -c / -np.
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path

import bench_server
import httpx

PREFILL_SIZES = (512, 4096, 16384)
DEPTHS = (0, 1024, 4096, 16384)
DEPTH_TOKENS = 128  # a second or more at any depth: 32 tokens swung ±30% with the machine
CLIENTS = (1, 4, 8, 16, 32, 64)
MEMORY = ((2048, 1), (8192, 1), (32768, 1), (8192, 4), (32768, 8))

Row = dict[str, float]


def prefill_metric(size: int) -> str:
    return f"prefill {size} t/s"


def depth_metric(depth: int) -> str:
    return f"decode at depth {depth} t/s"


def memory_metric(context: int, slots: int) -> str:
    return f"memory ctx {context} x {slots} slots MiB"


def context_sizes() -> list[int]:
    """Every size the context section measures, a prefill size, a decode depth or both."""
    return sorted({*PREFILL_SIZES, *DEPTHS})


def native_context(llama_bench: Path, model: Path, threads: int, size: int) -> Row:
    """llama-bench's prefill of ``size`` tokens and decode at that depth, as the size is one
    or the other (one process each, -r 1)."""
    common = [str(llama_bench), "-m", str(model), "-t", str(threads), "-r", "1", "-o", "json"]
    row = {}
    if size in PREFILL_SIZES:
        prefill = _run_json([*common, "-p", f"64,{size}", "-n", "0", "--no-warmup"])
        row.update({prefill_metric(size): r["avg_ts"] for r in prefill if r["n_prompt"] == size})
    if size in DEPTHS:
        decode = _run_json([*common, "-p", "0", "-n", str(DEPTH_TOKENS), "-d", str(size)])
        row[depth_metric(size)] = decode[0]["avg_ts"]
    return row


Worker = Callable[..., dict[str, dict[str, float]]]


def crab_context(worker: Worker, python: Path, side: str, model: Path, threads: int,
                 size: int, banned: list[int], bos: int, n_vocab: int) -> Row:  # fmt: skip
    """``worker``: scripts/bench.py's runner of one worker task in a fresh process."""
    result = worker(python, side, "context", model=str(model), threads=threads,
                    prefill=[size] if size in PREFILL_SIZES else [],
                    depths=[size] if size in DEPTHS else [], n_gen=DEPTH_TOKENS + 1,
                    banned=banned, bos=bos, n_vocab=n_vocab)  # fmt: skip
    row = {prefill_metric(int(size)): value for size, value in result["prefill"].items()}
    row.update({depth_metric(int(depth)): value for depth, value in result["decode"].items()})
    return row


def clients_row(server: bench_server.Running, extra: dict[str, object]) -> Row:
    row: Row = {}
    for clients in CLIENTS:
        result = asyncio.run(bench_server.burst(server.url, clients, extra))
        row[f"clients {clients} tokens/s"] = result["tokens_per_s"]
        row[f"clients {clients} ttft p50 s"] = result["ttft_p50_s"]
        row[f"clients {clients} ttft p95 s"] = result["ttft_p95_s"]
    return row


def peak_rss_mib(server: bench_server.Running) -> float:
    """After one short completion: the server process's peak resident memory."""
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    httpx.post(server.url + "/v1/completions", json=body, timeout=120).raise_for_status()
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    match = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    if match is None:
        raise RuntimeError("no VmHWM in /proc/PID/status")
    return int(match.group(1)) / 1024


def _run_json(command: list[str]) -> list[dict[str, int | float]]:
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out)  # type: ignore[no-any-return]


# -- the report: a table and a plot per section ------------------------------------------------

# Which metrics each section reports, and what its plot draws (one panel per pattern).
METRICS = {
    "context": r"(prefill|decode at depth) \d+ t/s",
    "clients": r"clients \d+ .+",
    "memory": r"memory ctx \d+ x \d+ slots MiB",
}
PANELS = {
    "context": (r"prefill (\d+) t/s", r"decode at depth (\d+) t/s"),
    "clients": (r"clients (\d+) tokens/s", r"clients (\d+) ttft p95 s"),
    "memory": (r"memory ctx (\d+) x (\d+) slots MiB",),
}
TITLES = {
    "context": "Prefill and decode as the context grows",
    "clients": "The server as clients grow, 8 slots",
    "memory": "Server peak RSS against context and slots",
}


def section_of(metric: str) -> str | None:
    return next((name for name, rule in METRICS.items() if re.fullmatch(rule, metric)), None)


def plot(section: str, medians: dict[str, Row], path: Path) -> bool:
    """One figure per section: each side's median against the size; False when no data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    patterns = PANELS[section]
    series = [_series(pattern, medians) for pattern in patterns]
    if not any(series):
        return False
    figure, axes = plt.subplots(1, len(patterns), figsize=(5.5 * len(patterns), 3.8))
    for axis, pattern, lines in zip(
        [axes] if len(patterns) == 1 else axes, patterns, series, strict=True
    ):
        for side, points in lines.items():
            labels, values = zip(*points, strict=True)
            axis.plot(range(len(values)), values, marker="o", label=side)
            axis.set_xticks(range(len(values)), labels)
        axis.set_title(pattern.replace(r"(\d+)", "N").replace("\\", ""), fontsize=10)
        if pattern.endswith(" s"):  # waits span 0.04 s to minutes: a log scale shows each
            axis.set_yscale("log")
        else:
            axis.set_ylim(bottom=0)  # ratios read true: no axis cut off below the data
        axis.legend()
        axis.grid(alpha=0.3)
    figure.suptitle(TITLES[section])
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def _series(pattern: str, medians: dict[str, Row]) -> dict[str, list[tuple[str, float]]]:
    lines: dict[str, list[tuple[str, float]]] = {}
    for side, row in medians.items():
        points = []
        for metric, value in row.items():
            match = re.fullmatch(pattern, metric)
            if match:
                points.append(("x".join(match.groups()), value))
        if points:
            lines[side] = points
    return lines


def markdown_table(metrics: list[str], rounds: list[dict[str, Row]], native: str, crab: str) -> str:
    """Medians, min-max and per-round ratios of ``metrics`` (llamacrab / native)."""
    lines = ["| metric | native median (min-max) | llamacrab median (min-max) | ratio "
             "| per round |", "| --- | ---: | ---: | ---: | --- |"]  # fmt: skip
    for metric in metrics:
        values = {side: [r[side][metric] for r in rounds if metric in r.get(side, {})]
                  for side in (native, crab)}  # fmt: skip
        if not values[native] or not values[crab]:
            continue
        per_round = [r[crab][metric] / r[native][metric] for r in rounds
                     if metric in r.get(crab, {}) and r.get(native, {}).get(metric)]  # fmt: skip
        ratio = statistics.median(values[crab]) / statistics.median(values[native])
        lines.append(f"| {metric} | {_cell(values[native])} | {_cell(values[crab])} | "
                     f"{ratio:.3f} | {', '.join(f'{x:.2f}' for x in per_round)} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _cell(values: list[float]) -> str:
    return f"{_num(statistics.median(values))} ({_num(min(values))}-{_num(max(values))})"


def _num(value: float) -> str:
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def goals(section: str, medians: dict[str, Row], native: str, crab: str) -> str:
    """The issue's targets for a section, checked on the medians (a ratio that one round
    contradicts is still noise: read the per-round column)."""
    ours, theirs = medians.get(crab, {}), medians.get(native, {})
    shared = [m for m in ours if theirs.get(m)]
    ratios = {m: ours[m] / theirs[m] for m in shared}
    if section == "context":
        worst = min(ratios.values(), default=float("nan"))
        verdict = "met" if worst >= 0.97 else "missed"
        return f"Goal: within 3% of native at every size and depth (>= 0.97x): {verdict}, " \
               f"lowest {worst:.3f}x."  # fmt: skip
    if section == "clients":
        throughput = [r for m, r in ratios.items() if m.endswith("tokens/s")]
        tail = [r for m, r in ratios.items() if m.endswith("p95 s")]
        met = min(throughput, default=0) >= 0.95 and max(tail, default=2) <= 1
        return (f"Goals: aggregate tokens/s >= 0.95x llama-server and p95 time to first token "
                f"<= its own at every client count: {'met' if met else 'missed'} (tokens/s "
                f"{min(throughput, default=0):.2f}-{max(throughput, default=0):.2f}x, p95 TTFT "
                f"{min(tail, default=0):.2f}-{max(tail, default=0):.2f}x).")  # fmt: skip
    first, last = shared[0], shared[-1]
    return (f"From the smallest to the largest configuration the peak grows by "
            f"{theirs[last] - theirs[first]:.0f} MiB natively and {ours[last] - ours[first]:.0f} "
            f"MiB in llamacrab; llamacrab's constant extra (the Python interpreter, the HTTP "
            f"stack) is {ours[first] - theirs[first]:.0f} MiB at the smallest.")  # fmt: skip
