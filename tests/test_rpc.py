"""ggml RPC: workers in child processes on loopback, the probe that keeps unreachable workers
from aborting the client, greedy output equal to a local run, and what a dying worker does.

Every run that hands a worker to ggml happens in a child process (tests/rpc_client.py): the
pinned ggml-rpc client aborts its process when a connection breaks."""

from __future__ import annotations

import json
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from llamacrab import (
    InvalidParameterError,
    ModelParams,
    RpcError,
    RpcProtocolError,
    RpcUnavailableError,
    RpcWorker,
    RpcWorkerOptions,
    build_info,
    probe_rpc_worker,
)
from llamacrab._native import rpc as native_rpc
from llamacrab.server import ServerSettings

from support import REPO

CLIENT = str(REPO / "tests" / "rpc_client.py")
needs_rpc = pytest.mark.skipif(not build_info().rpc, reason="llamacrab-sys built without RPC")


def client(*args: str, timeout: float = 240, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, CLIENT, *args], capture_output=True, text=True, timeout=timeout, **kwargs
    )  # type: ignore[call-overload, no-any-return]


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[RpcWorker, RpcWorker]]:
    with RpcWorker.start(threads=1) as first, RpcWorker.start(threads=1) as second:
        yield first, second


# -- addresses and options (no network) ---------------------------------------------------------


@pytest.mark.parametrize(
    "address", ["nohost", ":50052", "host:", "host:0", "host:65536", "[::1]:5", "::1:5", "a:b"]
)
def test_malformed_addresses_are_refused_before_any_io(address: str) -> None:
    with pytest.raises(InvalidParameterError):
        ModelParams(rpc_servers=[address])


def test_rpc_servers_take_a_list_or_llama_cpp_style_commas() -> None:
    assert ModelParams(rpc_servers="a:1, b:2").rpc_servers == ("a:1", "b:2")
    assert ModelParams(rpc_servers=["a:1"]).rpc_servers == ("a:1",)
    with pytest.raises(InvalidParameterError):
        ModelParams(rpc_servers=[])
    with pytest.raises(InvalidParameterError):
        ModelParams(rpc_servers=[f"h:{i + 1}" for i in range(native_rpc.max_servers() + 1)])


def test_workers_listen_on_loopback_unless_the_network_is_declared_insecure() -> None:
    assert RpcWorkerOptions(host="localhost").host == "127.0.0.1"
    with pytest.raises(InvalidParameterError, match="no authentication"):
        RpcWorkerOptions(host="0.0.0.0")
    assert RpcWorkerOptions(host="0.0.0.0", insecure_network=True).endpoint == "0.0.0.0:50052"
    with pytest.raises(InvalidParameterError, match="IPv4"):
        RpcWorkerOptions(host="example.org")
    with pytest.raises(InvalidParameterError):
        RpcWorkerOptions(threads=0)
    # The worker's ggml starts that many OpenMP threads per graph: libgomp exits the process
    # (or it dies of SIGSEGV) where it cannot, so ggml's own bound holds here too.
    with pytest.raises(InvalidParameterError, match=r"threads must be an integer in 1\.\.512"):
        RpcWorkerOptions(threads=513)


def test_registry_entries_take_workers_like_llama(tmp_path: Path) -> None:
    from llamacrab import ModelRegistry

    toml = tmp_path / "models.toml"
    toml.write_text('[models.big]\nmodel = "big.gguf"\nrpc_servers = ["10.0.0.2:50052"]\n')
    entry = ModelRegistry.from_toml(toml).entries()[0]
    assert entry.name == "big"
    registry = ModelRegistry()
    registry.add("split", "big.gguf", rpc_servers="10.0.0.2:50052,10.0.0.3:50052")
    assert registry.entries()[0].name == "split"


def test_serve_takes_workers_as_a_flag_or_llama_cpp_style_list() -> None:
    from llamacrab.server._settings import parse_settings

    settings = parse_settings(["m.gguf", "--rpc", "127.0.0.1:1,127.0.0.1:2", "--rpc", "h:3"], {})
    assert settings.rpc_servers == ("127.0.0.1:1", "127.0.0.1:2", "h:3")
    env = parse_settings(["m.gguf"], {"LLAMACRAB_RPC_SERVERS": "h:1,h:2", "LLAMACRAB_RPC": "ON"})
    assert env.rpc_servers == ("h:1", "h:2")
    assert ServerSettings(model="m").rpc_servers == ()


def test_probe_constants_match_the_pinned_ggml_rpc_source() -> None:
    sys.path.insert(0, str(REPO / "llamacrab-sys"))
    from build_tools.source import resolve_source

    rpc_dir = resolve_source().path / "ggml" / "src" / "ggml-rpc"
    source = (rpc_dir / "ggml-rpc.cpp").read_text()
    commands = re.search(r"enum rpc_cmd \{(.*?)\};", source, re.S)
    assert commands is not None
    names = [n.split("=")[0].strip() for n in commands.group(1).split(",") if n.strip()]
    assert names.index("RPC_CMD_HELLO") == native_rpc.RPC_CMD_HELLO
    caps = re.search(r"RPC_CONN_CAPS_SIZE = (\d+);", (rpc_dir / "transport.h").read_text())
    assert caps is not None and int(caps.group(1)) == native_rpc.RPC_CONN_CAPS_SIZE
    answer = re.search(r"struct rpc_msg_hello_rsp \{(.*?)\};", source, re.S)
    assert answer is not None
    fields = re.findall(r"uint8_t (\w+)", answer.group(1))
    assert fields == ["major", "minor", "patch", "padding", "conn_caps"]


# -- the probe against fake peers (pure Python) ---------------------------------------------------


def fake_peer(answer: Callable[[socket.socket], None]) -> tuple[str, threading.Thread]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def run() -> None:
        with server:
            connection, _ = server.accept()
            with connection:
                answer(connection)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return f"127.0.0.1:{server.getsockname()[1]}", thread


def hello_answer(major: int, size: int = 28) -> Callable[[socket.socket], None]:
    def answer(connection: socket.socket) -> None:
        request = connection.recv(1 + 8 + 24, socket.MSG_WAITALL)
        assert request[0] == 14 and struct.unpack("<Q", request[1:9])[0] == 24
        connection.sendall(struct.pack("<Q", size) + bytes([major, 0, 0, 0, *bytes(24)])[:size])

    return answer


@needs_rpc
def test_probe_accepts_the_pinned_protocol() -> None:
    endpoint, thread = fake_peer(hello_answer(native_rpc.protocol_version()[0]))
    assert probe_rpc_worker(endpoint, timeout=5)[0] == native_rpc.protocol_version()[0]
    thread.join(5)


@needs_rpc
@pytest.mark.parametrize("answer", [hello_answer(6), hello_answer(7, size=3)])
def test_probe_refuses_another_protocol(answer: Callable[[socket.socket], None]) -> None:
    endpoint, thread = fake_peer(answer)
    with pytest.raises(RpcProtocolError) as caught:
        probe_rpc_worker(endpoint, timeout=5)
    assert caught.value.endpoint == endpoint
    thread.join(5)


@needs_rpc
def test_probe_gives_up_on_a_silent_peer_in_time() -> None:
    release = threading.Event()
    endpoint, thread = fake_peer(lambda connection: release.wait(10) and None)
    started = time.monotonic()
    with pytest.raises(RpcUnavailableError, match="no HELLO answer"):
        probe_rpc_worker(endpoint, timeout=0.5)
    assert time.monotonic() - started < 3
    release.set()
    thread.join(5)


@needs_rpc
def test_probe_of_a_closed_port_fails_at_once() -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(RpcUnavailableError, match="cannot connect"):
        probe_rpc_worker(f"127.0.0.1:{port}", timeout=5)


# -- workers ------------------------------------------------------------------------------------


@needs_rpc
def test_worker_answers_and_stops_cleanly_on_sigterm() -> None:
    with RpcWorker.start(threads=1) as worker:
        assert probe_rpc_worker(worker.endpoint) == native_rpc.protocol_version()
        assert worker.stop() == 0
        assert not worker.running
        assert "Starting RPC server" in worker.output()  # before close() drops the log


@needs_rpc
def test_a_worker_ends_with_the_process_that_started_it() -> None:
    code = (
        "import os; from llamacrab import RpcWorker; "
        "print(RpcWorker.start(threads=1).pid, flush=True); os._exit(0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    pid = int(result.stdout.split()[0])
    deadline = time.monotonic() + 20
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)  # reparented: not our child, so /proc tells whether it still runs
    stat = Path(f"/proc/{pid}/stat")
    assert not stat.exists() or stat.read_text().rsplit(") ", 1)[1].startswith("Z")  # zombie


@needs_rpc
def test_a_worker_ends_when_its_stdin_ends_while_its_parent_id_stays() -> None:
    # What a worker on Windows sees of its parent's end (os.getppid() keeps the dead one's id).
    worker = RpcWorker.start(threads=1)
    try:
        assert worker.process.stdin is not None
        worker.process.stdin.close()
        assert worker.process.wait(timeout=20) == 0  # its own orderly exit, not our SIGTERM
    finally:
        worker.close()


@needs_rpc
def test_the_pipe_to_a_worker_that_ended_on_its_own_is_closed_at_the_next_start() -> None:
    from llamacrab._features import rpc

    first = RpcWorker.start(threads=1)
    pipe = first.process.stdin
    first.process.kill()  # a crash, and its RpcWorker dropped without stop()
    first.process.wait()
    with RpcWorker.start(threads=1) as second:
        assert pipe is not None and pipe.closed
        assert first.process not in rpc._parent_pipes and second.process in rpc._parent_pipes
    assert second.process not in rpc._parent_pipes


@needs_rpc
def test_worker_lists_devices_and_refuses_an_unknown_one() -> None:
    command = [sys.executable, "-m", "llamacrab", "rpc-worker"]
    listed = subprocess.run(
        [*command, "--list-devices"], capture_output=True, text=True, timeout=60
    )
    assert listed.returncode == 0 and listed.stdout.startswith("CPU\tcpu\t"), listed
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    unknown = subprocess.run([*command, "--port", port, "--device", "CPU,NOPE"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert unknown.returncode == 1 and "unknown device 'NOPE'" in unknown.stderr, unknown


@needs_rpc
def test_worker_refuses_a_port_in_use_and_a_public_host() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(RpcError, match="cannot listen"):
            RpcWorker.start(port=port, start_timeout=30)
    command = [sys.executable, "-m", "llamacrab", "rpc-worker", "--host", "0.0.0.0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "--insecure-network" in result.stderr


@needs_rpc
def test_a_busy_worker_is_an_error_not_a_hang(
    workers: tuple[RpcWorker, RpcWorker], tiny_model_path: Path
) -> None:
    first, _ = workers
    holder = socket.create_connection(("127.0.0.1", first.options.port))
    try:  # the worker serves one client at a time: this one holds it
        holder.sendall(struct.pack("<BQ", 14, 24) + bytes(24))
        holder.recv(8 + 28, socket.MSG_WAITALL)
        result = client("load", str(tiny_model_path), first.endpoint)
    finally:
        holder.close()
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("RpcUnavailableError") and "no HELLO answer" in result.stdout


@needs_rpc
def test_unreachable_and_duplicate_workers_raise_in_the_client(tiny_model_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for servers, error in [
        (f"127.0.0.1:{port}", "RpcUnavailableError"),
        ("no-such-host.invalid:50052", "RpcUnavailableError"),
        (f"127.0.0.1:{port},localhost:{port}", "InvalidParameterError"),
    ]:
        result = client("load", str(tiny_model_path), servers)
        assert result.returncode == 0, result.stderr  # an exception, not a signal death
        assert result.stdout.startswith(error), result.stdout


@needs_rpc
def test_two_models_of_one_process_share_a_worker(
    workers: tuple[RpcWorker, RpcWorker], tiny_model_path: Path
) -> None:
    # A worker serves one connection; ggml shares it between the models of a process, so the
    # second model must not be refused by a probe waiting behind the first one's connection.
    result = client("two", str(tiny_model_path), ",".join(w.endpoint for w in workers))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["same", "done"]


# -- generation -----------------------------------------------------------------------------------


def generate(model: Path, prompt: str, n: int, servers: str) -> dict[str, dict[str, object]]:
    result = client("generate", str(model), prompt, str(n), servers)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)  # type: ignore[no-any-return]


@needs_rpc
def test_two_workers_give_the_local_greedy_tokens(
    workers: tuple[RpcWorker, RpcWorker], tiny_model_path: Path, gemma_path: Path
) -> None:
    servers = ",".join(w.endpoint for w in workers)
    tiny = generate(tiny_model_path, "hello world", 24, servers)
    assert tiny["rpc"]["tokens"] == tiny["local"]["tokens"]
    assert tiny["rpc in graph"]["tokens"] == tiny["local"]["tokens"]
    # "auto" samples on this side with workers (the graph would save no traffic, see
    # _graph_sampling_pays).
    assert tiny["rpc"]["auto"] == tiny["local"]["auto"] == "off"
    # Workers keep weights in plain CPU buffers; the local run uses the same kernels with
    # use_extra_bufts=False (rpc_client.py), so even Gemma's near-ties decide alike.
    for prompt in ("The capital of France is", "The days of the week: Monday, Tuesday,"):
        gemma = generate(gemma_path, prompt, 24, servers)
        assert gemma["rpc"]["tokens"] == gemma["local"]["tokens"], gemma
        assert gemma["rpc in graph"]["tokens"] == gemma["local"]["tokens"], gemma
    for worker in workers:
        assert worker.running


@needs_rpc
def test_a_worker_dying_mid_generation_aborts_the_client_process_only(
    gemma_path: Path,
) -> None:
    """Documented: ggml-rpc's client cannot survive a broken connection (GGML_ABORT in its
    dispatcher thread). The caller of the process running the model sees it end at once with
    SIGABRT and ggml's message; nothing hangs, and the surviving worker serves again."""
    with RpcWorker.start(threads=1) as first, RpcWorker.start(threads=1) as second:
        servers = f"{first.endpoint},{second.endpoint}"
        process = subprocess.Popen(
            [sys.executable, CLIENT, "die", str(gemma_path), "Once upon a time", servers],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert process.stdout is not None and process.stdin is not None
            assert process.stdout.readline().strip() == "streaming"
            second.kill()
            process.stdin.write("go\n")
            process.stdin.flush()
            out, err = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
        assert process.returncode == -signal.SIGABRT
        assert "Remote RPC server crashed or returned malformed response" in err
        assert "finished" not in out
        assert probe_rpc_worker(first.endpoint, timeout=10) == native_rpc.protocol_version()


@needs_rpc
def test_serve_with_workers_answers_and_a_dying_worker_fails_its_clients_not_them(
    gemma_path: Path,
) -> None:
    """``llamacrab serve --rpc`` is the process running the model: when a worker dies it ends
    (SIGABRT, as above), and its HTTP client gets a broken stream, an error of its own."""
    import httpx

    from llamacrab._ports import free_port

    with RpcWorker.start(threads=1) as first, RpcWorker.start(threads=1) as second:
        port = free_port("127.0.0.1")
        command = [sys.executable, "-m", "llamacrab", "serve", str(gemma_path), "--port",
                   str(port), "--n-ctx", "512", "--n-threads", "1",
                   "--rpc", f"{first.endpoint},{second.endpoint}"]  # fmt: skip
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(url + "/health", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert server.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
            body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
            answer = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"]
            body = {**body, "prompt": "Once upon a time", "max_tokens": 200, "stream": True}
            events: list[str] = []
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                    lines = r.iter_lines()
                    assert next(lines).startswith("data:")
                    second.kill()
                    events.extend(lines)
            except httpx.TransportError as error:  # the server went away mid-stream
                events.append(f"{type(error).__name__}: {error}")
            assert "data: [DONE]" not in events and events, events
            print(events[-1])
            assert server.wait(60) == -signal.SIGABRT
            assert server.stderr is not None
            assert b"Remote RPC server crashed" in server.stderr.read()
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()


@needs_rpc
def test_the_multi_model_server_survives_a_dying_worker_and_reports_the_model_failed(
    tmp_path: Path, tiny_model_path: Path, gemma_path: Path
) -> None:
    """An entry with workers runs in a process of its own: a dying worker aborts that process
    only. Its stream ends with an error, the server and its other models go on, /v1/models
    shows the entry failed with the signal, and once the worker is back it loads again."""
    import httpx
    from live_server import LiveServer

    with RpcWorker.start(threads=1) as first, RpcWorker.start(threads=1) as second:
        config = tmp_path / "models.toml"
        config.write_text(
            f'[models.local]\nmodel = "{tiny_model_path}"\nn_ctx = 256\n'
            f'[models.split]\nmodel = "{gemma_path}"\nn_ctx = 512\n'
            f'rpc_servers = ["{first.endpoint}", "{second.endpoint}"]\n'
        )
        server = LiveServer(ServerSettings(model="", models=str(config), n_threads=1))
        url = server.url

        def models() -> dict[str, dict[str, object]]:
            data = httpx.get(url + "/v1/models").json()["data"]
            return {m["id"]: m["status"] for m in data}

        try:
            body = {"model": "split", "prompt": "Once upon a time", "max_tokens": 200,
                    "temperature": 0, "stream": True}  # fmt: skip
            events: list[str] = []
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=240) as answer:
                assert answer.status_code == 200
                lines = answer.iter_lines()
                assert next(lines).startswith("data:")
                second.kill()
                events.extend(line for line in lines if line)
            assert "data: [DONE]" not in events
            error = json.loads(events[-1].removeprefix("data: "))["error"]
            assert "SIGABRT" in error["message"], error
            status = models()["split"]
            assert status["value"] == "failed" and "SIGABRT" in str(status["error"]), status
            assert "Remote RPC server crashed" in str(status["error"]), status
            local = {"model": "local", "prompt": "hello", "max_tokens": 4}
            assert httpx.post(url + "/v1/completions", json=local, timeout=60).status_code == 200
            # A request starts it again; with the worker still gone that load fails.
            retried = httpx.post(url + "/v1/completions", json={**body, "stream": False},
                                 timeout=240)  # fmt: skip
            assert retried.status_code == 500 and "RpcUnavailableError" in retried.text
            # The worker back on its port: loading the entry again starts a new process.
            with RpcWorker.start(port=second.options.port, threads=1):
                loaded = httpx.post(url + "/models/load", json={"model": "split"}, timeout=240)
                assert loaded.status_code == 200, loaded.text
                body = {**body, "stream": False, "max_tokens": 4}
                again = httpx.post(url + "/v1/completions", json=body, timeout=240)
                assert again.status_code == 200 and again.json()["choices"][0]["text"]
        finally:
            server.close()
