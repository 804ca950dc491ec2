"""Per-request LoRA sets on parallel slots, some of them overflowing: a section of the
reliability suite (``run_server_sections`` in scripts/reliability_server.py runs it; CI runs the
short size through tests/test_reliability_server.py).

``lora_mix``: clients send greedy completions, streamed or not, of prompts from 4 to 312 tokens
to a two-slot server with two adapters. Each asks for one of four sets (the defaults, none, the
second adapter at 0.5, both at 0.3 and 0.7) or, one request in four, a scale that overflows:
3e38 (an infinite delta, NaN on every kernel path) or 1e30 (NaN on some paths, finite nonsense
on others: the CPU's flash attention keeps 64 rows and more in float32).
Asserted: every request of a set answers 200 with the text the Python API gives on one slot
(NaN that an overflowing request left in the KV cells once made later prompts on its slot NaN:
a 500, or a 400 blaming their own small scales); every overflowing one answers 400
``lora_scale_overflow``, but 1e30 where its nonsense came out finite (a 200, or a stream whose
error event follows its first text: counted, not failed); no 5xx, no traceback, no crash.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_tiny_gguf
from server_process import ServerProcess, server_errors, status_counts, tiny_model

from llamacrab import Llama

MAX_TOKENS = 6
OVERFLOWING = (3e38, 1e30)
WORDS = "a dog ran far away from the old red barn "
PROMPTS = ("the cat", WORDS, WORDS * 2, WORDS * 3, WORDS * 5, WORDS * 8)
# A request's "lora" field by the name of its set (None: the server's defaults, adapter 0 at 1).
SETS: dict[str, list[dict[str, float]] | None] = {
    "default": None,
    "none": [{"id": 0, "scale": 0.0}],
    "second": [{"id": 1, "scale": 0.5}],
    "both": [{"id": 0, "scale": 0.3}, {"id": 1, "scale": 0.7}],
}


def _references(model: Path, adapters: list[Path]) -> dict[tuple[str, str], str]:
    """The greedy text of every prompt under every set, from the Python API on one slot."""
    with Llama(model, n_ctx=512, n_threads=1,
               lora=[(str(adapters[0]), 1.0), (str(adapters[1]), 0.0)]) as llm:  # fmt: skip
        loaded = llm.adapters
        texts = {}
        for name, entries in SETS.items():
            lora = None if entries is None else {loaded[e["id"]]: e["scale"] for e in entries}
            for prompt in PROMPTS:
                answer = llm.create_completion(prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                               lora=lora)  # fmt: skip
                texts[prompt, name] = answer.text
    return texts


def _drawn(
    rng: random.Random, references: dict[tuple[str, str], str]
) -> tuple[dict[str, Any], float | None, str]:
    """A request's body, the overflowing scale it asks for (None: a set's), its expected text."""
    prompt, name = rng.choice(PROMPTS), rng.choice(list(SETS))
    overflowing = rng.choice(OVERFLOWING) if rng.random() < 0.25 else None
    lora = SETS[name] if overflowing is None else [{"id": 0, "scale": overflowing}]
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    body["stream"] = rng.random() < 0.5
    if lora is not None:
        body["lora"] = lora
    return body, overflowing, references[prompt, name]


def _ask(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[int, str, str | None]:
    """POST a completion; its status, its text and the error code it ended with (a stream's
    error event included; None: no error)."""
    if not body["stream"]:
        answer = client.post(url + "/v1/completions", json=body)
        data = answer.json()
        if "error" in data:
            return answer.status_code, "", data["error"].get("code")
        return answer.status_code, data["choices"][0]["text"], None
    text, code = "", None
    with client.stream("POST", url + "/v1/completions", json=body) as answer:
        if answer.status_code != 200:
            answer.read()
            return answer.status_code, "", answer.json()["error"].get("code")
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                code = event["error"].get("code") or "error"
            elif event.get("choices"):
                text += event["choices"][0].get("text", "")
    return answer.status_code, text, code


def _verdict(overflowing: float | None, status: int, text: str, code: str | None,
             expected: str) -> str:  # fmt: skip
    if overflowing is None:
        return "right" if (status, code, text) == (200, None, expected) else "wrong"
    if status == 400 and code == "lora_scale_overflow":
        return "overflow_refused"
    if overflowing == 1e30 and status == 200 and code in (None, "lora_scale_overflow"):
        return "overflow_answered"  # finite nonsense: nothing here can tell it
    return "overflow_wrong"


def lora_mix(workdir: Path, clients: int = 3, seconds: float = 15, seed: int = 0) -> dict[str, Any]:
    """``clients`` threads for ``seconds`` against a two-slot server with two adapters."""
    model = tiny_model(workdir)
    adapters = [make_tiny_gguf.write_tiny_lora(workdir / "mix-lora-a.gguf"),
                make_tiny_gguf.write_tiny_lora(workdir / "mix-lora-b.gguf", seed=7)]  # fmt: skip
    references = _references(model, adapters)
    flags = [str(model), "--parallel", "2", "--n-ctx", "1024", "--n-threads", "1",
             "--lora", str(adapters[0]), "--lora-scaled", f"{adapters[1]}:0"]  # fmt: skip
    verdicts: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    wrong: list[dict[str, Any]] = []
    unreadable: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client(index: int) -> None:
        try:
            ask(random.Random(seed * 1000 + index))
        except Exception as error:  # an answer this client could not read fails the section
            with lock:
                unreadable.append(repr(error))

    def ask(rng: random.Random) -> None:
        with httpx.Client(timeout=120) as http:
            while time.monotonic() < deadline:
                body, overflowing, expected = _drawn(rng, references)
                status, text, code = _ask(http, server.url, body)
                verdict = _verdict(overflowing, status, text, code, expected)
                with lock:
                    verdicts[verdict] += 1
                    statuses[status] += 1
                    if verdict.endswith("wrong") and len(wrong) < 5:
                        seen = {"status": status, "code": code, "text": text}
                        wrong.append({"body": body, "expected": expected, **seen})

    server = ServerProcess(flags, workdir / "lora-mix.log")
    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        exit_info = server.close()
    result = {
        "clients": clients, "seconds": seconds, "requests": sum(verdicts.values()),
        "verdicts": dict(verdicts), "statuses": status_counts(statuses),
        "server_errors": server_errors(statuses), "wrong": wrong, "unreadable": unreadable,
        "server": exit_info,
        "crashes": int(exit_info["crashed"] or exit_info["signal_death"]),
        "hangs": int(exit_info["hung_at_exit"]),
    }  # fmt: skip
    result["ok"] = (
        verdicts["wrong"] == verdicts["overflow_wrong"] == len(unreadable) == 0
        and verdicts["right"] > 0
        and result["server_errors"] == result["crashes"] == result["hangs"] == 0
        and not exit_info["tracebacks"]
    )  # fmt: skip
    return result
