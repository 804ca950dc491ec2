"""Counters for GET /metrics, in Prometheus' text format (no client library needed).

Requests are counted by route *template* (the matched route's path, e.g.
``/v1/chat/completions``; ``unmatched`` for a path no route serves), never by the raw request
path: a client must not be able to grow the label set or write into the exposition text.
Label values are escaped as the text format requires all the same. A request whose client left
before its answer counts with status 499 (nginx's "client closed request"), not as a 5xx.

Beside llamacrab's own ``llamacrab_*`` metrics, the ones of llama-server's that llamacrab can
count are offered under llama-server's names (``llamacpp:prompt_tokens_total`` and the rest,
see ``_LLAMA_SERVER``), so dashboards made for llama-server work.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

UNMATCHED_ROUTE = "unmatched"


def escape_label(value: str) -> str:
    """A label value as Prometheus' text format writes it: backslash, double quote and line
    feed escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()  # (route, status)
        self.prompt_tokens = 0
        self.cached_tokens = 0  # prompt tokens reused from memory, not processed again
        self.completion_tokens = 0
        self.max_tokens = 0  # the longest sequence: prompt and generated tokens
        self.latency_sum = 0.0
        self.latency_count = 0
        self.working = 0  # requests on the model outside the slots (embeddings, reranking)

    def request_done(self, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[route, status] += 1
            self.latency_sum += seconds
            self.latency_count += 1

    def tokens(self, prompt: int, completion: int, cached: int = 0) -> None:
        """A request's tokens: ``prompt`` of them (``cached`` of which were reused), and
        ``completion`` generated."""
        with self._lock:
            self.prompt_tokens += prompt
            self.cached_tokens += cached
            self.completion_tokens += completion
            self.max_tokens = max(self.max_tokens, prompt + completion)

    @contextmanager
    def working_on(self) -> Iterator[None]:
        """A request on the model that takes no slot (counted as processing meanwhile)."""
        with self._lock:
            self.working += 1
        try:
            yield
        finally:
            with self._lock:
                self.working -= 1

    def render(self, slots_total: int, slots_busy: int, queue_depth: int) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, text: str, samples: list[tuple[str, float]]) -> None:
            lines.extend((f"# HELP llamacrab_{name} {text}", f"# TYPE llamacrab_{name} {kind}"))
            lines.extend(f"llamacrab_{name}{labels} {value:g}" for labels, value in samples)

        with self._lock:
            requests = [
                (f'{{route="{escape_label(route)}",status="{status}"}}', float(count))
                for (route, status), count in sorted(self.requests.items())
            ]
            metric("requests_total", "counter", "HTTP requests answered", requests)
            metric("prompt_tokens_total", "counter", "prompt tokens processed",
                   [("", self.prompt_tokens)])  # fmt: skip
            metric("completion_tokens_total", "counter", "tokens generated",
                   [("", self.completion_tokens)])  # fmt: skip
            metric("request_duration_seconds", "summary", "time to answer a request",
                   [("_sum", self.latency_sum), ("_count", self.latency_count)])  # fmt: skip
        metric("slots_total", "gauge", "parallel slots", [("", slots_total)])
        metric("slots_busy", "gauge", "slots generating now", [("", slots_busy)])
        metric("queue_depth", "gauge", "requests waiting for a slot", [("", queue_depth)])
        with self._lock:
            values = {
                "prompt_tokens_total": self.prompt_tokens - self.cached_tokens,
                "prompt_tokens_cached_total": self.cached_tokens,
                "tokens_predicted_total": self.completion_tokens,
                "n_tokens_max": self.max_tokens,
                "requests_processing": slots_busy + self.working,
                "requests_deferred": queue_depth,
            }
        for name, kind, text in _LLAMA_SERVER:
            lines.extend((f"# HELP llamacpp:{name} {text}", f"# TYPE llamacpp:{name} {kind}",
                          f"llamacpp:{name} {values[name]:g}"))  # fmt: skip
        return "\n".join(lines) + "\n"


# llama-server's metrics (tools/server/server-task.cpp) that llamacrab counts, with its names
# and help. Its timings, decode counts and speculative-decoding counters are not offered.
_LLAMA_SERVER = (
    ("prompt_tokens_total", "counter",
     "Number of prompt tokens processed, excluding cached tokens"),
    ("prompt_tokens_cached_total", "counter", "Number of prompt tokens reused from the cache"),
    ("tokens_predicted_total", "counter", "Number of generation tokens processed"),
    ("n_tokens_max", "counter", "Largest observed sequence length (prompt + generation)"),
    ("requests_processing", "gauge", "Number of requests processing"),
    ("requests_deferred", "gauge", "Number of requests deferred"),
)  # fmt: skip
