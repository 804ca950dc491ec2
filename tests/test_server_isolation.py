"""Registry entries in a process of their own (server/_isolation.py, server/_forward.py): the
parent forwards their requests (status codes, server-sent events and the API key as they are),
reports a dead child as a failed entry while the other models keep serving, starts it again
on demand, and counts it like a loaded model under max_loaded. The RPC case is in test_rpc.py."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from anyio import CapacityLimiter
from live_server import LiveServer

from llamacrab import ModelEntry, ModelRegistry
from llamacrab._registry import Loaded
from llamacrab.server import ServerSettings
from llamacrab.server._isolation import ChildModel, runs_isolated

from support import load_repo_module

reliability_models = load_repo_module("scripts/reliability_models.py")

KEY = "sesame"
AUTH = {"authorization": f"Bearer {KEY}"}


def children() -> list[int]:
    """The pids of this process's isolated-entry children that still run."""
    return reliability_models.model_processes(os.getpid())  # type: ignore[no-any-return]


def status_of(server: LiveServer, name: str) -> dict[str, object]:
    models = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"]
    return next(m["status"] for m in models if m["id"] == name)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Iterator[LiveServer]:
    config = tmp_path_factory.mktemp("isolated") / "models.toml"
    config.write_text(
        f'[models.local]\nmodel = "{tiny_model_path}"\nn_ctx = 256\nchat_format = "chatml"\n'
        f'[models.apart]\nmodel = "{tiny_model_path}"\nn_ctx = 256\nchat_format = "chatml"\n'
        "isolate = true\n"
    )
    settings = ServerSettings(model="", models=str(config), api_keys=(KEY,), n_threads=1,
                              models_max=1)  # fmt: skip
    live = LiveServer(settings)
    try:
        yield live
    finally:
        live.close()
    assert children() == []  # the parent's shutdown stopped its children


def complete(server: LiveServer, model: str, **body: object) -> httpx.Response:
    payload = {"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(server.url + "/v1/completions", json=payload, headers=AUTH, timeout=120)


def test_which_entries_run_apart() -> None:
    workers = {"rpc_servers": "127.0.0.1:1"}
    assert runs_isolated(ModelEntry("a", "m.gguf", workers))
    assert not runs_isolated(ModelEntry("a", "m.gguf", workers, isolate=False))
    assert runs_isolated(ModelEntry("a", "m.gguf", isolate=True))
    assert not runs_isolated(ModelEntry("a", "m.gguf"))


def test_isolate_is_read_from_the_registry_file(tmp_path: Path) -> None:
    config = tmp_path / "models.toml"
    config.write_text('[models.a]\nmodel = "a.gguf"\nisolate = false\n[models.b]\nmodel = "b"\n')
    registry = ModelRegistry.from_toml(config)
    assert registry.entry("a").isolate is False and registry.entry("b").isolate is None
    config.write_text('[models.a]\nmodel = "a.gguf"\nisolate = "yes"\n')
    with pytest.raises(ValueError, match=r"model 'a': isolate must be a bool or None, not 'yes'"):
        ModelRegistry.from_toml(config)


def test_answers_come_through_the_child_unchanged(server: LiveServer) -> None:
    local = complete(server, "local")
    apart = complete(server, "apart")
    assert apart.status_code == 200, apart.text
    assert apart.json()["choices"][0]["text"] == local.json()["choices"][0]["text"]
    assert apart.json()["model"] == "apart"
    assert len(children()) == 1
    # The child's own error answers keep their status and body.
    bad = complete(server, "apart", max_tokens=-3)
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
    # The parent's own checks come first (a generation model asked for embeddings).
    payload = {"model": "apart", "input": "x"}
    wrong = httpx.post(server.url + "/v1/embeddings", json=payload, headers=AUTH)
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "model_not_capable"
    # GET routes that name the model go to the child too.
    props = httpx.get(server.url + "/props", params={"model": "apart"}, headers=AUTH)
    assert props.status_code == 200, props.text


def test_server_sent_events_pass_through(server: LiveServer) -> None:
    body = {"model": "apart", "prompt": "hello", "max_tokens": 6, "temperature": 0,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH,
                      timeout=120) as answer:  # fmt: skip
        assert answer.headers["content-type"].startswith("text/event-stream")
        events = [line for line in answer.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == complete(server, "local", max_tokens=6).json()["choices"][0]["text"]


def test_the_parent_checks_the_key_and_the_child_takes_only_its_own(server: LiveServer) -> None:
    payload = {"model": "apart", "prompt": "hello", "max_tokens": 2}
    refused = httpx.post(server.url + "/v1/completions", json=payload)
    assert refused.status_code == 401
    assert complete(server, "apart").status_code == 200
    (pid,) = children()
    port = next(  # the child listens on loopback and refuses the clients' key
        int(line.split()[1].split(":")[1], 16)
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
        if line.split()[3] == "0A" and _owns_socket(pid, line.split()[9])
    )
    direct = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=payload, headers=AUTH)
    assert direct.status_code == 401


def _owns_socket(pid: int, inode: str) -> bool:
    fds = Path(f"/proc/{pid}/fd")
    return any(os.readlink(fd) == f"socket:[{inode}]" for fd in fds.iterdir())


def test_a_dead_child_is_reported_and_started_again(server: LiveServer) -> None:
    assert complete(server, "apart").status_code == 200
    (pid,) = children()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while status_of(server, "apart")["value"] != "failed":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert "SIGKILL" in str(status_of(server, "apart")["error"])
    assert complete(server, "local").status_code == 200  # the others keep serving
    again = complete(server, "apart")  # a later request starts it again
    assert again.status_code == 200 and status_of(server, "apart")["value"] == "loaded"


def test_a_child_counts_as_a_loaded_model(server: LiveServer) -> None:
    assert complete(server, "apart").status_code == 200
    assert len(children()) == 1
    assert complete(server, "local").status_code == 200  # max_loaded 1: the child stops
    assert children() == [] and status_of(server, "apart")["value"] == "unloaded"
    assert complete(server, "apart").status_code == 200
    assert status_of(server, "local")["value"] == "unloaded"
    unloaded = httpx.post(server.url + "/models/unload", json={"model": "apart"}, headers=AUTH)
    assert unloaded.json()["unloaded"] is True and children() == []


def test_a_child_that_cannot_answer_is_a_502_naming_how_it_ended() -> None:
    import asyncio
    import socket
    import subprocess
    import sys

    from llamacrab.server._errors import ApiError
    from llamacrab.server._forward import forward
    from llamacrab.server._isolation import ChildModel

    script = "import sys; sys.stderr.write('ggml.c:1: no room\\n'); sys.exit(3)"
    process = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE)
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    deaths: list[str] = []
    child = ChildModel("gone", process, port, "key", lambda _, reason: deaths.append(reason))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
             "query_string": b""}  # fmt: skip
    sent: list[object] = []

    async def receive() -> dict[str, object]:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: object) -> None:
        sent.append(message)

    with pytest.raises(ApiError) as caught:
        asyncio.run(forward(child, scope, b"{}", receive, send, 5, CapacityLimiter(2)))
    assert caught.value.status == 502 and sent == []
    assert caught.value.body()["error"]["message"] == (
        "model 'gone': its process exited with 3: ggml.c:1: no room"
    )
    child.close()


@pytest.mark.skipif(not hasattr(signal, "SIGRTMIN"), reason="real-time signals are Linux's")
def test_a_child_killed_by_a_signal_without_a_name_is_reported_dead() -> None:
    import subprocess
    import sys

    from llamacrab.server._isolation import ChildModel

    # signal.Signals names SIGRTMIN and SIGRTMAX but none between them: describing such a death
    # raised ValueError in the watcher thread, and the server never learned the child had died.
    number = signal.SIGRTMIN + 6
    script = f"import os; os.kill(os.getpid(), {number})"
    process = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE)
    deaths: list[str] = []
    child = ChildModel("gone", process, 9, "key", lambda _, reason: deaths.append(reason))
    child._watch()
    assert deaths == [f"the model's process killed by signal {number}"]
    child.close()


def test_a_child_that_ends_before_reading_what_to_serve_is_a_load_error() -> None:
    import subprocess
    import sys

    from llamacrab import ModelLoadError
    from llamacrab.server._isolation import ChildModel

    # Its stdin's write end broke: a BrokenPipeError (a 500), with both pipes left open. A
    # spec small enough to stay in the pipe's buffer broke again when close() flushed it
    # (found by the isolated churn: "internal server error: BrokenPipeError").
    for spec in ("{}" * 100_000, "{}"):  # more than a pipe holds; less than its buffer
        process = subprocess.Popen(
            [sys.executable, "-c", "import sys; print('no', file=sys.stderr)"],
            stdin=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        process.wait()
        child = ChildModel("gone", process, 9, "key", lambda *_: None)
        with pytest.raises(ModelLoadError, match="'gone': its process exited"):
            child._send_spec(spec)
        child.close()
        assert process.stdin is not None and process.stdin.closed


def test_a_child_still_loading_is_ended_when_the_server_stops() -> None:
    import subprocess
    import sys
    import threading

    from llamacrab import ModelLoadError
    from llamacrab.server._isolation import ChildModel, stop_loading_children

    # A child that never answers (its RPC worker unreachable, or hung): the server's shutdown
    # waited for the load's 600 s, and a second SIGTERM could not cut it short.
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],
                               stderr=subprocess.PIPE)  # fmt: skip
    child = ChildModel("stuck", process, 9, "key", lambda *_: None)
    failures: list[BaseException] = []

    def load() -> None:
        try:
            child._load(600)
        except ModelLoadError as error:
            failures.append(error)

    loader = threading.Thread(target=load)
    loader.start()
    deadline = time.monotonic() + 10
    while not child.loading and time.monotonic() < deadline:
        time.sleep(0.01)
    stop_loading_children()
    loader.join(timeout=30)
    assert not loader.is_alive() and len(failures) == 1
    assert "killed by SIGTERM" in str(failures[0])
    assert not child.loading and process.poll() is not None


# A child that answers with the bytes of argv[2] (a start, no end), then dies (exit 9) or,
# with argv[3] "hang", waits (for its client to leave).
_DYING_CHILD = """
import os, socket, sys, time
sock = socket.create_server(("127.0.0.1", int(sys.argv[1])))
print("listening", flush=True)
connection, _ = sock.accept()
connection.recv(65536)
connection.sendall(sys.argv[2].encode())
if sys.argv[3] == "hang":
    time.sleep(600)
sys.stderr.write("ggml.c:2: worker gone\\n")
os._exit(9)
"""
_STREAM_START = ("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                 'transfer-encoding: chunked\r\n\r\n10\r\ndata: {"n": 1}\n\n\r\n')  # fmt: skip
_WHOLE_START = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 377\r\n\r\n"


def _forward_to_dying_child(path: str, start: str, sent: list[dict[str, object]],
                            client_leaves: bool = False) -> None:  # fmt: skip
    """Forward a request to a child that dies after ``start``; ``sent`` gets what the client
    was sent. ``client_leaves``: the child waits after ``start`` and the client leaves."""
    import asyncio
    import socket
    import subprocess
    import sys

    from llamacrab.server._forward import forward
    from llamacrab.server._isolation import ChildModel

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    then = "hang" if client_leaves else "die"
    process = subprocess.Popen([sys.executable, "-c", _DYING_CHILD, str(port), start, then],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert process.stdout is not None and process.stdout.readline() == b"listening\n"
    child = ChildModel("dying", process, port, "key", lambda *_: None)
    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}

    async def receive() -> dict[str, object]:
        await asyncio.sleep(0.2 if client_leaves else 3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    try:
        asyncio.run(forward(child, scope, b"{}", receive, send, 10, CapacityLimiter(2)))
    finally:
        child.close()


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/v1/messages", 'event: error\ndata: {"type": "error", "error": {"type": "api_error", '),
        ("/v1/chat/completions", 'data: {"error": {"message": '),
    ],
)
def test_a_stream_broken_by_the_child_ends_with_the_error_event_of_its_api(
    path: str, expected: str
) -> None:
    sent: list[dict[str, object]] = []
    _forward_to_dying_child(path, _STREAM_START, sent)
    text = b"".join(m.get("body", b"") for m in sent).decode()  # type: ignore[misc]
    assert text.startswith('data: {"n": 1}\n\n'), text
    last = text.split("\n\n")[-2] + "\n\n"  # the stream's last event
    assert last.startswith(expected), text
    assert "its process exited with 9: ggml.c:2: worker gone" in last


def test_a_child_dying_between_its_headers_and_body_is_a_502_not_a_broken_answer() -> None:
    from llamacrab.server._errors import ApiError

    sent: list[dict[str, object]] = []
    with pytest.raises(ApiError) as caught:
        _forward_to_dying_child("/v1/completions", _WHOLE_START, sent)
    assert caught.value.status == 502 and caught.value.code == "model_process_failed"
    assert sent == []  # nothing started: the client gets the 502 whole
    assert "its process exited with 9: ggml.c:2: worker gone" in str(caught.value.body())


def test_a_client_leaving_is_not_answered_nor_its_leaving_blamed_on_the_child() -> None:
    sent: list[dict[str, object]] = []  # before the answer: no 502 (nor an error raised)
    _forward_to_dying_child("/v1/completions", "", sent, client_leaves=True)
    assert sent == []
    # Mid-stream: the stream just ends, without an error event (or an error raised and logged).
    _forward_to_dying_child("/v1/chat/completions", _STREAM_START, sent, client_leaves=True)
    text = b"".join(m.get("body", b"") for m in sent).decode()  # type: ignore[misc]
    assert text == 'data: {"n": 1}\n\n', text


# Stands for the server: starts the child as ChildModel does, waits until it serves, then ends
# without stopping it (or, with "close", closes the child's stdin and lives on).
_PARENT = """
import os, socket, subprocess, sys, time
from llamacrab.server._isolation import PARENT_ENV
spec, port, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
child = subprocess.Popen([sys.executable, "-m", "llamacrab.server._child"], stdin=subprocess.PIPE,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env={**os.environ, PARENT_ENV: str(os.getpid())})
child.stdin.write(open(spec, "rb").read() + b"\\n")
child.stdin.flush()
print(child.pid, flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        break
    except OSError:
        time.sleep(0.1)
print("serving" if child.poll() is None else "ended", flush=True)
if how == "exit":
    os._exit(0)
child.stdin.close()
print(child.wait(timeout=20), flush=True)
"""


def _child_of_a_parent(tmp_path: Path, tiny_model_path: Path, how: str) -> list[str]:
    """Run _PARENT; what it printed: the child's pid, whether it served, (for "close") how it
    ended."""
    import socket
    import subprocess
    import sys

    from llamacrab.server._isolation import child_spec

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spec = tmp_path / "spec.json"
    spec.write_text(child_spec(ModelEntry("m", str(tiny_model_path)), ServerSettings(model=""),
                               port, "key"))  # fmt: skip
    parent = subprocess.run([sys.executable, "-c", _PARENT, str(spec), str(port), how],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    return parent.stdout.split()


def test_a_child_ends_when_its_server_is_gone(tmp_path: Path, tiny_model_path: Path) -> None:
    printed, running = _child_of_a_parent(tmp_path, tiny_model_path, "exit")
    assert running == "serving"  # it serves while its parent lives
    pid = int(printed)
    deadline = time.monotonic() + 20
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)  # reparented: not our child, so /proc tells whether it still runs
    stat = Path(f"/proc/{pid}/stat")
    assert not stat.exists() or stat.read_text().rsplit(") ", 1)[1].startswith("Z")


def test_a_child_ends_when_its_stdin_ends_while_its_parent_id_stays(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    # What a child on Windows sees of its parent's end (os.getppid() keeps the dead one's id).
    _, running, status = _child_of_a_parent(tmp_path, tiny_model_path, "close")
    assert running == "serving"
    assert status == "1"  # its own exit when the pipe ended, not a timeout of the parent's wait


def test_a_transcription_naming_an_isolated_model_in_its_form_goes_to_that_model(
    server: LiveServer,
) -> None:
    # Found by an audit: the lease read a JSON body's model only, so a form's went unleased
    # and the route answered 500 ("model 'apart' is not a Llama of this process").
    answer = httpx.post(server.url + "/v1/audio/transcriptions", headers=AUTH,
                        files={"file": ("tone.wav", b"RIFF")}, data={"model": "apart"},
                        timeout=120)  # fmt: skip
    assert answer.status_code == 400, answer.text  # the child's own route refuses it
    assert answer.json()["error"]["message"].startswith(
        "model 'apart' cannot transcribe: it has no audio projector"
    )


# A child that takes requests (writing a "." for each) and answers each with its body once its
# stdin ends.
_HOLDING_CHILD = """
import http.server, os, sys, threading
released = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), released.set()), daemon=True).start()

class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["content-length"]))
        os.write(1, b".")
        released.wait()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer.request_queue_size = 128
server = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
os.write(1, b"listening\\n")
server.serve_forever()
"""


def _holding_child(name: str) -> ChildModel:
    import subprocess
    import sys

    from llamacrab._ports import free_port

    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", _HOLDING_CHILD, str(port)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)  # fmt: skip
    assert process.stdout is not None and process.stdout.readline() == b"listening\n"
    return ChildModel(name, process, port, "key", lambda *_: None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("held_in", ["answer", "load"])
def test_requests_waiting_on_one_model_never_hold_up_another(
    tiny_model_path: Path, held_in: str
) -> None:
    import threading
    from concurrent.futures import ThreadPoolExecutor

    # Found by an audit: the lease and the forwarding waited in anyio's 40 threads, which every
    # sync route shares: 44 long requests to an isolated model made a 2-token request to
    # another, loaded model wait 7.8 s. Here 48 requests to "slow" wait until released, for
    # its child's answers or for its load.
    slow, quick = _holding_child("slow"), _holding_child("quick")
    assert slow.process.stdin is not None and quick.process.stdin is not None
    quick.process.stdin.close()  # it answers at once
    loaded, leasing = threading.Event(), threading.Semaphore(0)

    def load(entry: ModelEntry) -> ChildModel:
        if entry.name == "quick":
            return quick
        if held_in == "load":
            loaded.wait()
        return slow

    class Counted(ModelRegistry):
        def lease(self, name: str) -> Loaded:
            leasing.release()
            return super().lease(name)

    registry = Counted([ModelEntry(name, str(tiny_model_path)) for name in ("slow", "quick")],
                       loader=load)  # fmt: skip
    server = LiveServer(ServerSettings(model=""), registry=registry)
    url = server.url + "/v1/completions"
    try:
        with ThreadPoolExecutor(48) as pool:
            waiting = [pool.submit(httpx.post, url, json={"model": "slow"}, timeout=60)
                       for _ in range(48)]  # fmt: skip
            try:  # 40 of them hold a thread each (as many as anyio lends by default)
                if held_in == "answer":
                    assert slow.process.stdout and slow.process.stdout.read(40) == b"." * 40
                else:
                    assert all(leasing.acquire(timeout=30) for _ in range(40))
                start = time.monotonic()
                answer = httpx.post(url, json={"model": "quick"}, timeout=10)
                took = time.monotonic() - start
            finally:  # the others go on
                loaded.set()
                slow.process.stdin.close()
            assert [f.result().status_code for f in waiting] == [200] * 48
        assert answer.status_code == 200 and answer.json() == {"model": "quick"}
        assert took < 5
    finally:
        server.close()


def test_a_response_stored_by_an_isolated_model_is_read_and_deleted_without_naming_it(
    server: LiveServer,
) -> None:
    # Found by review: a stored response's routes name no model, so the server answered them
    # from its own store, which lacks what the child stored: client.responses.retrieve(id)
    # got 404 for every response of an isolated model.
    body = {
        "model": "apart",
        "max_output_tokens": 2,
        "temperature": 0,
        "input": [{"role": "user", "content": "first"}, {"role": "user", "content": "then"}],
    }
    created = httpx.post(server.url + "/v1/responses", json=body, headers=AUTH, timeout=120)
    assert created.status_code == 200, created.text
    url = f"{server.url}/v1/responses/{created.json()['id']}"
    assert httpx.get(url, headers=AUTH).json() == created.json()
    page = httpx.get(url + "/input_items", params={"order": "asc", "limit": 1}, headers=AUTH)
    assert page.status_code == 200, page.text
    assert page.json()["has_more"] and page.json()["data"][0]["content"][0]["text"] == "first"
    deleted = httpx.delete(url, headers=AUTH)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    gone = httpx.get(url, headers=AUTH)
    assert gone.status_code == 404 and "is not stored here" in gone.json()["error"]["message"]


# A child that stores "resp_there" alone: it answers each request for it with what it got
# (given "failing", a 500 to every request, as one shutting down).
_STORING_CHILD = """
import http.server, json, os, sys

class Handler(http.server.BaseHTTPRequestHandler):
    def answer(self):
        got = {"method": self.command, "path": self.path, "key": self.headers["authorization"]}
        body = json.dumps(got).encode()
        stored = 200 if "/resp_there" in self.path else 404
        self.send_response(500 if sys.argv[2:] == ["failing"] else stored)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_DELETE = answer

    def log_message(self, *args):
        pass

server = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
os.write(1, b"listening\\n")
server.serve_forever()
"""


@pytest.mark.timeout(120)
def test_stored_response_routes_ask_the_children_that_answer_and_skip_the_others(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket
    import subprocess
    import sys

    from llamacrab import Llama
    from llamacrab._ports import free_port
    from llamacrab.server import _responses_children

    monkeypatch.setattr(_responses_children, "_TIMEOUT", 0.3)
    with socket.socket() as sock:  # a port nothing listens on: a child that died
        sock.bind(("127.0.0.1", 0))
        dead_port = sock.getsockname()[1]
    hung = socket.create_server(("127.0.0.1", 0))  # takes connections, never answers

    def storing(port: int, *how: str) -> subprocess.Popen[bytes]:
        process = subprocess.Popen([sys.executable, "-c", _STORING_CHILD, str(port), *how],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        assert process.stdout is not None and process.stdout.readline() == b"listening\n"
        return process

    port, failing_port = free_port(), free_port()

    def child(name: str, port: int) -> ChildModel:
        idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],
                                stderr=subprocess.PIPE)  # fmt: skip
        return ChildModel(name, idle, port, "key", lambda *_: None)

    stubs = {"dead": child("dead", dead_port), "hung": child("hung", hung.getsockname()[1]),
             "failing": ChildModel("failing", storing(failing_port, "failing"), failing_port,
                                   "key", lambda *_: None),
             "there": ChildModel("there", storing(port), port, "key", lambda *_: None)}  # fmt: skip

    def load(entry: ModelEntry) -> Loaded:
        if entry.name in stubs:
            return stubs[entry.name]
        return Llama(entry.model, n_ctx=256, n_threads=1, chat_format="chatml")

    names = [*stubs, "local"]
    registry = ModelRegistry([ModelEntry(n, str(tiny_model_path)) for n in names], loader=load)
    for name in stubs:
        registry.start(name)
    live = LiveServer(ServerSettings(model=""), registry=registry)
    try:
        url = live.url + "/v1/responses/resp_there"
        # A 500 (the failing child) is skipped, not passed on; ?model= stays here (the child
        # serves its model under another name), and loads no model (found by fuzzing: it
        # loaded "local" to look there).
        for method, path in [("GET", "/v1/responses/resp_there/input_items?limit=1&order=asc"),
                             ("DELETE", "/v1/responses/resp_there"),
                             ("POST", "/responses/resp_there/cancel")]:  # fmt: skip
            named = path + ("&" if "?" in path else "?") + "model=local"
            answer = httpx.request(method, live.url + named, timeout=30)
            assert answer.status_code == 200, answer.text  # the child's answer, unchanged
            assert answer.json() == {"method": method, "path": path, "key": "Bearer key"}
        assert httpx.get(url, timeout=30).json()["method"] == "GET"
        assert registry.status("local").status == "unloaded"
        missing = httpx.get(live.url + "/v1/responses/resp_nowhere", timeout=30)
        assert missing.status_code == 404, missing.text  # not a 500 from the dead or hung
        assert "'resp_nowhere' is not stored here" in missing.json()["error"]["message"]
        # A follow-up naming another model is refused, naming the one that can continue it.
        body = {"model": "local", "input": "hi", "previous_response_id": "resp_there"}
        refused = httpx.post(live.url + "/v1/responses", json=body, timeout=30)
        assert refused.status_code == 404, refused.text
        assert refused.json()["error"]["param"] == "previous_response_id"
        assert "stored by model 'there'" in refused.json()["error"]["message"]
    finally:
        live.close()  # closes the registry, and the children with it
        hung.close()


def test_cancelling_a_child_unloads_its_model_there_by_force() -> None:
    # Found by an audit: a forced unload of an isolated model cancelled nothing (cancel was a
    # no-op), and SIGTERM stops the child's server gracefully: the unload answered after its
    # 86 requests had all run to the end, 12 s later.
    import http.server
    import subprocess
    import sys
    import threading

    received: list[tuple[str, str, bytes]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            received.append((self.path, self.headers["authorization"], body))
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    stub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],
                            stderr=subprocess.PIPE)  # fmt: skip
    child = ChildModel("apart", idle, stub.server_address[1], "key", lambda *_: None)
    try:
        child.cancel()
    finally:
        child.close()
        stub.shutdown()
    assert received == [
        ("/models/unload", "Bearer key", b'{"model": "apart", "force": true}')
    ]  # fmt: skip
