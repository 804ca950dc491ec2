"""warmup=True: one decode when the context is created (llama.cpp's --warmup), invisible after."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llamacrab import Llama, RamCache
from llamacrab._native.batch import Batch
from llamacrab._native.context import Context
from llamacrab.server._llama_kwargs import llama_kwargs
from llamacrab.server._settings import ServerSettings
from llamacrab_sys import lib

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")
PROMPT = "the quick brown fox"


def _prompt_tokens_evaluated(llm: Llama) -> int:
    """llama.cpp's count of tokens decoded in batches of more than one (it reports 0 as 1)."""
    with llm.context.in_flight() as ctx:
        return int(lib.llama_perf_context(ctx).n_p_eval)


def test_warmup_decodes_once_and_leaves_nothing_behind(tiny_model_path: Path) -> None:
    cache = RamCache()
    with Llama(tiny_model_path, n_ctx=128, n_threads=2, cache=cache, warmup=True) as warm:
        assert _prompt_tokens_evaluated(warm) == 2  # BOS and EOS
        assert warm.context.positions(0) is None  # the memory is empty again
        assert len(cache) == 0  # and no prompt cache holds the warm-up
        assert warm.vocab._facts.eog is not None  # the end tokens are found: no first-call scan
        answer = warm.create_completion(PROMPT, max_tokens=8, temperature=0, min_tokens=8)
    with Llama(tiny_model_path, n_ctx=128, n_threads=2) as cold:
        assert _prompt_tokens_evaluated(cold) == 1  # none
        assert cold.vocab._facts.eog is None
        again = cold.create_completion(PROMPT, max_tokens=8, temperature=0, min_tokens=8)
    assert answer.choices[0].text == again.choices[0].text
    assert answer.usage.cached_tokens == 0


@pytest.mark.parametrize("write", [tiny.write_tiny_mamba, tiny.write_tiny_jamba])
def test_warmup_of_recurrent_and_hybrid_models(write: object, tmp_path: Path) -> None:
    path = write(tmp_path / "model.gguf")  # type: ignore[operator]
    answers = []
    for warmup in (True, False):
        with Llama(path, n_ctx=128, n_threads=2, warmup=warmup) as llm:
            assert _prompt_tokens_evaluated(llm) == (2 if warmup else 1)  # it ran, or did not
            assert llm.context.positions(0) is None
            answers.append(llm.create_completion(PROMPT, max_tokens=6, temperature=0,
                                                 min_tokens=6).choices[0].text)  # fmt: skip
    assert answers[0] == answers[1]


def test_warmup_of_an_embedding_model(monkeypatch: pytest.MonkeyPatch) -> None:
    # llama.cpp's counts leave out a non-causal model's batches: watch the decodes instead.
    decoded: list[int] = []
    decode = Context.decode

    def counted(context: Context, batch: Batch, *args: Any, **kwargs: Any) -> None:
        decode(context, batch, *args, **kwargs)
        decoded.append(batch.struct.n_tokens)

    monkeypatch.setattr(Context, "decode", counted)
    path = load_repo_module("scripts/convert_bert.py").minilm()
    vectors = []
    for warmup in (True, False):
        decoded.clear()
        with Llama(path, embeddings=True, n_threads=2, warmup=warmup) as llm:
            assert decoded == ([1] if warmup else [])  # its BOS ([CLS]; no EOS), without error
            vectors.append(llm.embed(["a crab walks sideways"]))
    np.testing.assert_allclose(vectors[0], vectors[1], rtol=1e-5, atol=1e-6)


def test_the_server_warms_up_unless_told_not_to() -> None:
    assert llama_kwargs(ServerSettings(model="m.gguf"))["warmup"] is True
    assert llama_kwargs(ServerSettings(model="m.gguf", no_warmup=True))["warmup"] is False
