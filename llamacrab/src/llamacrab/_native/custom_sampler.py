"""Samplers written in Python, inserted into a native chain (slower: Python runs per token)."""

from __future__ import annotations

from typing import Any

import numpy as np

from llamacrab._native.call import ffi

TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


class CustomSampler:
    """Subclass and override ``apply`` (and ``accept`` / ``reset`` if it keeps state).

    ``apply`` gets the candidates as a numpy structured array with fields ``id``, ``logit`` and
    ``p``, a view of llama.cpp's own buffer: change ``logit`` in place (``-inf`` removes a
    candidate). Custom samplers run first in the chain, once per generated token, so they see
    the whole vocabulary in token-id order (``candidates["logit"][token_id]``), like a logits
    processor. That is O(vocabulary) per token in numpy: prefer SamplingOptions fields where one
    exists, they run in C.
    """

    name = "python"

    def apply(self, candidates: np.ndarray) -> None:
        raise NotImplementedError

    def accept(self, token: int) -> None:
        """Called with every token the chain picks."""

    def reset(self) -> None:
        """Called when the chain is reset."""


class _Bridge:
    """Adapts a CustomSampler to the raw callbacks of llamacrab_sys.python_sampler."""

    def __init__(self, sampler: CustomSampler) -> None:
        self.sampler = sampler
        self.name = sampler.name

    def apply(self, candidates: Any) -> None:
        size = int(candidates.size)
        raw = ffi.buffer(candidates.data, size * TOKEN_DATA.itemsize)
        self.sampler.apply(np.frombuffer(raw, dtype=TOKEN_DATA))
        candidates.sorted = False  # logits may have changed: later samplers must not trust order

    def accept(self, token: int) -> None:
        self.sampler.accept(token)

    def reset(self) -> None:
        self.sampler.reset()
