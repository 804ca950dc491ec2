"""The reliability suite: how hard llamacrab is to break, measured like BENCHMARKS.md measures
its speed.

Usage: python scripts/reliability.py [--mode long|short] [--sections a,b] [--workers 2]
                                     [--seed N] [--workdir DIR] [--report RELIABILITY.md]

Sections (tests/reliability_kit/sections.py; each has a short size, which CI runs through
tests/test_reliability.py, and a long one, the default here):

- lifecycle: generated sequences of operations on handles, Llama objects and streams;
- tampered-tiny, tampered-gemma: variants of the tiny model's and Gemma 3 270M's GGUF files;
- inputs: generated grammars, JSON Schemas and chat templates through the public API.

Every case runs in a child process (many per child; a death or hang is pinned on one case by
rerunning alone), and is counted as worked, refused (a LlamaError subclass), unclean (any other
exception), a signal death or a hang. Exits 1 if any case crashed, hung or failed uncleanly.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "scripts"))

from reliability_kit.children import Report  # noqa: E402
from reliability_kit.sections import SECTIONS, SEED, run  # noqa: E402

# What the suite found when it was first run, and where each is fixed (kept here so the report
# says it; a new finding is fixed in the library, gets a regression test, and a row here).
FOUND = [
    ("lifecycle", "`SamplerChain.sample(context, i)` with no logits at output i (none decoded "
     "yet, or out of range)", "SIGABRT: `GGML_ASSERT(logits != nullptr)` (llama-sampler.cpp:940)",
     "`_native/sampler.py`: InvalidParameterError first"),
    ("lifecycle", "a context with more sequences than `n_batch` or `n_ctx`, e.g. "
     "`Llama(path, embeddings=True, n_ctx=32)` (64 sequences)",
     "SIGABRT: `GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max)` (llama-context.cpp:2273)",
     "`_native/context.py`: n_batch and n_ctx at least n_seq_max"),
    ("lifecycle", "an embeddings context with pooling and `n_ubatch` below `n_seq_max`",
     "SIGABRT: `GGML_ASSERT(ggml_can_mul_mat(a, b))` reserving the graph",
     "`_native/context.py`: n_ubatch at least n_seq_max"),
    ("lifecycle", "`Batch.set_one(token, pos, seq_id)` with a seq_id past `n_seq_max`",
     "SIGSEGV in `llama_decode` (a seq_id pointer past its cells)",
     "`_native/batch.py`: seq_id, positions and tokens checked"),
    ("lifecycle", "one stream read from two threads at once",
     "ValueError (generator already executing) escaping (unclean)",
     "`_engine/stream.py`: ConcurrentUseError for the second reader"),
    ("lifecycle", "`Context.embeddings(width, count=...)` wider or longer than the output rows",
     "SIGSEGV, or reads past the buffer", "`_native/context.py`: rows checked against outputs"),
    ("lifecycle", "closing a model while another thread tokenizes, builds a sampler (a grammar), "
     "creates a context or adapter, or reads metadata",
     "SIGSEGV (use after free); AttributeError from an adapter closed before it was set up",
     "`_native/` vocab, sampler, context, adapter, mtmd, model: those calls hold the model in "
     "flight; handle.py: a child adopted by a closing parent is freed at once"),
    ("lifecycle", "a whole-context state blob (raw, or a SavedState with a valid checksum) whose "
     "first 4 bytes claim a long model name",
     "llama.cpp zero-fills a buffer of that length first: 4 GiB and ~5 s per load (the OOM "
     "killer on a smaller machine)", "`_native/context.py`: StateError before llama.cpp reads"),
    ("tampered", "`general.alignment` below 32 (e.g. 1)",
     "SIGABRT: `GGML_ASSERT(... \"buffer pointer must be aligned\")` (ggml-backend.cpp:2527)",
     "`validate_gguf`: the first tensor's data 32-byte aligned"),
    ("tampered", "`tokenizer.ggml.model = \"rwkv\"` over a vocabulary whose first bytes are not "
     "tokens", "tokenizing loops forever, appending tokens until memory runs out (8 GB in 44 s)",
     "`validate_gguf`: each first byte of an RWKV token is a token"),
    ("tampered-gemma", "a norm vector re-typed F16, BF16 or quantized (Q4_0)",
     "SIGABRT at the first decode: `binary_op: unsupported types` (ggml-cpu binary-ops.cpp:135)",
     "`validate_gguf`: float vectors are F32"),
    ("inputs", "GBNF repetition `x{5,2}` (maximum below minimum)",
     "llama.cpp adds rules until memory runs out (4 GB in 10-25 s, then bad_alloc or the OOM "
     "killer)", "`_native/grammar_bounds.py`: GrammarError"),
    ("inputs", "a chat template doubling a string with `~` in a loop",
     "unbounded memory (MemoryError, or the OOM killer)", "`_chat/template.py`: `~` checked "
     "like `+`"),
    ("inputs", "templates nested past Jinja's parser or Python's 100 indentation levels",
     "RecursionError or IndentationError escaping (unclean)", "`_chat/template.py`: "
     "TemplateError"),
    ("inputs", "JSON Schema keywords of the wrong type (`{\"enum\": 5}`); 5,000 optional "
     "properties (a 612 MB grammar, 2.4 GB RSS, before the refusal)",
     "TypeError escaping (unclean); unbounded memory", "`_grammar/json_schema.py`: GrammarError"),
    ("inputs", "chat message content parts that are not objects",
     "AttributeError escaping (unclean)", "`_chat/prompt.py`: InvalidParameterError"),
]  # fmt: skip


def found() -> str:
    lines = ["| found by | input | what happened | fixed in |", "| --- | --- | --- | --- |"]
    lines += [f"| {' | '.join(row)} |" for row in FOUND]
    return "\n".join(lines) + "\n"


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())  # fmt: skip
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{cpu}, {os.cpu_count()} logical CPUs, {memory:.0f} GiB memory, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}"
    )


def table(reports: list[Report]) -> str:
    columns = ["cases", "worked", "refused", "signal deaths", "hangs", "unclean errors"]
    lines = ["| section | " + " | ".join(columns) + " | slowest case s | peak RSS MiB | wall s |",
             "| --- |" + " ---: |" * (len(columns) + 3)]  # fmt: skip
    for report in reports:
        counts = report.counts
        slowest = report.slowest
        lines.append(
            f"| {report.section} | " + " | ".join(str(counts[c]) for c in columns)
            + f" | {slowest.seconds if slowest else 0:.2f} | {report.peak_rss_mib:.0f} "
            f"| {report.wall_seconds:.0f} |"
        )  # fmt: skip
    return "\n".join(lines) + "\n"


def details(report: Report) -> str:
    section = SECTIONS[report.section]
    refused = report.error_types()
    for result in report.results:  # a lifecycle sequence counts the refusals of its operations
        if result.outcome == "ok" and "; refused: " in result.detail:
            for part in result.detail.split("; refused: ", 1)[1].split(", "):
                name, _, count = part.rpartition(" ")
                if count.isdigit():
                    refused[name] += int(count)
    refusals = ", ".join(f"{name} {n}" for name, n in refused.most_common())
    slowest = report.slowest
    lines = [
        f"### {section.title} (`{report.section}`)",
        "",
        f"{section.what[0].upper()}{section.what[1:]}. {report.extra.get('generated', 0)} cases "
        f"generated, {len(report.results)} run in {report.children} child processes; limits: "
        f"{section.case_timeout:.0f} s per case"
        + (f", {section.memory_limit >> 30} GiB address space per child"
           if section.memory_limit else "") + ".",
        "",
        f"- refusals by type (of cases, or of a sequence's operations): {refusals or 'none'}",
    ]  # fmt: skip
    if slowest is not None:
        lines.append(f"- slowest case: {slowest.id} ({slowest.seconds:.2f} s): "
                     f"{slowest.detail.splitlines()[0][:160]}")  # fmt: skip
    findings = report.findings
    lines.append(f"- crashes, hangs and unclean errors: {len(findings) or 'none'}")
    for result in findings:
        lines.append(f"  - {result.outcome} {result.id}: {result.detail.splitlines()[0][:300]}")
    return "\n".join(lines) + "\n"


def markdown(reports: list[Report], command: str) -> str:
    total = sum(len(r.findings) for r in reports)
    verdict = ("0 signal deaths, 0 hangs and 0 unclean errors in every section" if not total
               else f"{total} failures: see the sections")  # fmt: skip
    body = "\n".join(details(r) for r in reports)
    return f"""# Reliability

How hard llamacrab is to break, measured: latest results of `{command}`.
Machine: {machine()}; 2 workers (child processes at a time). The machine was shared with other
jobs while this ran, so the times are upper bounds.

Result: {verdict}.

{table(reports)}
"worked": the case ran to the end (a model loaded and generated, a template rendered, ...);
"refused": a `LlamaError` subclass naming the problem, the expected answer to a bad input;
"unclean": any other exception escaping the library; "signal deaths": the child process died
(SIGSEGV, SIGABRT, the OOM killer, an exit status without a report); "hangs": no report within
the case's time limit. Each death or hang is pinned on one case (the case in flight, confirmed
by rerunning it alone in a fresh child). CI runs the short size of every section
(`tests/test_reliability.py`) and asserts no failures and the case counts.

{body}
## Found and fixed

What the suite found when it was first run (each fixed at its root, with a regression test in
`tests/test_reliability.py`):

{found()}
## How it works

`scripts/reliability.py` (this report) and `tests/test_reliability.py` (CI) share
`tests/reliability_kit/`: `children.py` runs many cases per child process and isolates a
culprit, `lifecycle.py`, `tampered.py` and `inputs.py` make and run the cases,
`sections.py` holds the sizes. Tampered variants are the same for a seed; hypothesis draws
(lifecycle, inputs) may vary between processes, so a failing batch's job file, which holds
its exact cases, is kept: `PYTHONPATH=tests:scripts python -m reliability_kit.child JOB.json`
replays it. The server's load, fault and leak checks are reported apart
from these sections.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("long", "short"), default="long")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--workdir", type=Path, help="models, work files and kept job files")
    parser.add_argument("--report", type=Path, help="write the Markdown report here")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="llamacrab-reliability-"))
    print(f"work files, kept job files and per-case results in {workdir}", flush=True)
    reports = []
    for name in args.sections.split(","):
        started = time.monotonic()
        print(f"== {name} ({args.mode})", flush=True)
        report = run(name, args.mode, workdir, workers=args.workers, seed=args.seed,
                     progress=lambda line: print("  " + line, flush=True))  # fmt: skip
        print(report.summary(), f"({time.monotonic() - started:.0f} s)", flush=True)
        reports.append(report)
        (workdir / f"{name}-results.json").write_text(json.dumps([vars(r) for r in report.results]))
    command = " ".join(["python scripts/reliability.py", *sys.argv[1:]])
    print(table(reports))
    if args.report:
        args.report.write_text(markdown(reports, command))
    sys.exit(1 if any(r.findings for r in reports) else 0)


if __name__ == "__main__":
    main()
