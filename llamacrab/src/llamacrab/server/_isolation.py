"""A registry entry served by a process of its own: a child ``llamacrab serve`` of that one
entry on loopback, which the parent starts when the entry loads, forwards the entry's requests
to, and stops when it unloads. ggml-rpc's client aborts its process when a worker dies; in a
child that ends one model, and the parent reports the entry failed and keeps serving."""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import http.client
import json
import os
import secrets
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from llamacrab import ModelEntry, ModelLoadError
from llamacrab._exit_status import describe
from llamacrab._ports import free_port
from llamacrab.server._settings import ServerSettings

# The child reads what to serve from stdin's first line and its parent's pid from here (it
# ends when the rest of stdin ends or, on POSIX, its parent changes).
PARENT_ENV = "LLAMACRAB_SERVE_PARENT"
_STDERR_LINES = 40
_CANCEL_SECONDS = 5.0  # a child answers its unload once its generations have stopped
_children: weakref.WeakSet[ChildModel] = weakref.WeakSet()


def runs_isolated(entry: ModelEntry) -> bool:
    """Whether the server runs ``entry`` in a process of its own: ``isolate`` when given, else
    when it offloads to RPC workers (whose death aborts the process running the model)."""
    if entry.isolate is not None:
        return entry.isolate
    return bool(entry.llama_options().get("rpc_servers"))


def child_spec(entry: ModelEntry, settings: ServerSettings, port: int, key: str) -> str:
    """What the child serves, as the JSON it reads: the entry as written (the child puts the
    serve flags under it, as the parent did) and the parent's settings on loopback."""
    own = dataclasses.replace(settings, host="127.0.0.1", port=port, api_keys=(key,),
                              models=None, models_dir=None, cors_origins=(),
                              cors_origin_regex=None)  # fmt: skip
    raw = {"name": entry.name, "model": entry.model, "options": dict(entry.options),
           "keep_alive": None, "pinned": False}  # fmt: skip
    try:
        return json.dumps({"entry": raw, "settings": dataclasses.asdict(own)})
    except TypeError as error:  # options given in Python, not read from a file
        raise ModelLoadError(f"model {entry.name!r} cannot run in a process of its own: its "
                             f"options are not plain values ({error})") from None  # fmt: skip


class ChildModel:
    """The child process serving one entry: ``address`` and ``key`` for the requests sent to
    it; ``on_death(reason)`` is called when it ends without being closed."""

    scheduler: None = None  # its slots are the child's own
    busy = False  # its requests hold the registry's leases while they run

    def __init__(self, name: str, process: subprocess.Popen[bytes], port: int, key: str,
                 on_death: Callable[[ChildModel, str], None]) -> None:  # fmt: skip
        self.name = name
        self.process = process
        self.address = ("127.0.0.1", port)
        self.key = key
        self._on_death = on_death
        self._closing = False
        self._cancelling: threading.Thread | None = None  # the forced unload asked of it
        self.loading = False  # in _load: the server's shutdown ends it (stop_loading_children)
        self._stderr: collections.deque[str] = collections.deque(maxlen=_STDERR_LINES)
        self._pump = threading.Thread(target=self._read_stderr, daemon=True,
                                      name=f"llamacrab-child-{name}")  # fmt: skip
        self._pump.start()
        _children.add(self)

    @classmethod
    def start(
        cls,
        entry: ModelEntry,
        settings: ServerSettings,
        on_death: Callable[[ChildModel, str], None],
        timeout: float = 600.0,
    ) -> ChildModel:
        """Start the child and load its model; ModelLoadError with the child's reason when
        it cannot (a worker unreachable, a bad file, the child ended)."""
        port, key = free_port(), secrets.token_urlsafe(24)
        spec = child_spec(entry, settings, port, key)
        process = subprocess.Popen(
            [sys.executable, "-m", "llamacrab.server._child"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env={**os.environ, PARENT_ENV: str(os.getpid())},
            start_new_session=True,  # the parent stops it; a Ctrl-C meant for it does not
        )  # fmt: skip
        assert process.stdin is not None
        child = cls(entry.name, process, port, key, on_death)  # reads its stderr from now on
        try:
            child._send_spec(spec)
            child._load(timeout)
        except BaseException:
            child.close()
            raise
        threading.Thread(target=child._watch, daemon=True,
                         name=f"llamacrab-watch-{entry.name}").start()  # fmt: skip
        return child

    def request(self, method: str, path: str, body: bytes | None = None,
                timeout: float = 10.0) -> tuple[int, bytes]:  # fmt: skip
        """One request to the child with its key: status and body."""
        connection = http.client.HTTPConnection(*self.address, timeout=timeout)
        try:
            headers = {"authorization": f"Bearer {self.key}", "content-type": "application/json"}
            connection.request(method, path, body, headers)
            answer = connection.getresponse()
            return answer.status, answer.read()
        finally:
            connection.close()

    def _send_spec(self, spec: str) -> None:
        """One line, and the pipe stays open: it closes when this process ends, however it
        ends, which is how the child knows (os.getppid() cannot tell on Windows)."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(spec.encode() + b"\n")
            self.process.stdin.flush()
        except OSError:  # it ended before reading what to serve
            self.process.wait()
            raise ModelLoadError(f"model {self.name!r}: its process {self.ended()}") from None

    def _load(self, timeout: float) -> None:
        self.loading = True
        try:
            self._wait_loaded(timeout)
        finally:
            self.loading = False

    def _wait_loaded(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        body = json.dumps({"model": self.name}).encode()
        while True:
            if self.process.poll() is not None:
                raise ModelLoadError(f"model {self.name!r}: its process {self.ended()}")
            try:  # answered once the child listens, after its model loaded (or failed to)
                status, answer = self.request("POST", "/models/load", body, timeout=timeout)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise ModelLoadError(f"model {self.name!r}: its process did not answer "
                                         f"within {timeout:g} s") from None  # fmt: skip
                time.sleep(0.1)
        if status != 200:
            raise ModelLoadError(_error_message(answer) or f"the child answered {status}")

    def wait(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds for the child to end (and its last words to be
        read); whether it has."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        self._pump.join(5)
        return True

    def _watch(self) -> None:
        self.wait(None)
        if not self._closing:
            self._on_death(self, f"the model's process {self.ended()}")

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            line = raw.decode("utf-8", "replace").rstrip()
            if line:
                self._stderr.append(line)
                print(f"[{self.name}] {line}", file=sys.stderr, flush=True)

    def ended(self) -> str:
        """How the child ended: its signal or status, and ggml's (or Python's) last line."""
        code = self.process.returncode
        if code is None:
            return "is running"
        how = describe(code)
        last = next((line for line in reversed(self._stderr) if not line.startswith("INFO")), "")
        return f"{how}: {last}" if last else how

    def cancel(self) -> None:
        """Cancel what the child runs: its own forced unload, so its requests end as those of
        a model unloaded by force do (503 ``shutting_down``, an error event ending a stream).
        Its server, stopped by ``close``, would wait for each of them to finish (12 s for 86
        requests): SIGTERM is a graceful stop. Asked on a thread, which ``close`` waits for:
        the children of a registry closing are asked all at once (a hung one cost 5 s each)."""
        if self._cancelling is not None and self._cancelling.is_alive():
            return  # asked already
        asking = threading.Thread(target=self._unload_there, daemon=True,
                                  name=f"llamacrab-cancel-{self.name}")  # fmt: skip
        asking.start()  # (one that cannot start is not waited for: close still stops it)
        self._cancelling = asking

    def _unload_there(self) -> None:
        body = json.dumps({"model": self.name, "force": True}).encode()
        with contextlib.suppress(OSError, http.client.HTTPException):  # then closed as it is
            self.request("POST", "/models/unload", body, timeout=_CANCEL_SECONDS)

    def close(self) -> None:
        """SIGTERM, then SIGKILL after 10 s (requests in flight get a broken answer), once a
        ``cancel`` has been answered (or timed out)."""
        self._closing = True
        if self._cancelling is not None:
            self._cancelling.join(_CANCEL_SECONDS + 1)
        _stop(self.process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if process.stdin is not None:
        # Closing flushes what a broken pipe kept buffered (a spec the child never read) and
        # raises again; the pipe is closed either way.
        with contextlib.suppress(OSError):
            process.stdin.close()


def stop_loading_children() -> None:
    """End the children still loading their model: the server stops, and a load can take up
    to its timeout (600 s: an RPC worker that never answers, a child that hangs), for which the
    registry's close would wait."""
    for child in list(_children):
        if child.loading:
            child.close()


@atexit.register
def _stop_all() -> None:  # the child also ends when it sees its parent gone
    for child in list(_children):
        child.close()


def _error_message(body: bytes) -> str | None:
    try:
        error = json.loads(body).get("error", {})
    except (ValueError, AttributeError):
        return None
    message = error.get("message") if isinstance(error, dict) else None
    return str(message) if message else None


def settings_from_json(data: dict[str, Any]) -> ServerSettings:
    """The settings ``child_spec`` wrote (JSON lists back to tuples)."""
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    return ServerSettings(**values)
