"""Bring your own llama.cpp: llamacrab-sys built against a separate install of llama.cpp (built
like upstream's README: its own library names, CPU only, no libmtmd, no RPC) imports, reports
that install, and generates what the shipped build generates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from build_tools.source import read_pin
from llamacrab_sys import build_info

REPO = Path(__file__).resolve().parents[2]
CHILD = REPO / "tests" / "user_llama_cpp_child.py"
sys.path.insert(0, str(REPO / "scripts"))
from user_llama_cpp import user_install  # noqa: E402

PIN = read_pin()["llama_cpp_commit"]


@pytest.fixture(scope="module")
def user_prefix() -> Path:
    """The user's install (built once and cached under the llamacrab cache, ~10 min cold)."""
    return user_install()


@pytest.fixture(scope="module")
def byo_package(user_prefix: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llamacrab-sys built against the user's install, in a directory of its own."""
    target = tmp_path_factory.mktemp("byo-sys")
    env = {**os.environ, "LLAMACRAB_LLAMA_CPP_PREFIX": str(user_prefix),
           "LLAMACRAB_LLAMA_CPP_COMMIT": PIN}  # fmt: skip
    built = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps",
         "--disable-pip-version-check", "--target", str(target), str(REPO / "llamacrab-sys")],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return target


def run_child(model: Path, package: Path | None = None) -> dict[str, Any]:
    """Generate in a child: over ``package``'s llamacrab_sys, else over this environment's (a
    child too, so that this process's llama.cpp logging is left as the other tests expect)."""
    env = dict(os.environ)
    if package is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(package), env.get("PYTHONPATH")]))
    child = subprocess.run([sys.executable, str(CHILD), str(model)], capture_output=True,
                           text=True, timeout=300, env=env)  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.timeout(3600)  # the first run on a machine compiles llama.cpp
@pytest.mark.skipif(bool(build_info().sanitize), reason="the user's build is not instrumented")
def test_a_users_llama_cpp_is_bound_reported_and_generates(
    byo_package: Path, user_prefix: Path, tiny_model_path: Path
) -> None:
    result = run_child(tiny_model_path, byo_package)
    assert Path(result["package"]).is_relative_to(byo_package)  # not the venv's llamacrab_sys
    info = result["info"]
    assert info["llama_cpp_prefix"] == str(user_prefix.resolve())
    assert (info["llama_cpp_commit"], info["commit_source"]) == (PIN, "given")
    assert info["backend"] == "cpu" and info["cmake_options"] == []
    assert info["unavailable_features"] == ["multimodal (libmtmd)", "RPC (ggml-rpc)"]
    assert "without libmtmd" in result["projector_refusal"]
    # The user's libraries, loaded in place under upstream's names: nothing of ours.
    mapped = [Path(p) for p in result["mapped"]]
    assert {p.name.split(".so")[0] for p in mapped} >= {"libllama", "libggml", "libggml-base"}
    assert all(p.resolve().is_relative_to(user_prefix.resolve()) for p in mapped), mapped
    # The same commit and model as the shipped build: greedy decoding agrees token for token.
    shipped = run_child(tiny_model_path)
    assert shipped["info"]["llama_cpp_prefix"] is None  # the environment's own build
    assert result["tokens"] == shipped["tokens"] and len(result["tokens"]) == 8

    shown = subprocess.run(
        [sys.executable, "-m", "llamacrab_sys"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(byo_package)},
    )  # fmt: skip
    assert f"llama_cpp_prefix: {user_prefix.resolve()}" in shown.stdout, shown.stdout
    assert f"llama_cpp_commit: {PIN}" in shown.stdout
