"""Stopping ``llamacrab serve`` with SIGTERM or Ctrl-C while requests run.

uvicorn alone waited for every open connection without end (a long stream kept the server up
for minutes after SIGTERM), and its force quit (a second Ctrl-C) cut streams mid-answer with a
traceback and a 500 per request. The server now gives requests in flight ``--shutdown-timeout``
seconds, then closes the model: each request still running ends with ``shutting_down``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from llamacrab._ports import free_port

pytestmark = pytest.mark.real_model


class Served:
    """``llamacrab serve`` of Gemma 3 270M in a child process, on a free loopback port."""

    def __init__(self, model: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "llamacrab", "serve", str(model), "--port",
                   str(self.port), "--n-ctx", "4096", "--no-warmup", *flags]  # fmt: skip
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        deadline = time.monotonic() + 60
        while not self._healthy():
            assert self.process.poll() is None and time.monotonic() < deadline, self.output()
            time.sleep(0.1)

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health").status_code == 200
        except httpx.TransportError:
            return False

    def stream(self, into: list[str]) -> threading.Thread:
        """A streamed completion of 4,000 tokens, its lines gathered in ``into`` (the end
        token banned: a sampled story could end before the shutdown it waits for)."""

        def read() -> None:
            body = {"prompt": "Tell me a very long story.", "max_tokens": 4000, "stream": True,
                    "ignore_eos": True}  # fmt: skip
            try:
                with httpx.stream("POST", self.url + "/v1/completions", json=body,
                                  timeout=120) as response:  # fmt: skip
                    into.append(f"status {response.status_code}")
                    into.extend(line for line in response.iter_lines() if line)
            except httpx.TransportError as error:
                into.append(f"broken: {type(error).__name__}")

        thread = threading.Thread(target=read)
        thread.start()
        return thread

    def stop(self, *signals: signal.Signals, pause: float = 0.5) -> float:
        """Send ``signals`` (``pause`` apart); the seconds until the process has ended."""
        started = time.monotonic()
        for number in signals:
            self.process.send_signal(number)
            time.sleep(pause)
        self.process.wait(timeout=60)
        return time.monotonic() - started

    def output(self) -> str:
        if self.process.poll() is None:
            self.process.kill()
        return self.process.communicate()[0]


def wait_for_tokens(lines: list[str], server: Served) -> None:
    """Until ``lines`` has a few (tokens flowing), at most a minute."""
    deadline = time.monotonic() + 60
    while len(lines) < 5:
        assert time.monotonic() < deadline, (lines, server.output())
        time.sleep(0.05)


def ended_by_shutdown(lines: list[str]) -> bool:
    """A stream that answered 200, sent tokens, and ended with the shutting_down event."""
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    return (
        lines[0] == "status 200"
        and len(events) > 1
        and events[-1].get("error", {}).get("code") == "shutting_down"
        and lines[-1] == "data: [DONE]"
    )


def test_sigterm_gives_requests_their_time_then_ends_them(gemma_path: Path) -> None:
    server = Served(gemma_path, "--shutdown-timeout", "1")
    generating: list[str] = []
    reader = server.stream(generating)
    wait_for_tokens(generating, server)
    seconds = server.stop(signal.SIGTERM)
    reader.join(timeout=30)
    output = server.output()
    assert seconds < 15, output  # not the minutes 4,000 tokens take
    assert server.process.returncode in (0, -signal.SIGTERM), output
    assert ended_by_shutdown(generating), generating[-3:]
    assert "Traceback" not in output, output


def test_a_second_ctrl_c_ends_requests_at_once(gemma_path: Path) -> None:
    server = Served(gemma_path)  # the default 5 s grace, cut short by the second Ctrl-C
    first: list[str] = []
    queued: list[str] = []
    # One slot: the second request waits. Started once the first generates, so which one
    # holds the slot is not a race (the test waited for ever when the second won it).
    readers = [server.stream(first)]
    wait_for_tokens(first, server)
    readers.append(server.stream(queued))
    time.sleep(1)  # its request sent and queued
    seconds = server.stop(signal.SIGINT, signal.SIGINT)
    for reader in readers:
        reader.join(timeout=30)
    output = server.output()
    assert seconds < 4, output
    assert ended_by_shutdown(first), first[-3:]
    # The waiting request never got a slot: it is answered, not cut off.
    assert queued and not queued[0].startswith("broken"), queued
    assert "Traceback" not in output and "Internal Server Error" not in output, output
