"""ggml RPC: wraps the RPC backend (``ggml_backend_rpc_*``): worker probes, remote devices, and
the blocking worker loop.

The client side of the pinned ggml-rpc ABORTS the process when it cannot connect to a worker or
its HELLO fails, and when a connection breaks later. So every worker is probed here first, with
a timeout and the pinned protocol's HELLO, and only an address that answered reaches ggml.
The probe speaks the wire format of ``ggml/src/ggml-rpc/ggml-rpc.cpp`` at the pinned commit
(a test checks these constants against that source):

    request:  | command (1 byte) | payload size (u64) | payload |
    response: | payload size (u64) | payload |
    HELLO (command 14): payload = conn_caps[24]; answer = major, minor, patch, pad, conn_caps[24]
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Sequence, Set
from dataclasses import dataclass
from typing import Any

from llamacrab._exceptions import (
    InvalidParameterError,
    RpcError,
    RpcProtocolError,
    RpcUnavailableError,
)
from llamacrab._field_types import check_range
from llamacrab._native import backend as _backend
from llamacrab._native.call import c_string, call, ffi, lib
from llamacrab._native.fork import note_compute_threads, thread_limit
from llamacrab._native.host_limits import GGML_MAX_N_THREADS
from llamacrab_sys import build_info

RPC_CMD_HELLO = 14  # static_assert(RPC_CMD_HELLO == 14) in ggml-rpc.cpp: fixed across versions
RPC_CONN_CAPS_SIZE = 24  # transport.h: transport capabilities (RDMA); zeros mean plain TCP
_HELLO_ANSWER_SIZE = 4 + RPC_CONN_CAPS_SIZE
DEFAULT_PORT = 50052
PROBE_TIMEOUT = 5.0


def available() -> bool:
    """Whether this llamacrab-sys was built with the RPC backend (``LLAMACRAB_RPC``)."""
    return bool(build_info().rpc) and hasattr(lib, "ggml_backend_rpc_add_server")


def protocol_version() -> tuple[int, int, int]:
    """The RPC protocol version this build speaks (major, minor, patch)."""
    return (
        int(lib.RPC_PROTO_MAJOR_VERSION),
        int(lib.RPC_PROTO_MINOR_VERSION),
        int(lib.RPC_PROTO_PATCH_VERSION),
    )


def max_servers() -> int:
    return int(lib.GGML_RPC_MAX_SERVERS)


def require_rpc() -> None:
    if not available():
        raise RpcError(
            "this llamacrab-sys was built without the RPC backend: reinstall it with "
            "LLAMACRAB_RPC=ON (the default)"
        )


@dataclass(frozen=True)
class Endpoint:
    """``host:port`` as ggml-rpc parses it: IPv4 or a host name, then a port."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        host, sep, port = text.strip().partition(":")
        if not sep or not host or ":" in port or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidParameterError(
                f"RPC worker address must be host:port (IPv4 or a name), not {text!r}"
            )
        c_string(host, "RPC worker host")
        return cls(host, int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    def resolve(self) -> tuple[str, int]:
        """The IPv4 address ggml would connect to (it uses the first one, IPv4 only)."""
        try:
            infos = socket.getaddrinfo(self.host, self.port, socket.AF_INET, socket.SOCK_STREAM)
        except OSError as error:
            raise RpcUnavailableError(
                f"RPC worker {self}: cannot resolve {self.host!r} ({error})", str(self)
            ) from None
        return str(infos[0][4][0]), self.port


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("connection closed")
        data += chunk
    return data


def probe(endpoint: str | Endpoint, timeout: float = PROBE_TIMEOUT) -> tuple[int, int, int]:
    """Connect to a worker and exchange the RPC HELLO within ``timeout`` seconds; return the
    worker's protocol version. RpcUnavailableError: no connection or no answer in time (a
    worker serves one client at a time); RpcProtocolError: an answer this build cannot use."""
    target = endpoint if isinstance(endpoint, Endpoint) else Endpoint.parse(endpoint)
    major, minor, _ = protocol_version()
    address = target.resolve()
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection(address, timeout=timeout)
    except OSError as error:
        reason = "timed out" if isinstance(error, TimeoutError) else error.strerror or error
        raise RpcUnavailableError(
            f"RPC worker {target}: cannot connect ({reason})", str(target)
        ) from None
    with sock:
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            caps = bytes(RPC_CONN_CAPS_SIZE)
            sock.sendall(struct.pack("<BQ", RPC_CMD_HELLO, len(caps)) + caps)
            (size,) = struct.unpack("<Q", _recv_exactly(sock, 8))
            if size != _HELLO_ANSWER_SIZE:
                raise RpcProtocolError(
                    f"RPC worker {target}: HELLO answer of {size} bytes, expected "
                    f"{_HELLO_ANSWER_SIZE} (not a ggml RPC worker of protocol {major}.x?)",
                    str(target),
                )
            answer = _recv_exactly(sock, size)
        except TimeoutError:
            raise RpcUnavailableError(
                f"RPC worker {target}: no HELLO answer within {timeout:g} s (it serves one "
                "client at a time: is another process using it?)",
                str(target),
            ) from None
        except OSError as error:
            raise RpcUnavailableError(
                f"RPC worker {target}: connection failed during HELLO ({error})", str(target)
            ) from None
    version = (answer[0], answer[1], answer[2])
    if version[0] != major or version[1] > minor:
        raise RpcProtocolError(
            f"RPC worker {target} speaks protocol {'.'.join(map(str, version))}; this build "
            f"speaks {'.'.join(map(str, protocol_version()))} (run a worker from the same "
            "llama.cpp version)",
            str(target),
        )
    return version


def parse_endpoints(endpoints: Sequence[str]) -> list[Endpoint]:
    """Parse a list of worker addresses (no I/O)."""
    parsed = [Endpoint.parse(e) for e in endpoints]
    if not parsed:
        raise InvalidParameterError("rpc_servers is empty")
    if len(parsed) > max_servers():
        raise InvalidParameterError(f"at most {max_servers()} RPC workers, not {len(parsed)}")
    return parsed


def check_endpoints(endpoints: Sequence[str]) -> list[Endpoint]:
    """Parse and resolve worker addresses; each worker at most once (two addresses of one
    worker would make ggml wait forever for the second connection)."""
    require_rpc()
    parsed = parse_endpoints(endpoints)
    seen: dict[tuple[str, int], Endpoint] = {}
    for endpoint in parsed:
        address = endpoint.resolve()
        if address in seen:
            raise InvalidParameterError(
                f"RPC workers {seen[address]} and {endpoint} are the same worker ({address[0]})"
            )
        seen[address] = endpoint
    return parsed


def offload_devices(
    endpoints: Sequence[str], timeout: float = PROBE_TIMEOUT, connected: Set[str] = frozenset()
) -> Any:
    """A NULL-terminated ``ggml_backend_dev_t[]`` for ``llama_model_params.devices``: every
    device of each worker (probed first), then this machine's GPUs, as llama.cpp's default
    order puts them. The RPC devices live as long as the process (ggml keeps them).

    ``connected``: addresses a live model of this process uses. ggml shares one connection per
    address string, and a worker serves one connection at a time, so those are not probed (the
    probe would wait behind our own connection)."""
    _backend.ensure_initialised()
    workers = check_endpoints(endpoints)
    for endpoint in workers:
        if str(endpoint) not in connected:
            probe(endpoint, timeout)
    devices: list[Any] = []
    for endpoint in workers:
        reg = call("ggml_backend_rpc_add_server", c_string(str(endpoint), "RPC worker address"))
        if reg == ffi.NULL:
            raise RpcError(f"RPC worker {endpoint} has no devices", str(endpoint))
        devices += [
            lib.ggml_backend_reg_dev_get(reg, i) for i in range(lib.ggml_backend_reg_dev_count(reg))
        ]
    devices += _local_accelerators()
    array = ffi.new("ggml_backend_dev_t[]", len(devices) + 1)
    for i, device in enumerate(devices):
        array[i] = device
    return array


def _local_accelerators() -> list[Any]:
    gpus, igpus = [], []
    for i in range(lib.ggml_backend_dev_count()):
        device = lib.ggml_backend_dev_get(i)
        kind = lib.ggml_backend_dev_type(device)
        if kind == lib.GGML_BACKEND_DEVICE_TYPE_GPU:
            gpus.append(device)
        elif kind == lib.GGML_BACKEND_DEVICE_TYPE_IGPU:
            igpus.append(device)
    return gpus or igpus


@dataclass(frozen=True)
class Device:
    """A device of this machine a worker can serve."""

    name: str
    description: str
    kind: str


_KINDS = {"CPU": "cpu", "GPU": "gpu", "IGPU": "igpu", "ACCEL": "accel"}


def local_devices() -> list[Device]:
    _backend.ensure_initialised()
    result = []
    for i in range(lib.ggml_backend_dev_count()):
        device = lib.ggml_backend_dev_get(i)
        kind = lib.ggml_backend_dev_type(device)
        label = next(
            (v for k, v in _KINDS.items() if kind == getattr(lib, f"GGML_BACKEND_DEVICE_TYPE_{k}")),
            "other",
        )
        result.append(
            Device(
                ffi.string(lib.ggml_backend_dev_name(device)).decode("utf-8", "replace"),
                ffi.string(lib.ggml_backend_dev_description(device)).decode("utf-8", "replace"),
                label,
            )
        )
    return result


def _worker_devices(names: Sequence[str]) -> list[Any]:
    if names:
        devices = []
        for name in names:
            device = lib.ggml_backend_dev_by_name(c_string(name, "device name"))
            if device == ffi.NULL:
                known = ", ".join(d.name for d in local_devices())
                raise InvalidParameterError(f"unknown device {name!r}; this machine has: {known}")
            devices.append(device)
        return devices
    # As upstream's rpc-server: every accelerator, else the CPU.
    accelerators = [
        lib.ggml_backend_dev_get(i)
        for i in range(lib.ggml_backend_dev_count())
        if lib.ggml_backend_dev_type(lib.ggml_backend_dev_get(i))
        not in (lib.GGML_BACKEND_DEVICE_TYPE_CPU, lib.GGML_BACKEND_DEVICE_TYPE_ACCEL)
    ]
    if accelerators:
        return accelerators
    cpu = lib.ggml_backend_dev_by_type(lib.GGML_BACKEND_DEVICE_TYPE_CPU)
    if cpu == ffi.NULL:
        raise RpcError("no device to serve: this build has no CPU device")
    return [cpu]


def serve(
    endpoint: Endpoint, devices: Sequence[str], n_threads: int, cache_dir: str | None
) -> None:
    """Run ggml's RPC server on this thread: it accepts one client at a time and returns only
    when it cannot listen or accept (then RpcError)."""
    require_rpc()
    check_range("threads", n_threads, 1, GGML_MAX_N_THREADS)
    _backend.ensure_initialised()
    note_compute_threads()
    chosen = _worker_devices(devices)
    array = ffi.new("ggml_backend_dev_t[]", chosen)
    cache = ffi.NULL if cache_dir is None else c_string(cache_dir, "cache directory")
    call(
        "ggml_backend_rpc_start_server",
        c_string(str(endpoint), "worker address"),
        cache,
        thread_limit(n_threads),
        len(chosen),
        array,
    )
    raise RpcError(f"the RPC worker stopped: it could not listen on or accept at {endpoint}")
