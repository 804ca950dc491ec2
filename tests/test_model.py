"""Model information, parameters that reach llama.cpp, and load progress."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from llamacrab import (
    Context,
    InvalidModelError,
    InvalidParameterError,
    Llama,
    Model,
    ModelLoadError,
    ModelParams,
)


@pytest.mark.real_model
def test_gemma_information(gemma: Llama) -> None:
    model = gemma.model
    assert model.metadata["general.architecture"] == "gemma3"
    assert model.n_params == 268_098_176 and model.n_embd == 640 and model.n_layer == 18
    assert model.n_ctx_train == 32_768 and model.size > 100_000_000
    assert "gemma3" in model.description and "Q4_K" in model.description
    assert model.chat_template() is None  # this GGUF ships no template (the chat layer handles it)
    assert gemma.vocab.bos == 2 and gemma.vocab.eos == 1


def test_kv_overrides_reach_llama_cpp(tiny_model_path: Path) -> None:
    params = ModelParams(kv_overrides={"llama.context_length": 1024, "general.name": "renamed"})
    with Model.load(tiny_model_path, params) as model:
        assert model.n_ctx_train == 1024  # overrides change what llama.cpp reads, not the file
        assert model.metadata["llama.context_length"] == "2048"
    with pytest.raises(InvalidParameterError, match="unsupported value"):
        Model.load(tiny_model_path, ModelParams(kv_overrides={"x": [1, 2]}))  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        # 2^40 became 0 layers in llama.cpp's uint32: GGML_ASSERT(n_layer_all > 0), an abort
        ({"llama.block_count": 2**40}, InvalidModelError, "block_count = 1099511627776 is out of"),
        ({"llama.attention.head_count": 3}, InvalidModelError, "head_count = 3 is not a multiple"),
        ({"llama.expert_count": 4}, InvalidModelError, "expert_used_count > 0"),
        ({"tokenizer.ggml.model": "rwkv"}, InvalidModelError, "an rwkv vocabulary"),
        # llama.cpp ignores an override of another type, and would then read the file's value
        ({"llama.block_count": 2.5}, InvalidParameterError, "is a float; .* stores an integer"),
        ({"general.name": 5}, InvalidParameterError, "is an integer; .* stores a string"),
    ],
)
def test_overrides_are_checked_as_the_file_is(
    tiny_model_path: Path, overrides: dict, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        Model.load(tiny_model_path, ModelParams(kv_overrides=overrides))
    if error is InvalidModelError:
        with pytest.raises(error, match=r"tiny.*with kv_overrides .* would not load safely"):
            Model.load(tiny_model_path, ModelParams(kv_overrides=overrides))


def test_vocab_only_model_tokenizes_but_cannot_decode(tiny_model_path: Path) -> None:
    with Model.load(tiny_model_path) as full:
        expected = full.vocab.tokenize("the cat sat")
    with Model.load(tiny_model_path, ModelParams(vocab_only=True)) as model:
        assert model.vocab.tokenize("the cat sat") == expected
        with pytest.raises(InvalidParameterError, match="vocab_only"):
            Context(model)


def test_progress_reaches_the_callback_and_can_cancel(tiny_model_path: Path) -> None:
    seen: list[float] = []
    with Llama(tiny_model_path, n_ctx=64, progress=seen.append):
        pass
    assert seen and seen[-1] == 1.0
    with pytest.raises(ModelLoadError):
        Llama(tiny_model_path, n_ctx=64, progress=lambda fraction: False)


def test_prompt_longer_than_a_batch_is_decoded_in_chunks(tiny_llama: Llama) -> None:
    prompt = [1] + [260 + i % 11 for i in range(99)]  # 100 tokens, n_batch 32
    assert tiny_llama.context.n_batch == 32
    result = tiny_llama.create_completion(prompt, max_tokens=2, temperature=0)
    assert result.usage.prompt_tokens == 100 and result.usage.completion_tokens == 2


def test_llama_cpp_log_goes_to_the_llamacrab_logger(
    tiny_model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="llamacrab"), Model.load(tiny_model_path):
        pass
    assert any("llamacrab-tiny-llama" in r.getMessage() for r in caplog.records)
    assert all(r.name == "llamacrab" and "\n" not in r.getMessage() for r in caplog.records)
