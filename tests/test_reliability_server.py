"""The short versions of the server's reliability sections (scripts/reliability_server.py; the
long ones run from scripts/reliability.py): load, a disconnect storm, several models churning,
schemathesis, leaks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from support import load_repo_module

sections = load_repo_module("scripts/reliability_server.py")


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


def test_several_models_with_room_for_one_under_churn(workdir: Path) -> None:
    result = sections.model_churn(workdir, clients=16, seconds=sections.SHORT["churn_seconds"])
    assert result["ok"], _shown(result)
    assert result["requests"] >= 200 and result["afterwards"] == {"alpha": 200, "beta": 200}
    # The churn reached every kind of answer it is meant to: served, unknown, failed, no room.
    assert {"model_not_found", "model_load_failed", "model_busy"} <= set(result["codes"])
    assert result["statuses"].get("200", 0) >= 50


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
