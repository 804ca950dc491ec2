"""Server replicas on Ray Serve: a local Ray cluster on loopback, two replicas of the tiny
model behind Serve's proxy, driven with the openai SDK; one replica killed under load."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import ray
from ray import serve

from llamacrab import InvalidParameterError
from llamacrab._ports import free_port
from llamacrab.cli import main
from llamacrab.server import ServerSettings, ray_deployment

KEY = "ray-test-key"
HEADER = "x-llamacrab-replica"


@pytest.fixture(scope="module")
def base_url(tiny_model_path: Path) -> Iterator[str]:
    """Two replicas (half a CPU each: the machine has two cores) on a fresh local cluster."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        settings = ServerSettings(model=str(tiny_model_path), model_alias="tiny", n_ctx=1024,
                                  n_threads=1, chat_template="chatml", api_keys=(KEY,))  # fmt: skip
        app = ray_deployment(settings, num_replicas=2, ray_actor_options={"num_cpus": 0.5})
        serve.run(app, name="llamacrab", route_prefix="/")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        serve.shutdown()
        ray.shutdown()


def _client(base_url: str, key: str = KEY) -> openai.OpenAI:
    # No retries: a failed request must reach the test as the error its client saw.
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)


def _replicas_answering(base_url: str, requests: int) -> set[str]:
    """The replicas named by ``requests`` chat completions sent four at a time."""
    client, seen, lock = _client(base_url), set(), threading.Lock()

    def ask(n: int) -> None:
        for _ in range(n):
            raw = client.chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8
            )
            assert raw.parse().choices[0].finish_reason in ("stop", "length")
            with lock:
                seen.add(raw.headers[HEADER])

    threads = [threading.Thread(target=ask, args=(requests // 4,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return seen


def _replica_actors() -> dict[str, str]:
    """Replica id -> its actor's name (``SERVE_REPLICA::app#deployment#id``)."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return {n.rsplit("#", 1)[1]: n for n in names if n.startswith("SERVE_REPLICA::llamacrab#")}


def test_two_replicas_share_requests_with_the_same_routes_and_keys(base_url: str) -> None:
    assert _replicas_answering(base_url, 16) == set(_replica_actors())
    assert len(_replica_actors()) == 2
    assert [m.id for m in _client(base_url).models.list()] == ["tiny"]
    with pytest.raises(openai.AuthenticationError):
        _client(base_url, key="wrong").models.list()


class _Load:
    """Clients streaming completions (long enough to be killed midway) until stopped; each
    outcome recorded: "ok" (a last chunk with its finish_reason), "error" (an exception, of the
    given type), "hang" (a timeout) or "silent" (a stream that ended without a finish_reason:
    lost without an error)."""

    def __init__(self, base_url: str, clients: int) -> None:
        self.client = _client(base_url)
        self.outcomes: list[tuple[str, Any, float]] = []  # kind, detail, when it was sent
        self.in_flight: dict[int, str] = {}
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]
        for thread in self.threads:
            thread.start()

    def _run(self, i: int) -> None:
        while not self.stop.is_set():
            sent = time.monotonic()
            kind, detail = self._one(i)
            with self.lock:
                self.outcomes.append((kind, detail, sent))

    def _one(self, i: int) -> tuple[str, Any]:
        try:
            raw = self.client.completions.with_raw_response.create(
                model="tiny", prompt="Once", max_tokens=600, stream=True,
                extra_body={"min_tokens": 600},
            )  # fmt: skip
            with self.lock:
                self.in_flight[i] = raw.headers[HEADER]
            finish = [c.choices[0].finish_reason for c in raw.parse() if c.choices]
            return ("ok", finish[-1]) if finish and finish[-1] else ("silent", finish)
        except openai.APITimeoutError as error:  # a hang is not an answer
            return "hang", error
        except openai.OpenAIError as error:
            return "error", type(error).__name__
        finally:
            with self.lock:
                self.in_flight.pop(i, None)

    def streaming_on(self) -> list[str]:
        with self.lock:
            return list(self.in_flight.values())

    def answered_since(self, moment: float) -> int:
        with self.lock:
            return sum(kind == "ok" and sent > moment for kind, _, sent in self.outcomes)

    def finish(self) -> list[tuple[str, Any, float]]:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)
        assert not any(t.is_alive() for t in self.threads)
        return self.outcomes


def _wait_for(condition: Any, seconds: float, what: str) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.5)
    raise AssertionError(f"not within {seconds} s: {what}")


def test_a_killed_replica_is_replaced_and_no_request_is_lost_silently(base_url: str) -> None:
    before = _replica_actors()
    load = _Load(base_url, clients=4)
    victim = _wait_for(load.streaming_on, 60, "a stream in flight")[0]
    ray.kill(ray.get_actor(before[victim], namespace="serve"), no_restart=True)
    killed = time.monotonic()
    # The load goes on while Serve notices and replaces the replica.
    _wait_for(lambda: load.answered_since(killed) >= 4, 120, "answers after the kill")
    outcomes = load.finish()

    kinds = [kind for kind, _, _ in outcomes]
    assert "silent" not in kinds and "hang" not in kinds, outcomes
    assert kinds.count("error") >= 1, outcomes  # the killed replica's streams failed loudly
    replaced = _wait_for(lambda: (a := _replica_actors()).keys() - before.keys() and
                         len(a) == 2 and victim not in a and a, 120, "a new replica")  # fmt: skip
    new = next(iter(replaced.keys() - before.keys()))
    _wait_for(lambda: new in _replicas_answering(base_url, 8), 120, "the new replica answering")


def test_autoscaling_adds_a_replica_under_load(base_url: str, tiny_model_path: Path) -> None:
    """The same application redeployed with autoscaling (one to two replicas, one request
    each as Serve's target): it starts at one, and streaming clients make Serve add the
    second, which then answers too. Runs after the other replica tests: it replaces their app."""
    settings = ServerSettings(model=str(tiny_model_path), model_alias="tiny", n_ctx=1024,
                              n_threads=1, chat_template="chatml", api_keys=(KEY,))  # fmt: skip
    # Serve wants its look-back period longer than its 10 s metrics interval.
    scaling = {"min_replicas": 1, "initial_replicas": 1, "max_replicas": 2,
               "target_ongoing_requests": 1, "upscale_delay_s": 0, "downscale_delay_s": 600,
               "look_back_period_s": 12}  # fmt: skip
    app = ray_deployment(settings, autoscaling_config=scaling, ray_actor_options={"num_cpus": 0.5})
    serve.run(app, name="llamacrab", route_prefix="/")
    alone = _wait_for(lambda: len(a := _replica_actors()) == 1 and a, 120, "one replica")
    load = _Load(base_url, clients=4)
    try:
        grown = _wait_for(lambda: len(a := _replica_actors()) == 2 and a, 120, "a second replica")
        added = next(iter(grown.keys() - alone.keys()))
        _wait_for(lambda: added in load.streaming_on(), 120, "the added replica streaming")
    finally:
        outcomes = load.finish()
    assert {kind for kind, _, _ in outcomes} <= {"ok"}, outcomes


def test_deployment_options_are_checked_before_ray_sees_them(tiny_model_path: Path) -> None:
    settings = ServerSettings(model=str(tiny_model_path))
    with pytest.raises(InvalidParameterError, match="not both"):
        ray_deployment(settings, num_replicas=2, autoscaling_config={"max_replicas": 3})
    with pytest.raises(InvalidParameterError, match="max_replicas"):
        ray_deployment(settings, autoscaling_config={"min_replicas": 2})
    with pytest.raises(InvalidParameterError, match="num_replicas"):
        ray_deployment(settings, num_replicas=0)
    with pytest.raises(InvalidParameterError, match="are for generation"):
        ray_deployment(ServerSettings(model=str(tiny_model_path), embeddings=True,
                                      lora=(str(tiny_model_path),)))  # fmt: skip


def test_serve_flags_become_ray_options(
    monkeypatch: pytest.MonkeyPatch, tiny_model_path: Path
) -> None:
    calls: list[tuple[ServerSettings, dict[str, Any]]] = []
    monkeypatch.setattr("llamacrab.server.serve_ray", lambda s, **kw: calls.append((s, kw)))
    model = str(tiny_model_path)
    assert main(["serve", model, "--ray", "--autoscale-max", "3", "--replica-cpus", "0.5",
                 "--ray-address", "auto", "--parallel", "2"]) == 0  # fmt: skip
    settings, options = calls[0]
    assert settings.parallel == 2
    assert options == {"address": "auto", "num_replicas": None,
                       "autoscaling_config": {"max_replicas": 3},
                       "ray_actor_options": {"num_cpus": 0.5}}  # fmt: skip
    assert main(["serve", model, "--replicas", "2"]) == 1  # needs --ray
    assert main(["serve", model, "--ray", "--replicas", "2", "--autoscale-max", "3"]) == 1
    assert main(["serve", model, "--ray", "--autoscale-min", "2"]) == 1
    assert len(calls) == 1


def test_without_ray_the_server_works_and_asking_for_replicas_names_the_extra(
    tiny_model_path: Path,
) -> None:
    child = f"""
import sys
sys.modules["ray"] = None  # as if the extra were not installed
import llamacrab.cli, llamacrab.server
from llamacrab.server import MissingExtraError, ServerSettings, ray_deployment
try:
    ray_deployment(ServerSettings(model={str(tiny_model_path)!r}))
except MissingExtraError as error:
    print(error)
"""
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                            timeout=120, check=True)  # fmt: skip
    assert "pip install 'llamacrab[ray]'" in result.stdout
