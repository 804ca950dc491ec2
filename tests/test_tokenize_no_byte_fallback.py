"""An SPM vocabulary without a byte token for some byte loads (real ones exist), and text it
cannot encode is a TokenizeError naming the byte, where llama.cpp's byte_to_token threw
std::out_of_range and the error said ``llama_tokenize failed in C++: unordered_map::at``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from test_vocab_bounds import BYTE, vocabulary_model

from llamacrab import Llama, TokenizeError
from llamacrab.server import ServerSettings
from llamacrab.server._app import create_app

TOKENS = ["<unk>", "<s>", "</s>", "▁", "a", "▁a", "<0x7A>"]  # a byte token for "z" only


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = vocabulary_model(tmp_path_factory.mktemp("spm") / "no-bytes.gguf", "llama",
                            tokens=TOKENS)  # fmt: skip
    return path


@pytest.fixture(scope="module")
def llm(path: Path) -> Iterator[Llama]:
    with Llama(path, n_ctx=64, n_threads=1) as llm:
        yield llm


def test_text_the_vocabulary_encodes_tokenizes(llm: Llama) -> None:
    assert llm.tokenize("a a", add_special=False) == [5, 5]


@pytest.mark.parametrize(
    ("text", "byte", "of"),
    [("a b", "62", " of 'b'"), ("aé", "C3", " of 'é'"), (b"a\xff", "FF", "")],
    ids=["ascii", "two-byte", "not-utf-8"],
)
def test_a_byte_without_a_token_is_named(llm: Llama, text: str | bytes, byte: str, of: str) -> None:
    """Not the space of "a b": llama.cpp reads it as "▁", a token."""
    with pytest.raises(TokenizeError) as caught:
        llm.tokenize(text, add_special=False)
    message = str(caught.value)
    named = (
        f"the vocabulary has no <0x{byte}> byte token (nor a one-byte one) for byte 0x{byte}{of},"
    )
    assert named in message and "unordered_map" not in message, message


def test_a_byte_token_the_vocabulary_has_is_used(tmp_path: Path) -> None:
    """Only bytes without a token fail: "z" falls back on the vocabulary's <0x7A> (type 6)."""
    path = vocabulary_model(tmp_path / "z.gguf", "llama", {6: ("<0x7A>", BYTE)}, tokens=TOKENS)
    with Llama(path, n_ctx=64, n_threads=1) as llm:
        assert llm.tokenize("a z", add_special=False)[-1] == 6


def test_the_server_answers_400_with_the_byte(path: Path, llm: Llama) -> None:
    with TestClient(create_app(ServerSettings(model=str(path)), llm)) as client:
        answers = [
            client.post("/tokenize", json={"content": "a b"}),
            client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2}),
        ]
    for answer in answers:
        assert answer.status_code == 400, answer.text
        assert "byte 0x62 of 'b'" in answer.json()["error"]["message"], answer.text
