"""ggml RPC workers: their options, the loop of ``llamacrab rpc-worker``, and ``RpcWorker``, a
worker in a child process.

A worker is ggml's own RPC server (``ggml_backend_rpc_start_server``) run by a Python process:
the same libraries as the client (one build, one protocol version), options checked before
anything binds, and signals handled by Python. It has no authentication: anything that can
connect can read and write its memory, so it listens on loopback unless told otherwise.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NoReturn

from llamacrab._exceptions import InvalidParameterError, RpcError, RpcUnavailableError
from llamacrab._exit_status import describe
from llamacrab._field_types import check_range
from llamacrab._native import rpc as _rpc
from llamacrab._native.host_limits import GGML_MAX_N_THREADS, default_threads
from llamacrab._native.rpc import DEFAULT_PORT, Device, Endpoint, local_devices, probe
from llamacrab._parent_watch import watch_parent
from llamacrab._ports import free_port

__all__ = ["DEFAULT_PORT", "Device", "RpcWorker", "RpcWorkerOptions", "local_devices", "probe"]


@dataclass(frozen=True, kw_only=True)
class RpcWorkerOptions:
    """How a worker listens and what it serves.

    ``host`` is an IPv4 address (``localhost`` means 127.0.0.1); anything but loopback needs
    ``insecure_network=True``: the RPC protocol has no authentication. ``devices`` are names
    from ``local_devices()`` (default: every accelerator, else the CPU); ``threads`` is for the
    CPU device; ``cache_dir`` keeps large weights the worker received, by hash, so a model
    loaded again is not sent again.
    """

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    threads: int | None = None
    devices: tuple[str, ...] = ()
    cache_dir: str | None = None
    insecure_network: bool = False

    def __post_init__(self) -> None:
        host = "127.0.0.1" if self.host == "localhost" else self.host
        try:
            address = ipaddress.IPv4Address(host)
        except ValueError:
            raise InvalidParameterError(
                f"worker host must be an IPv4 address (ggml RPC listens on IPv4), not {host!r}"
            ) from None
        object.__setattr__(self, "host", host)
        if not address.is_loopback and not self.insecure_network:
            raise InvalidParameterError(
                f"refusing to listen on {host}: ggml RPC has no authentication, anyone who can "
                "connect can use the worker. Pass --insecure-network (insecure_network=True) "
                "to do it anyway, inside a trusted network only"
            )
        if not 0 < self.port < 65536:
            raise InvalidParameterError(f"port must be 1-65535, not {self.port}")
        # The worker's ggml starts them at each graph (host_limits.GGML_MAX_N_THREADS).
        check_range("threads", self.threads, 1, GGML_MAX_N_THREADS)
        object.__setattr__(self, "devices", tuple(self.devices))

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def argv(self) -> list[str]:
        """The ``llamacrab rpc-worker`` arguments for these options."""
        args = ["--host", self.host, "--port", str(self.port)]
        if self.threads is not None:
            args += ["--threads", str(self.threads)]
        if self.devices:
            args += ["--device", ",".join(self.devices)]
        if self.cache_dir is not None:
            args += ["--cache", self.cache_dir]
        if self.insecure_network:
            args.append("--insecure-network")
        return args


def _default_threads() -> int:
    # Upstream rpc-server takes half the machine's logical CPUs, a guess at its physical cores;
    # these are counted (among the CPUs this process may use, within its CPU quota).
    return default_threads().amount


def _check_can_listen(options: RpcWorkerOptions) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As ggml's server binds (SO_REUSEADDR: a port left in TIME_WAIT is free), but on
        # Windows that option lets a second socket bind a port in use: there the check asks for
        # the port alone, so a taken one is refused (untried on Windows).
        exclusive = getattr(socket, "SO_EXCLUSIVEADDRUSE", None)
        sock.setsockopt(socket.SOL_SOCKET, exclusive or socket.SO_REUSEADDR, 1)
        try:
            sock.bind((options.host, options.port))
        except OSError as error:
            raise RpcError(
                f"cannot listen on {options.endpoint}: {error.strerror or error}",
                options.endpoint,
            ) from None


def run_worker(options: RpcWorkerOptions) -> NoReturn:
    """Serve until SIGTERM or SIGINT (or, for a worker an RpcWorker started, until that process
    is gone), then end the process (``os._exit(0)``: ggml's server thread cannot be stopped,
    and nothing of it may be torn down under it). Raises RpcError
    when it cannot listen. Call it from the main thread of a process made for it."""
    _rpc.require_rpc()
    _check_can_listen(options)
    if options.cache_dir is not None:
        Path(options.cache_dir).mkdir(parents=True, exist_ok=True)
    if not ipaddress.IPv4Address(options.host).is_loopback:
        print(
            f"llamacrab: WARNING: this RPC worker listens on {options.host}: ggml RPC has no "
            "authentication; use it only inside a trusted network",
            file=sys.stderr,
            flush=True,
        )
    failure: list[BaseException] = []
    endpoint = Endpoint(options.host, options.port)
    threads = options.threads or _default_threads()

    def serve() -> None:
        try:
            _rpc.serve(endpoint, options.devices, threads, options.cache_dir)
        except BaseException as error:  # handed to the main thread
            failure.append(error)

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    watched = os.environ.pop(_PARENT_ENV, "")
    parent_gone = threading.Event()
    if watched.isdigit():
        watch_parent(int(watched), parent_gone.set)
    thread = threading.Thread(target=serve, name="llamacrab-rpc-worker", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.5)
            if parent_gone.is_set():
                raise KeyboardInterrupt  # the RpcWorker that started it is gone
    except KeyboardInterrupt:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    raise failure[0] if failure else RpcError("the RPC worker stopped", options.endpoint)


# Set by RpcWorker for its child: the worker ends when the process that started it is gone
# (its stdin, a pipe the parent holds open, ends; on POSIX also when its parent changes).
_PARENT_ENV = "LLAMACRAB_RPC_WORKER_PARENT"
# The write ends of the workers' stdin, by process: held until stop() or this process's end,
# not for as long as the RpcWorker object, whose loss alone must not end its worker; those of
# workers that ended on their own are closed at the next start.
_parent_pipes: dict[subprocess.Popen[bytes], IO[bytes]] = {}


def _close_pipes_of_ended_workers() -> None:
    for process in [p for p in _parent_pipes if p.poll() is not None]:
        _parent_pipes.pop(process).close()


class RpcWorker:
    """A ggml RPC worker in a child process (``python -m llamacrab rpc-worker``).

    ``RpcWorker.start(threads=1)`` returns once the worker answers the RPC HELLO; ``endpoint``
    is what ``Llama(rpc_servers=[...])`` takes. ``port=None`` picks a free port. ``stop()``
    (or leaving a ``with`` block) ends it. Its output goes to a temporary file
    (``output()``) unless ``output`` is given.
    """

    def __init__(self, options: RpcWorkerOptions, process: subprocess.Popen[bytes],
                 log: IO[bytes] | None) -> None:  # fmt: skip
        self.options = options
        self.process = process
        self._log = log

    @classmethod
    def start(
        cls,
        *,
        port: int | None = None,
        start_timeout: float = 60.0,
        output: IO[bytes] | int | None = None,
        env: dict[str, str] | None = None,
        **options: Any,
    ) -> RpcWorker:
        """Start a worker with these RpcWorkerOptions fields and wait until it answers."""
        attempts = 5 if port is None else 1
        for attempt in range(attempts):
            chosen = RpcWorkerOptions(
                port=free_port(options.get("host", "127.0.0.1")) if port is None else port,
                **options,
            )
            log = tempfile.TemporaryFile() if output is None else None  # noqa: SIM115 - the worker owns it
            process = subprocess.Popen(
                [sys.executable, "-m", "llamacrab", "rpc-worker", *chosen.argv()],
                stdin=subprocess.PIPE,
                stdout=log if output is None else output,
                stderr=subprocess.STDOUT,
                env={**(os.environ if env is None else env), _PARENT_ENV: str(os.getpid())},
            )
            assert process.stdin is not None
            _close_pipes_of_ended_workers()
            _parent_pipes[process] = process.stdin
            worker = cls(chosen, process, log)
            try:
                worker._wait_ready(start_timeout)
                return worker
            except RpcError:
                worker.stop()
                # Another process took the free port between our check and the bind: retry.
                if attempt + 1 == attempts or "cannot listen" not in worker.output():
                    raise
        raise AssertionError("unreachable")

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RpcError(
                    f"the RPC worker {describe(self.process.returncode)} before answering: "
                    f"{self.output().strip()[-2000:]}",
                    self.endpoint,
                )
            try:
                probe(self.endpoint, timeout=min(2.0, max(0.1, deadline - time.monotonic())))
                return
            except RpcUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    @property
    def endpoint(self) -> str:
        return self.options.endpoint

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def output(self) -> str:
        """What the worker printed so far (when it writes to its temporary file)."""
        if self._log is None or self._log.closed:
            return ""
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; returns the exit status."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._release_pipe()
        return int(self.process.returncode)

    def kill(self) -> None:
        """End the worker at once (SIGKILL), as a crash would."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._release_pipe()

    def _release_pipe(self) -> None:
        _parent_pipes.pop(self.process, None)
        if self.process.stdin is not None:
            self.process.stdin.close()

    def close(self) -> None:
        self.stop()
        if self._log is not None:
            self._log.close()

    def __enter__(self) -> RpcWorker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else describe(self.process.returncode)
        return f"<RpcWorker {self.endpoint} pid {self.pid} ({state})>"
