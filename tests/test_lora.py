"""LoRA adapters: applied, scaled, removed, and never left dangling in a context."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from llamacrab import ClosedHandleError, InvalidParameterError, Llama, LoraAdapter

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")


@pytest.fixture(scope="module")
def lora_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.write_tiny_lora(tmp_path_factory.mktemp("lora") / "tiny-lora.gguf")


def prompt_logits(llm: Llama) -> np.ndarray:
    llm.create_completion("the cat sat", max_tokens=0)
    return llm.context.logits()


def test_adapter_changes_the_output_and_removing_it_restores_it(
    tiny_llama: Llama, lora_path: Path
) -> None:
    base = prompt_logits(tiny_llama)
    adapter = tiny_llama.load_lora(lora_path)
    assert adapter.metadata["adapter.type"] == "lora"
    adapted = prompt_logits(tiny_llama)
    assert not np.allclose(base, adapted)
    tiny_llama.set_lora_adapters({adapter: 0.0})
    assert np.allclose(prompt_logits(tiny_llama), base, atol=1e-5)
    tiny_llama.set_lora_adapters({})
    assert np.array_equal(prompt_logits(tiny_llama), base)


def test_closing_an_adapter_removes_it_from_contexts(tiny_llama: Llama, lora_path: Path) -> None:
    base = prompt_logits(tiny_llama)
    adapter = tiny_llama.load_lora(lora_path)
    adapter.close()
    assert tiny_llama.context.lora_adapters == {}
    tiny_llama.reset()
    assert np.array_equal(prompt_logits(tiny_llama), base)
    with pytest.raises(ClosedHandleError):
        tiny_llama.set_lora_adapters({adapter: 1.0})


def test_adapter_of_another_model_is_refused(
    tiny_llama: Llama, tiny_model_path: Path, lora_path: Path
) -> None:
    with Llama(tiny_model_path, n_ctx=64) as other:
        foreign = LoraAdapter(other.model, lora_path)
        with pytest.raises(InvalidParameterError, match="another model"):
            tiny_llama.set_lora_adapters({foreign: 1.0})
    assert foreign.closed  # closed with its model
