"""The short versions of the server's reliability sections (scripts/reliability_server.py; the
long ones run from scripts/reliability.py): load, a disconnect storm, several models churning
(in the server's process, and in processes of their own killed at random), per-request LoRA
sets with overflowing scales among them, schemathesis, leaks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from support import load_repo_module

sections = load_repo_module("scripts/reliability_server.py")
models = load_repo_module("scripts/reliability_models.py")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("reliability-server")


def _shown(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=1)[:6000]


def test_load_64_clients_no_5xx_every_request_answered_rss_stable(workdir: Path) -> None:
    result = sections.load_test(workdir, clients=64, seconds=sections.SHORT["load_seconds"])
    assert result["ok"], _shown(result)
    assert result["server_errors"] == result["unanswered"] == result["malformed"] == 0
    assert set(result["by_kind"]) == {"completion", "chat_stream", "embeddings", "tokenize"}
    assert all(n >= 10 for n in result["by_kind"].values()), result["by_kind"]


def test_a_disconnect_storm_frees_every_slot_within_a_second(workdir: Path) -> None:
    result = sections.disconnect_storm(workdir, streams=100)
    assert result["ok"], _shown(result)
    assert result["dropped_mid_stream"] + result["dropped_while_queued"] == 100
    assert result["dropped_mid_stream"] >= 50  # most got a slot and left during their stream
    assert result["slots_free_after_s"] <= 1.0


def _served_every_kind(result: dict[str, Any]) -> None:
    kinds = {"complete", "stream", "chat", "messages", "responses", "load", "unload", "list"}
    served = {kind for kind, statuses in result["by_kind"].items() if statuses.get("200", 0)}
    assert kinds <= served, result["by_kind"]


def test_several_models_with_room_for_one_under_churn(workdir: Path) -> None:
    result = models.model_churn(workdir, clients=16, seconds=sections.SHORT["churn_seconds"])
    assert result["ok"], _shown(result)
    assert result["requests"] >= 200 and result["afterwards"] == {"alpha": 200, "beta": 200}
    # The churn reached every kind of answer it is meant to: served, unknown, failed, no room.
    assert {"model_not_found", "model_load_failed", "model_busy"} <= set(result["codes"])
    _served_every_kind(result)


def test_models_in_processes_of_their_own_killed_under_churn(workdir: Path) -> None:
    result = models.isolated_churn(workdir, clients=16, seconds=sections.SHORT["churn_seconds"])
    assert result["ok"], _shown(result)
    assert result["afterwards"] == {"alpha": 200, "gamma": 200, "delta": 200}
    assert result["killed"] >= 5 and result["left_running"] == []
    # Killed processes were seen by requests (a 502, or an error event in a stream).
    assert any(code.startswith("model_process_failed") for code in result["codes"]), result
    _served_every_kind(result)


def test_per_request_lora_sets_some_overflowing_leave_every_other_answer_exact(
    workdir: Path,
) -> None:
    result = sections.lora_mix(workdir, clients=3, seconds=sections.SHORT["lora_seconds"])
    assert result["ok"], _shown(result)
    verdicts = result["verdicts"]
    assert verdicts["right"] >= 100 and verdicts["overflow_refused"] >= 20, verdicts


def test_error_codes_are_read_from_every_api_shape() -> None:
    openai = {"error": {"message": "x", "type": "server_error", "code": "model_busy"}}
    anthropic = {
        "type": "error",
        "error": {"type": "api_error", "message": "model 'a' failed to load: truncated"},
    }
    responses = {"type": "error", "code": "shutting_down", "message": "x", "param": None}
    assert [models.error_code(p) for p in (openai, anthropic, responses, {"id": 1})] == [
        "model_busy", "model_load_failed", "shutting_down", None]  # fmt: skip
    event = 'data: {"type": "error", "error": {"type": "api_error", "message": "its process"}}'
    assert models.stream_errors(["event: error", event], anthropic=True) == [
        "model_process_failed"]  # fmt: skip
    assert models.stream_errors([event], anthropic=True) == ["malformed_error_event"]


def test_schemathesis_finds_no_server_error(workdir: Path) -> None:
    examples = sections.SHORT["schemathesis_examples"]
    result = sections.schemathesis_run(workdir, max_examples=examples)
    assert result["ok"], _shown(result)
    assert result["operations"] >= 20 and result["cases"] >= 5 * result["operations"]


def test_short_completions_do_not_grow_rss(workdir: Path) -> None:
    result = sections.leak_test(workdir, count=sections.SHORT["leak_count"], warm_up=1_000)
    assert result["ok"], _shown(result)
    for part in ("library", "server"):
        assert result[part]["rss_growth_mib"] < result[part]["bound_mib"]
