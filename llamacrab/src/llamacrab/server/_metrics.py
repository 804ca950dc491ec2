"""Counters for GET /metrics, in Prometheus' text format (no client library needed).

Requests are counted by route *template* (the matched route's path, e.g.
``/v1/chat/completions``; ``unmatched`` for a path no route serves), never by the raw request
path: a client must not be able to grow the label set or write into the exposition text.
Label values are escaped as the text format requires all the same.
"""

from __future__ import annotations

import threading
from collections import Counter

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
        self.completion_tokens = 0
        self.latency_sum = 0.0
        self.latency_count = 0

    def request_done(self, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[route, status] += 1
            self.latency_sum += seconds
            self.latency_count += 1

    def tokens(self, prompt: int, completion: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.completion_tokens += completion

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
        return "\n".join(lines) + "\n"
