"""A prompt accepted into the penalties and DRY (``penalize_prompt``) is one C call per token
each, through the shim looked up once: through ``call``, which looks up the shim and its error
slot every time, an 8,192-token prompt under windows that hold it cost 21-26 ms (2-4 ms now),
and a third of it went to the last sampler, which picks and keeps no prompt."""

from __future__ import annotations

import numpy as np
import pytest

from llamacrab import Llama, SamplerChain, SamplingOptions
from llamacrab._native import call as native_call


def test_a_long_prompt_is_accepted_with_one_lookup_per_sampler(
    tiny_llama: Llama, monkeypatch: pytest.MonkeyPatch
) -> None:
    lookups: list[int] = []
    error_slot = native_call._error_slot

    def counted() -> object:
        lookups.append(1)
        return error_slot()

    options = SamplingOptions(repeat_penalty=1.3, penalty_last_n=8192, dry_multiplier=0.8,
                              dry_penalty_last_n=8192, seed=1)  # fmt: skip
    prompt = np.random.default_rng(1).integers(0, tiny_llama.vocab.n_tokens, 8192).tolist()
    with SamplerChain(tiny_llama.model, options) as chain:
        monkeypatch.setattr(native_call, "_error_slot", counted)
        chain.accept_prompt(prompt)
        monkeypatch.undo()
    assert len(lookups) == 2  # the penalties and DRY, which keep the prompt
