"""A hostile hub endpoint gets the model's bytes to say and nothing else: no file written
outside the cache, no endless listing, no token sent to another host."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hub_server import HubServer, Repo, Tamper

from llamacrab import HubError, HubOptions, InvalidModelError, Llama, resolve
from llamacrab._features import hub_guard

from support import load_repo_module

TOKEN = "hf_hostileTOKEN456"
tiny = load_repo_module("scripts/make_tiny_gguf.py")


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    model = tiny.write_tiny_llama(tmp_path_factory.mktemp("hostile") / "m.gguf").read_bytes()
    server = HubServer({"crab/m": Repo({"main": {"m.gguf": model}})})
    yield server
    server.close()


@pytest.fixture
def hostile(hub: HubServer) -> Iterator[Callable[[Tamper], None]]:
    def set_tamper(tamper: Tamper) -> None:
        hub.tamper = tamper

    yield set_tamper
    hub.tamper = None


def _resolve(hub: HubServer, cache: Path) -> Path:
    return resolve("crab/m", HubOptions(endpoint=hub.endpoint, cache_dir=cache, token=TOKEN)).path


def _on_resolve(**changes: str) -> Tamper:
    """Headers of every answer about a file (HEAD and GET /resolve/) changed."""

    def tamper(method: str, path: str, status: int, body: bytes, headers: dict[str, str]):  # type: ignore[no-untyped-def]
        if "/resolve/" in path:
            headers = {**headers, **changes}
        return status, body, headers

    return tamper


def _nothing_outside(cache: Path, sentinel: Path) -> None:
    assert not sentinel.exists() or not any(sentinel.iterdir()), list(sentinel.rglob("*"))
    blobs = cache / "models--crab--m" / "blobs"
    assert not blobs.exists() or not any(blobs.iterdir())


@pytest.mark.parametrize("header", ["ETag", "X-Linked-Etag"])
@pytest.mark.parametrize("form", ["absolute", "climbing", "weak absolute"])
def test_an_etag_that_is_a_path_is_refused_before_anything_is_written(
    hub: HubServer, hostile: Callable[[Tamper], None], tmp_path: Path, header: str, form: str
) -> None:
    # huggingface_hub 2.4.0 writes the download to blobs/<etag>: an absolute ETag put it
    # anywhere on disk (the probe in the closing note of this change wrote outside the cache).
    sentinel = tmp_path / "elsewhere"
    sentinel.mkdir()
    target = sentinel / "written-by-the-hub.gguf"
    etag = {
        "absolute": f'"{target}"',
        "climbing": f'"{"../" * 12}{str(target).lstrip("/")}"',
        "weak absolute": f'W/"{target}"',
    }[form]
    hostile(_on_resolve(**{header: etag}))
    cache = tmp_path / "cache"
    with pytest.raises(HubError, match="answered an ETag that is not a plain name"):
        _resolve(hub, cache)
    _nothing_outside(cache, sentinel)


def test_a_commit_hash_that_is_a_path_is_refused(
    hub: HubServer, hostile: Callable[[Tamper], None], tmp_path: Path
) -> None:
    hostile(_on_resolve(**{"X-Repo-Commit": str(tmp_path / "elsewhere")}))
    with pytest.raises(HubError, match="answered an X-Repo-Commit that is not a plain name"):
        _resolve(hub, tmp_path / "cache")
    assert not (tmp_path / "elsewhere").exists()


def test_a_missing_file_s_commit_hash_never_names_a_directory(
    hub: HubServer, hostile: Callable[[Tamper], None], tmp_path: Path
) -> None:
    # huggingface_hub marks a missing file with .no_exist/<X-Repo-Commit of the 404>/<name>:
    # the hub could make it create directories and files anywhere.
    sentinel = tmp_path / "elsewhere"

    def missing(method: str, path: str, status: int, body: bytes, headers: dict[str, str]):  # type: ignore[no-untyped-def]
        if "/resolve/" in path:
            return 404, b"{}", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": str(sentinel)}
        return status, body, headers

    hostile(missing)
    with pytest.raises(HubError, match="X-Repo-Commit that is not a plain name"):
        _resolve(hub, tmp_path / "cache")
    assert not sentinel.exists()


def _rate_limited(times: int, **changes: str) -> Tamper:
    """The first ``times`` answers about a file are 429s with ``changes`` in their headers."""
    left = [times]

    def tamper(method: str, path: str, status: int, body: bytes, headers: dict[str, str]):  # type: ignore[no-untyped-def]
        if "/resolve/" in path and left[0] > 0:
            left[0] -= 1
            return 429, b"slow down", {**headers, **changes}
        return status, body, headers

    return tamper


def _resolve_on_a_thread(hub: HubServer, cache: Path, seconds: float) -> object:
    """What ``_resolve`` returned or raised; a failure if it still runs after ``seconds``."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(_resolve(hub, cache))
        except Exception as error:
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)  # (the old code sleeps on for a day)
    thread.start()
    thread.join(seconds)
    assert outcome, f"resolve still waiting after {seconds} s"
    return outcome[0]


@pytest.mark.parametrize(
    "wait",
    [
        {"Retry-After": "86400"},
        {"RateLimit": '"api";r=0;t=86400', "RateLimit-Policy": '"fixed window";"api";q=5;w=86400'},
        {"Retry-After": "9" * 5000},  # int() refuses it: a ValueError from inside the retries
    ],
    ids=["retry-after a day", "ratelimit reset a day", "retry-after 5000 digits"],
)
def test_a_rate_limit_longer_than_a_minute_is_refused_at_once(
    hub: HubServer, hostile: Callable[[Tamper], None], tmp_path: Path, wait: dict[str, str]
) -> None:
    # huggingface_hub 2.4.0 sleeps whatever a 429 names before each of its five retries.
    hostile(_rate_limited(10, **wait))
    outcome = _resolve_on_a_thread(hub, tmp_path / "cache", seconds=30)
    assert isinstance(outcome, HubError), outcome
    assert "rate-limiting these requests" in str(outcome) or "too long to read" in str(outcome)


def test_a_short_rate_limit_is_waited_for(
    hub: HubServer, hostile: Callable[[Tamper], None], tmp_path: Path
) -> None:
    # The first HEAD is tried once (huggingface_hub then looks for a cached copy); its retry
    # goes through the backoff, which honours the wait.
    hostile(_rate_limited(2, **{"Retry-After": "1"}))
    started = time.monotonic()
    path = _resolve_on_a_thread(hub, tmp_path / "cache", seconds=60)
    assert isinstance(path, Path) and path.is_file(), path
    assert time.monotonic() - started >= 1  # it did wait, as asked


def _listing(pages: Callable[[str], tuple[list[object], str | None]]) -> Tamper:
    """The tree answered by ``pages(url) -> (entries, next URL or None)``."""

    def tamper(method: str, path: str, status: int, body: bytes, headers: dict[str, str]):  # type: ignore[no-untyped-def]
        if "/tree/" not in path:
            return status, body, headers
        entries, following = pages(path)
        headers = {"Content-Type": "application/json"}
        if following is not None:
            headers["Link"] = f'<{following}>; rel="next"'
        return 200, json.dumps(entries).encode(), headers

    return tamper


def _file(name: str) -> dict[str, object]:
    return {"type": "file", "path": name, "size": 1, "oid": "0" * 40}


def test_an_endless_listing_stops_at_its_page_limit(
    hub: HubServer, hostile: Callable[[Tamper], None], tmp_path: Path
) -> None:
    pages_served = []

    def endless(path: str) -> tuple[list[object], str | None]:
        pages_served.append(path)
        return [
            _file(f"f{len(pages_served)}.bin")
        ], f"{hub.endpoint}/api/models/crab/m/tree/main?p={len(pages_served)}"

    hostile(_listing(endless))
    with pytest.raises(HubError, match="the hub's listing runs past 1000 pages"):
        _resolve(hub, tmp_path)
    assert len(pages_served) == 1000


def test_a_listing_that_drags_on_stops_at_its_deadline(
    hub: HubServer,
    hostile: Callable[[Tamper], None],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every page within the request timeout, the pages without end: 1,000 pages of 9 s each
    # would take two and a half hours.
    monkeypatch.setattr(hub_guard, "MAX_LISTING_SECONDS", 0.5)

    def slow(path: str) -> tuple[list[object], str | None]:
        time.sleep(0.1)
        return [_file("m.gguf")], f"{hub.endpoint}/api/models/crab/m/tree/main?t={time.time()}"

    hostile(_listing(slow))
    started = time.monotonic()
    with pytest.raises(HubError, match=r"the hub.s listing took more than 0\.5 s"):
        _resolve(hub, tmp_path)
    assert time.monotonic() - started < 5


def test_a_listing_past_the_file_limit_is_refused(
    hub: HubServer, hostile: Callable[[Tamper], None], tmp_path: Path
) -> None:
    many = [_file(f"f{i}.bin") for i in range(100_001)]
    hostile(_listing(lambda path: (many, None)))
    with pytest.raises(HubError, match="lists more than 100000 files"):
        _resolve(hub, tmp_path)


def test_empty_pages_that_go_on_are_refused_at_once(
    hub: HubServer, hostile: Callable[[Tamper], None], tmp_path: Path
) -> None:
    hostile(_listing(lambda path: ([], f"{hub.endpoint}/api/models/crab/m/tree/main?again=1")))
    with pytest.raises(HubError, match="an empty page that is not its last"):
        _resolve(hub, tmp_path)


def test_a_next_page_on_another_host_is_not_fetched_and_gets_no_token(
    hub: HubServer, hostile: Callable[[Tamper], None], tmp_path: Path
) -> None:
    elsewhere = HubServer({"crab/m": Repo({"main": {"m.gguf": b"GGUF"}})})
    seen: list[str] = []
    elsewhere.tamper = lambda method, path, status, body, headers: (
        seen.append(path) or (status, body, headers)  # type: ignore[func-returns-value]
    )
    try:
        next_url = f"{elsewhere.endpoint}/api/models/crab/m/tree/main?page=2"
        hostile(_listing(lambda path: ([_file("m.gguf")], next_url)))
        with pytest.raises(HubError, match="the hub's listing continues on another host"):
            _resolve(hub, tmp_path)
        assert seen == []
    finally:
        elsewhere.close()


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"<html>not json</html>", "the hub's listing is not JSON"),
        (b'{"error": "a dict"}', "not a list of entries"),
        (b"[1, 2, 3]", "not a list of entries"),
        (b'[{"type": "file", "path": 7}]', "unsafe file name 7"),
        (b'[{"type": "file", "path": "../m.gguf"}]', "unsafe file name '../m.gguf'"),
        (b'[{"type": "file", "path": "/etc/m.gguf"}]', "unsafe file name '/etc/m.gguf'"),
        (b'[{"type": "file", "path": "a\\\\m.gguf"}]', "unsafe file name"),
        (b'[{"type": "file", "path": "a//m.gguf"}]', "unsafe file name"),
    ],
)
def test_a_listing_that_is_not_a_listing_is_refused(
    hub: HubServer, hostile: Callable[[Tamper], None], tmp_path: Path, body: bytes, match: str
) -> None:
    def tamper(method: str, path: str, status: int, sent: bytes, headers: dict[str, str]):  # type: ignore[no-untyped-def]
        return (200, body, headers) if "/tree/" in path else (status, sent, headers)

    hostile(tamper)
    with pytest.raises(HubError, match=match):
        _resolve(hub, tmp_path)


def test_the_hub_s_bytes_are_the_gguf_checks_to_refuse(
    hub: HubServer, hostile: Callable[[Tamper], None], tmp_path: Path
) -> None:
    garbage = b"GGUF" + bytes(range(256)) * 4

    def bad_bytes(method: str, path: str, status: int, body: bytes, headers: dict[str, str]):  # type: ignore[no-untyped-def]
        if "/resolve/" in path:  # (a HEAD's body is not sent; its length is)
            return status, garbage, {**headers, "ETag": '"' + "e" * 64 + '"'}
        return status, body, headers

    hostile(bad_bytes)
    path = _resolve(hub, tmp_path)
    with pytest.raises(InvalidModelError):
        Llama(path, n_ctx=64, n_threads=1)


def test_an_honest_answer_after_hostile_ones_still_resolves_and_loads(
    hub: HubServer, hostile: Callable[[Tamper], None], tmp_path: Path
) -> None:
    hostile(_on_resolve(ETag=f'"{tmp_path}/x"'))
    with pytest.raises(HubError):
        _resolve(hub, tmp_path / "cache")
    hub.tamper = None
    with Llama(_resolve(hub, tmp_path / "cache"), n_ctx=64, n_threads=1) as llm:
        answer = llm.create_completion("the cat", max_tokens=2, temperature=0)
        assert answer.usage.completion_tokens == 2
