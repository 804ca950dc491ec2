"""A ``llamacrab serve`` process on loopback for the reliability sections (its own RSS, and
its signal death seen), and what those sections share: status counts, the working directory,
the tiny model."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_tiny_gguf

# A server process: binds a free loopback port itself, says which, then serves.
_LAUNCH = textwrap.dedent("""\
    import json, socket, sys
    import uvicorn
    from llamacrab.server import create_app, parse_settings
    settings = parse_settings(json.loads(sys.argv[1]), {})
    # proto given: asyncio sets TCP_NODELAY on accepted sockets only when it reads IPPROTO_TCP
    # (with proto 0, each keep-alive request waits ~40 ms on a delayed ACK; uvicorn #3149).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    print("PORT", sock.getsockname()[1], flush=True)
    config = uvicorn.Config(create_app(settings), log_level="warning", backlog=1024)
    uvicorn.Server(config).run(sockets=[sock])
""")


def rss_bytes(pid: int) -> int:
    """The resident set size of a process (Linux: /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class ServerProcess:
    """``python -c _LAUNCH FLAGS`` on loopback: ``llamacrab serve`` with a port of its own."""

    def __init__(self, flags: list[str], log: Path, timeout: float = 120) -> None:
        self.log = log
        self._out = log.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-c", _LAUNCH, json.dumps(flags)],
            stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        self.pid = self.process.pid
        deadline = time.monotonic() + timeout
        port = None
        while port is None:
            found = re.search(rb"^PORT (\d+)$", log.read_bytes(), re.MULTILINE)
            port = int(found.group(1)) if found else None
            if port is None and (self.process.poll() is not None or time.monotonic() > deadline):
                self.close()
                raise RuntimeError(f"the server did not start:\n{self.tail()}")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port}"
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=10).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the server did not load its model:\n{self.tail()}")
            time.sleep(0.05)

    def rss(self) -> int:
        return rss_bytes(self.pid)

    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self, size: int = 4000) -> str:
        return self.log.read_bytes()[-size:].decode("utf-8", "replace")

    def close(self) -> dict[str, Any]:
        """Stop it (SIGTERM: uvicorn's graceful shutdown); how it ended, and how many tracebacks
        its log holds (every refusal is an answer: a traceback is an error it did not expect)."""
        died = self.process.poll()  # before we asked: a crash
        hung = False
        if died is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                hung = True
                self.process.kill()
                self.process.wait()
        self._out.close()
        code = self.process.returncode
        return {
            "crashed": died is not None,
            "signal_death": code is not None and code < 0 and code != -signal.SIGTERM,
            "hung_at_exit": hung,
            "exit_code": code,
            "tracebacks": self.log.read_text(errors="replace").count(
                "Traceback (most recent call last)"
            ),
        }


def status_counts(counter: Counter[int]) -> dict[str, int]:
    """HTTP statuses and how often each came, in order, with string keys (for JSON)."""
    return {str(k): v for k, v in sorted(counter.items())}


def server_errors(counter: Counter[int]) -> int:
    """How many answers were 5xx."""
    return sum(v for k, v in counter.items() if k >= 500)


@contextmanager
def kept_or_temporary(path: Path | None) -> Iterator[Path]:
    """``path`` (created), or a temporary directory removed afterwards."""
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="llamacrab-reliability-") as tmp:
        yield Path(tmp)


def tiny_model(workdir: Path) -> Path:
    """The tiny test model in ``workdir``, generated the first time."""
    path = workdir / "tiny-llama.gguf"
    if not path.is_file():
        make_tiny_gguf.write_tiny_llama(path)
    return path
