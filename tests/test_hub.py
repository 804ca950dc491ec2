"""org/repo models through the real huggingface_hub client, against a Hub look-alike on loopback."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hub_server import HubServer, Repo
from live_server import LiveServer

from llamacrab import HubError, HubOptions, Llama, ModelLoadError, resolve
from llamacrab.server import ServerSettings

from support import load_repo_module

TOKEN = "hf_secretTOKEN123"
tiny = load_repo_module("scripts/make_tiny_gguf.py")


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    work = tmp_path_factory.mktemp("hub-files")
    model = tiny.write_tiny_llama(work / "m0.gguf").read_bytes()
    other = tiny.write_tiny_llama(work / "m1.gguf", seed=1).read_bytes()
    parts = [p.read_bytes() for p in tiny.write_tiny_llama_split(work, "big")]
    server = HubServer({
        "crab/single": Repo({"main": {"model-Q4_K_M.gguf": model, "README.md": b"# tiny"}}),
        "crab/several": Repo({"main": {"a-Q4_K_M.gguf": model, "b-Q8_0.gguf": other}}),
        "crab/split": Repo({"main": {
            "big-00001-of-00002.gguf": parts[0], "big-00002-of-00002.gguf": parts[1],
            "mmproj-big-f16.gguf": other,
        }}),
        "crab/revs": Repo({"main": {"m.gguf": model}, "v1": {"m.gguf": other}}),
        "crab/gated": Repo({"main": {"m.gguf": model}}, token=TOKEN),
    })  # fmt: skip
    yield server
    server.close()


def options(hub: HubServer, cache: Path, **kwargs: object) -> HubOptions:
    return HubOptions(endpoint=hub.endpoint, cache_dir=cache, **kwargs)  # type: ignore[arg-type]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_single_file_repo_downloads_loads_and_reuses_the_cache(
    hub: HubServer, tmp_path: Path
) -> None:
    with Llama("crab/single", endpoint=hub.endpoint, cache_dir=tmp_path, n_ctx=64) as llm:
        assert (
            llm.create_completion("the cat", max_tokens=2, min_tokens=2).usage.completion_tokens
            == 2
        )
        path = llm.files.path
    # The standard huggingface_hub cache layout, shared with other tools.
    assert path.parts[-4:-2] == ("models--crab--single", "snapshots")
    assert path.name == "model-Q4_K_M.gguf"
    downloads = [
        r for r in hub.repos["crab/single"].requests if r.startswith("GET /crab/single/resolve")
    ]
    resolve("crab/single", options(hub, tmp_path))
    again = [
        r for r in hub.repos["crab/single"].requests if r.startswith("GET /crab/single/resolve")
    ]
    assert len(again) == len(downloads) == 1  # the second resolve downloaded nothing


def test_several_models_need_a_filename(hub: HubServer, tmp_path: Path) -> None:
    with pytest.raises(HubError, match=r"several GGUF models.*a-Q4_K_M.gguf.*b-Q8_0.gguf"):
        resolve("crab/several", options(hub, tmp_path))
    chosen = resolve("crab/several", options(hub, tmp_path, filename="*Q8_0*"))
    assert chosen.path.name == "b-Q8_0.gguf"
    exact = resolve("crab/several", options(hub, tmp_path, filename="a-Q4_K_M.gguf"))
    assert exact.path.name == "a-Q4_K_M.gguf"
    with pytest.raises(HubError, match="no GGUF model file matching"):
        resolve("crab/several", options(hub, tmp_path, filename="*F16*"))


def test_split_model_downloads_every_part_and_its_projector(hub: HubServer, tmp_path: Path) -> None:
    files = resolve("crab/split", options(hub, tmp_path, mmproj=True))
    assert [p.name for p in files.parts] == ["big-00001-of-00002.gguf", "big-00002-of-00002.gguf"]
    assert files.path == files.parts[0] and all(p.is_file() for p in files.parts)
    assert files.mmproj is not None and files.mmproj.name == "mmproj-big-f16.gguf"
    # Llama(mmproj=True) (serve --hf-mmproj) fetches it too: here a model, not a projector.
    with pytest.raises(ModelLoadError, match=r"mmproj-big-f16\.gguf"):
        Llama("crab/split", endpoint=hub.endpoint, cache_dir=tmp_path, n_ctx=64, mmproj=True)
    with Llama("crab/split", endpoint=hub.endpoint, cache_dir=tmp_path, n_ctx=64) as llm:
        assert llm.model.n_layer == 2


def test_revisions_by_branch_and_commit(hub: HubServer, tmp_path: Path) -> None:
    main = resolve("crab/revs", options(hub, tmp_path))
    v1 = resolve("crab/revs", options(hub, tmp_path, revision="v1"))
    assert digest(main.path) != digest(v1.path)
    commit = hub.repos["crab/revs"].commit("v1")
    assert digest(resolve("crab/revs", options(hub, tmp_path, revision=commit)).path) == digest(
        v1.path
    )
    with pytest.raises(HubError, match="no such revision"):
        resolve("crab/revs", options(hub, tmp_path, revision="v9"))


def test_gated_repo_needs_the_token_which_never_leaks(
    hub: HubServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(HubError, match="gated"):
        resolve("crab/gated", options(hub, tmp_path / "none"))
    granted = options(hub, tmp_path / "granted", token=TOKEN)
    assert resolve("crab/gated", granted).path.is_file()
    assert TOKEN not in repr(granted) and TOKEN not in str(granted)
    # Failures of calls that carry a token: neither the token nor its causes' text shows it.
    wrong_token = "hf_wrongTOKEN987"
    with pytest.raises(HubError) as wrong:
        resolve("crab/gated", options(hub, tmp_path / "wrong", token=wrong_token))
    with pytest.raises(HubError, match="no such revision") as missing:
        resolve("crab/gated", options(hub, tmp_path / "missing", token=TOKEN, revision="v9"))
    for secret, error in ((wrong_token, wrong.value), (TOKEN, missing.value)):
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        assert secret not in text and secret not in repr(error.args)
    assert TOKEN not in caplog.text and wrong_token not in caplog.text


def test_offline_uses_the_cache_and_fails_clearly_without_it(
    hub: HubServer, tmp_path: Path
) -> None:
    online = resolve("crab/single", options(hub, tmp_path))
    nowhere = HubOptions(endpoint="http://127.0.0.1:9", cache_dir=tmp_path, offline=True)
    assert resolve("crab/single", nowhere).path == online.path
    with pytest.raises(HubError, match="not in the Hugging Face cache and offline mode is on"):
        resolve("crab/revs", nowhere)


def test_unknown_repository(hub: HubServer, tmp_path: Path) -> None:
    with pytest.raises(HubError, match="repository not found"):
        resolve("crab/nothing-here", options(hub, tmp_path))


def test_local_paths_are_left_alone(tiny_model_path: Path) -> None:
    assert resolve(tiny_model_path).path == tiny_model_path


def test_environment_variables_keep_working(hub: HubServer, tmp_path: Path) -> None:
    # huggingface_hub reads them at import: a fresh interpreter sees what a user's shell sets.
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(tmp_path / "home"),
           "HF_TOKEN": TOKEN}  # fmt: skip
    code = "from llamacrab import resolve; print(resolve('crab/gated').path)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert Path(out.stdout.strip()).is_relative_to(tmp_path / "home")
    env["HF_HUB_OFFLINE"] = "1"
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]


def test_cli_runs_a_hub_model(hub: HubServer, tmp_path: Path) -> None:
    def llamacrab(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "llamacrab", "run", "crab/several",
                   "--endpoint", hub.endpoint, "--cache-dir", str(tmp_path), "--n-ctx", "64",
                   "-p", "the cat", "-n", "3", "--temperature", "0", *args]  # fmt: skip
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    chosen = llamacrab("--filename", "*Q4_K_M*")
    assert chosen.returncode == 0, chosen.stderr[-2000:]
    assert chosen.stdout.strip()
    ambiguous = llamacrab()
    assert ambiguous.returncode == 1 and "several GGUF models" in ambiguous.stderr


def test_the_server_serves_a_hub_model(hub: HubServer, tmp_path: Path) -> None:
    settings = ServerSettings(model="crab/gated", hf_endpoint=hub.endpoint, hf_token=TOKEN,
                              hf_cache_dir=str(tmp_path), n_ctx=64)  # fmt: skip
    assert TOKEN not in repr(settings)
    server = LiveServer(settings)
    try:
        assert server.wait_until_loaded() == 200
        assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "crab/gated"
        # min_tokens: the random tiny model may sample its end token first (it did in CI)
        body = {"model": "crab/gated", "prompt": "the cat", "max_tokens": 3, "min_tokens": 3}
        answer = httpx.post(server.url + "/v1/completions", json=body)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
    finally:
        server.close()
    refused = LiveServer(ServerSettings(model="crab/gated", hf_endpoint=hub.endpoint,
                                        hf_cache_dir=str(tmp_path / "empty")))  # fmt: skip
    try:
        assert refused.wait_until_loaded() == 503
        error = httpx.get(refused.url + "/health").json()["error"]
        assert "gated" in error and TOKEN not in error
    finally:
        refused.close()


def test_serve_fetches_the_hub_projector_when_asked() -> None:
    from llamacrab.server import parse_settings
    from llamacrab.server._llama_kwargs import llama_kwargs

    assert llama_kwargs(parse_settings(["crab/split", "--hf-mmproj"], {}))["mmproj"] is True
    assert "mmproj" not in llama_kwargs(parse_settings(["crab/split"], {}))
    given = parse_settings(["crab/split", "--hf-mmproj", "--mmproj", "p.gguf"], {})
    assert llama_kwargs(given)["mmproj"] == "p.gguf"
