"""Sounds too long for the context are refused before libmtmd computes their spectrograms
(_features/sound_tokens.py): mtmd_tokenize spends ~3.5 ms per second of sound in one call that
nothing interrupts, and a 12 kB FLAC can declare an hour. Tiny Qwen2-Audio-style projector:
750 tokens per 30 s window, and one window more than the sound fills."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from live_server import LiveServer

from llamacrab import Audio, ContextOverflowError, Llama
from llamacrab._native import mtmd as mtmd_handles
from llamacrab._native.call import call
from llamacrab.server import ServerSettings
from llamacrab_sys import lib

from support import load_repo_module, wav_bytes

tiny = load_repo_module("scripts/make_tiny_gguf.py")
mmproj = load_repo_module("scripts/make_tiny_mmproj.py")
RATE = mmproj.AUDIO_SAMPLE_RATE


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("sound")
    return {
        "text": tiny.write_tiny_llama(out / "text.gguf"),
        "audio": mmproj.write_tiny_audio_mmproj(out / "audio.gguf"),
    }


@pytest.fixture
def hearing(files: dict[str, Path]) -> Iterator[Llama]:
    """A fresh Llama each time: its projector has counted no silence yet."""
    with Llama(files["text"], n_ctx=2048, n_threads=2, mmproj=files["audio"]) as llm:
        yield llm


@pytest.fixture
def tokenized(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length in samples of every sound that reaches mtmd_tokenize (its spectrogram)."""
    seen: list[int] = []

    def spy(name: str, *args: Any) -> Any:
        if name == "mtmd_tokenize":
            pointers, count = args[3], args[4]
            seen.extend(lib.mtmd_bitmap_get_nx(pointers[i]) for i in range(count))
        return call(name, *args)

    monkeypatch.setattr(mtmd_handles, "call", spy)
    return seen


def silence(seconds: float) -> Audio:
    return Audio(samples=np.zeros(int(seconds * RATE), np.float32), sample_rate=RATE)


def tone(seconds: float, rate: int = RATE) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def test_a_sound_too_long_for_the_context_is_refused_before_its_spectrogram(
    hearing: Llama, tokenized: list[int]
) -> None:
    prompt = f"{hearing.media_marker}."
    with pytest.raises(ContextOverflowError, match=r"sound \(600 s\) becomes at least 2250 "
                       r"tokens; the context holds 2048") as caught:  # fmt: skip
        hearing.create_completion(prompt, media=[silence(600)], max_tokens=1)
    assert (caught.value.n_prompt_tokens, caught.value.n_ctx) == (2250, 2048)
    # Silence of 30 and 60 s was counted (once per projector), never the 10 minutes.
    assert tokenized == [30 * RATE, 60 * RATE]
    tokenized.clear()
    with pytest.raises(ContextOverflowError, match="at least 2250 tokens"):
        hearing.create_completion(prompt, media=[silence(3600)], max_tokens=1)
    assert tokenized == []  # the counts are kept: a refusal costs nothing now
    heard = hearing.create_completion(prompt, media=[silence(20)], max_tokens=1)
    assert heard.usage.prompt_tokens > 750 and tokenized == [20 * RATE]


def test_silence_counts_what_any_sound_of_its_length_becomes(hearing: Llama) -> None:
    projector = hearing.projector
    assert projector is not None
    for seconds in (0.5, 30, 61):
        bitmap = projector.bitmap(Audio(samples=tone(seconds), sample_rate=RATE))
        chunks = projector.tokenize(f"{projector.marker} .", [bitmap])
        expected = int(chunks.media_tokens().sum())
        chunks.close()
        bitmap.close()
        assert projector.silence_tokens(int(seconds * RATE)) == expected


def test_a_sound_that_fits_is_taken_whatever_the_probes_said(
    hearing: Llama, tokenized: list[int]
) -> None:
    # 59 s become 1,500 tokens: at the 30 s probe's rate (1,500 per 30 s) it looked too long.
    heard = hearing.create_completion(f"{hearing.media_marker}.", media=[silence(59)],
                                      max_tokens=1)  # fmt: skip
    assert 1500 < heard.usage.prompt_tokens < 2048
    assert tokenized == [30 * RATE, 59 * RATE]


def test_the_sounds_of_one_prompt_count_together(hearing: Llama, tokenized: list[int]) -> None:
    marker = hearing.media_marker
    with pytest.raises(ContextOverflowError, match=r"sound \(80 s\) becomes at least 3000"):
        hearing.create_completion(f"{marker} {marker}.", media=[silence(40)] * 2, max_tokens=1)
    assert tokenized == [30 * RATE]
    alone = hearing.create_completion(f"{marker}.", media=[silence(40)], max_tokens=1)
    assert 1500 < alone.usage.prompt_tokens < 2048


def test_the_server_answers_a_sound_too_long_as_a_prompt_too_long(
    files: dict[str, Path], tokenized: list[int]
) -> None:
    settings = ServerSettings(model=str(files["text"]), mmproj=str(files["audio"]), n_ctx=2048,
                              chat_template="chatml")  # fmt: skip
    server = LiveServer(settings)
    try:
        assert server.wait_until_loaded() == 200
        sound = base64.b64encode(wav_bytes(tone(100, rate=4000), 4000)).decode()
        content = [
            {"type": "text", "text": "hi"},
            {"type": "input_audio", "input_audio": {"data": sound, "format": "wav"}},
        ]
        answer = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": content}], "max_tokens": 2})  # fmt: skip
        assert answer.status_code == 400, answer.text
        error = json.loads(answer.text)["error"]
        assert (error["code"], error["type"]) == ("context_length_exceeded",
                                                  "exceed_context_size_error")  # fmt: skip
        assert (error["n_prompt_tokens"], error["n_ctx"]) == (2250, 2048)
        assert "request (2250 tokens) exceeds the available context size" in error["message"]
        assert tokenized == [30 * RATE, 60 * RATE]  # the 100 s (resampled) never got there
    finally:
        server.close()
