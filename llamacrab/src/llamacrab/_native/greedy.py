"""Greedy picks without llama.cpp's sampler chain, for chains that are only logit_bias + greedy.

``llama_sampler_sample`` copies every logit into a candidate array and walks it (~0.6 ms a
token at Gemma 3's 262k vocabulary on this project's CPUs); the same pick in numpy over the
logits row takes ~40 us, a few percent of a small model's decode.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from llamacrab._exceptions import InvalidParameterError
from llamacrab._native.call import ffi

# What a pick raises when the caller's bans left it nothing (see SamplerChain.sample too);
# NOTHING_TO_PICK opens it, and what a Python sampler that removed every token raises.
NOTHING_TO_PICK = "no token left to pick"
NO_TOKEN_LEFT = (
    f"{NOTHING_TO_PICK}: logit_bias (with the model's suppressed tokens and min_tokens' ban "
    "of the end-of-generation tokens, if any) sets every logit to -inf"
)


def float32_bias(bias: Mapping[int, float]) -> np.ndarray:
    """``bias``'s values as the float32 llama.cpp adds: one past float32's range is -inf, a ban
    (-1e39 too), without numpy's overflow warning."""
    with np.errstate(over="ignore"):
        return np.fromiter(bias.values(), dtype=np.float32, count=len(bias))


def banned_tokens(bias: Mapping[int, float]) -> frozenset[int]:
    """The tokens ``bias`` bans (-inf)."""
    tokens = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
    return frozenset(tokens[np.isneginf(float32_bias(bias))].tolist())


class BiasedArgmax:
    """The token llama.cpp's greedy sampler picks after its logit_bias sampler: the first
    maximum of logits + bias (-inf bias: never). Reads and briefly edits the context's logits
    row in place, restoring it before returning, so later readers (log-probabilities) see the
    raw logits."""

    def __init__(self, n_vocab: int, bias: Mapping[int, float]) -> None:
        self.n_vocab = n_vocab
        self.tokens = np.fromiter(bias.keys(), dtype=np.intp, count=len(bias))
        self.bias = float32_bias(bias)

    def pick(self, logits_pointer: Any, banned: np.ndarray | None = None) -> int:
        """``logits_pointer``: a checked, non-NULL ``llama_get_logits_ith`` row; ``banned``:
        tokens forbidden at this pick on top of the bias (min_tokens' end-of-generation ban)."""
        logits = np.frombuffer(ffi.buffer(logits_pointer, 4 * self.n_vocab), dtype=np.float32)
        touched = self.tokens if banned is None else np.concatenate((self.tokens, banned))
        if touched.size == 0:
            return int(logits.argmax())
        saved = logits[touched]  # a copy: fancy indexing
        try:
            logits[self.tokens] += self.bias  # float32, as llama.cpp adds it
            if banned is not None:
                logits[banned] = -np.inf
            best = int(logits.argmax())  # the first maximum, as llama.cpp's greedy keeps
            ruled_out = logits[best] == -np.inf
        finally:
            logits[touched] = saved
        # Every token at -inf: argmax fell back to token 0, banned like the rest. (A raw -inf,
        # the model's own, is left to the caller's check of the logits.)
        if ruled_out and np.isfinite(logits[best]):
            raise InvalidParameterError(NO_TOKEN_LEFT)
        return best
