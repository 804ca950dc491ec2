"""The interpreter shared by the sections whose cases are programs of operations run from
several threads (lifecycle, registry): each operation is a method ``op_<name>``; a LlamaError
counts as a refusal, any other exception as unclean, and a thread still running past
``THREAD_JOIN_SECONDS`` as a hang, reported with where it stands."""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import Counter
from typing import Any

THREAD_JOIN_SECONDS = 30.0


class Program:
    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.unclean: list[str] = []
        self.refused: Counter[str] = Counter()
        self.ran = 0
        self.lock = threading.Lock()

    def outcome(self) -> tuple[str, str]:
        if self.unclean:
            return "unclean", "; ".join(self.unclean[:3])[:3000]
        return "ok", self.summary()

    def summary(self) -> str:
        refused = ", ".join(f"{k} {v}" for k, v in self.refused.most_common())
        return f"{self.ran} operations; refused: {refused or 'none'}"

    def run(self, op: dict[str, Any]) -> None:
        from llamacrab import LlamaError

        try:
            getattr(self, "op_" + op["op"])(op)
            with self.lock:
                self.ran += 1
        except LlamaError as error:
            with self.lock:
                self.ran += 1
                self.refused[type(error).__name__] += 1
        except Exception as error:
            frames = traceback.format_exc(limit=-4)
            with self.lock:
                self.unclean.append(f"{op['op']} {op}: {type(error).__name__}: {error}\n{frames}")

    def spawn(self, target: Any, *args: Any) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        with self.lock:
            self.threads.append(thread)
        return thread

    def join_threads(self) -> list[threading.Thread]:
        """Join every thread, those the threads start meanwhile too; those still running
        after THREAD_JOIN_SECONDS."""
        deadline = time.monotonic() + THREAD_JOIN_SECONDS
        joined: set[threading.Thread] = set()
        while True:
            with self.lock:
                pending = [t for t in self.threads if t not in joined]
            if not pending:
                return [t for t in self.threads if t.is_alive()]
            for thread in pending:
                thread.join(max(0.0, deadline - time.monotonic()))
                joined.add(thread)


def stacks(threads: list[threading.Thread]) -> str:
    """Where each of ``threads`` stands, the end of its stack: what a hang waits on."""
    frames = sys._current_frames()
    return "\n".join(
        f"{t.name}:\n" + "".join(traceback.format_stack(frames[t.ident])[-6:])
        for t in threads
        if t.ident in frames
    )
