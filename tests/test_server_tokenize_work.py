"""/tokenize builds big answers away from the event loop, where they held every request."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from llamacrab import Llama
from llamacrab.server import ServerSettings, _llama_server
from llamacrab.server._app import create_app


def test_pieces_are_looked_up_off_the_event_loop_once_per_token(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    looked_up: list[tuple[int, bool]] = []
    piece = _llama_server._piece

    def recorded(llama: Llama, token: int) -> str | list[int]:
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        looked_up.append((token, on_loop))
        return piece(llama, token)

    monkeypatch.setattr(_llama_server, "_piece", recorded)
    settings = ServerSettings(model=str(tiny_model_path))
    with (
        Llama(tiny_model_path, n_ctx=64, n_threads=2) as llm,
        TestClient(create_app(settings, llm)) as client,
    ):
        text = "the cat " * 200
        answer = client.post("/tokenize", json={"content": text, "with_pieces": True})
        plain = client.post("/tokenize", json={"content": text}).json()["tokens"]
    assert answer.status_code == 200, answer.text
    listed = answer.json()["tokens"]
    assert [t["id"] for t in listed] == plain and len(plain) > 400
    assert "".join(t["piece"] for t in listed).strip() == text.strip()
    assert sorted(token for token, _ in looked_up) == sorted(set(plain))
    assert not any(on_loop for _, on_loop in looked_up)
