"""Samplers written in Python, inserted into a native chain (slower: Python runs per token)."""

from __future__ import annotations

from typing import Any

import numpy as np

from llamacrab._native.call import ffi

TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


class EndGeneration(Exception):
    """Raised by a CustomSampler's ``apply`` to end the generation before the token being
    sampled: it is not output, and the generation finishes with finish_reason "stop"."""


class CustomSampler:
    """Subclass and override ``apply`` (and ``accept`` / ``reset`` if it keeps state).

    ``apply`` gets the candidates as a numpy structured array with fields ``id``, ``logit`` and
    ``p``: change ``logit`` in place (``-inf`` removes a candidate); the logits (not the ids
    nor ``p``) are copied into llama.cpp's buffer when ``apply`` returns. The array is the
    sampler's own, refilled for every token: one kept past the call stays valid memory but
    holds later candidates.
    Custom samplers run first in the chain, once per generated token, so they see the whole
    vocabulary in token-id order (``candidates["logit"][token_id]``), like a logits processor.
    That is O(vocabulary) per token in numpy: prefer SamplingOptions fields where one exists,
    they run in C. ``apply`` raising ``EndGeneration`` ends the generation there (a per-token
    stop rule); any other exception ends it too, and reaches the caller.
    """

    name = "python"

    def apply(self, candidates: np.ndarray) -> None:
        raise NotImplementedError

    def accept(self, token: int) -> None:
        """Called with every token the chain picks."""

    def reset(self) -> None:
        """Called when the chain is reset."""


class _Bridge:
    """Adapts a CustomSampler to the raw callbacks of llamacrab_sys.python_sampler. An
    exception cannot cross llama.cpp's frames: the first one is kept (the sampler then does
    nothing more) and ``raise_error`` raises it once the C call has returned."""

    def __init__(self, sampler: CustomSampler) -> None:
        self.sampler = sampler
        self.name = sampler.name
        self.error: BaseException | None = None
        self._copy = np.empty(0, dtype=TOKEN_DATA)

    def apply(self, candidates: Any) -> None:
        if self.error is not None:
            return
        size = int(candidates.size)
        native = np.frombuffer(ffi.buffer(candidates.data, size * TOKEN_DATA.itemsize),
                               dtype=TOKEN_DATA)  # fmt: skip
        # The sampler gets a copy: a view of llama.cpp's vector, kept past this call (as
        # ``self.last = candidates``), would read and write freed memory after the generation.
        if self._copy.size != size:
            self._copy = np.empty(size, dtype=TOKEN_DATA)
        self._copy[...] = native
        candidates.sorted = False  # logits may change: later samplers must not trust order
        try:
            self.sampler.apply(self._copy)
        except BaseException as error:
            self.error = error
            return
        # Only the logits go back: llama.cpp indexes the logits row with the ids (an id
        # rewritten to 2**30 was read far outside it), and computes ``p`` from the logits.
        native["logit"] = self._copy["logit"]

    def accept(self, token: int) -> None:
        if self.error is not None:
            return
        try:
            self.sampler.accept(token)
        except BaseException as error:
            self.error = error

    def reset(self) -> None:
        try:
            self.sampler.reset()
        except BaseException as error:
            self.error = self.error or error

    def raise_error(self) -> None:
        """Raise the exception the sampler raised inside llama.cpp, if any (once)."""
        error, self.error = self.error, None
        if error is not None:
            raise error
