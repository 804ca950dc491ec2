"""Samplers written in Python, inserted into a native chain (slower: Python runs per token)."""

from __future__ import annotations

from typing import Any

import numpy as np

from llamacrab._exceptions import InvalidParameterError
from llamacrab._native.call import ffi
from llamacrab._native.greedy import NOTHING_TO_PICK

TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


class EndGeneration(Exception):
    """Raised by a CustomSampler's ``apply`` to end the generation before the token being
    sampled: it is not output, and the generation finishes with finish_reason "stop"."""


class CustomSampler:
    """Subclass and override ``apply`` (and ``accept`` / ``reset`` if it keeps state).

    ``apply`` gets the candidates as a numpy structured array with fields ``id``, ``logit`` and
    ``p``: change ``logit`` in place (``-inf`` removes a candidate); the logits (not the ids
    nor ``p``) are copied into llama.cpp's buffer when ``apply`` returns. A NaN or +inf logit,
    or none left above -inf, raises InvalidParameterError naming the sampler (its ``name``,
    or its class while ``name`` is the default): the chain would pick an arbitrary token
    from them. The array is the sampler's own, refilled for every token: one kept past the
    call stays valid memory but holds later candidates.
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


def _defect(logits: np.ndarray) -> str | None:
    """What leaves the chain no token to pick honestly: a "NaN" logit, a "+inf" one (softmax
    makes it NaN), or every one at "-inf"; None if nothing. One pass over the logits: NaN
    propagates through the maximum, and -inf is the maximum only when every logit is -inf."""
    if not logits.size:
        return None
    top = logits.max()
    if np.isfinite(top):
        return None
    return "NaN" if np.isnan(top) else "+inf" if top > 0 else "-inf"


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
        # As bytes: numpy copies a structured array field by field, four times slower (1 ms
        # against 0.23 ms at Gemma's 262k tokens).
        self._copy.view(np.uint8)[...] = native.view(np.uint8)
        candidates.sorted = False  # logits may change: later samplers must not trust order
        try:
            self.sampler.apply(self._copy)
        except BaseException as error:
            self.error = error
            return
        logits = self._copy["logit"]
        defect = _defect(logits)
        # One the logits had before the sampler ran (the model's NaN) is not its doing.
        if defect is not None and defect != _defect(native["logit"]):
            # llama.cpp picks from the logits it had, a token the error keeps from the output.
            self.error = InvalidParameterError(self._unusable(defect, logits))
            return
        # Only the logits go back: llama.cpp indexes the logits row with the ids (an id
        # rewritten to 2**30 was read far outside it), and computes ``p`` from the logits.
        native["logit"] = logits

    def left_out(self, token: int) -> bool:
        """Whether this sampler's last ``apply`` set ``token``'s logit to -inf. Python samplers
        run first, on the candidates in token-id order: position ``token`` is that token's,
        whatever the sampler wrote into ``id`` (which is not copied back)."""
        return bool(token < self._copy.size and self._copy["logit"][token] == -np.inf)

    @property
    def shown_name(self) -> str:
        """The sampler's ``name``, or its class while ``name`` is the default."""
        own = self.name if self.name != CustomSampler.name else type(self.sampler).__name__
        return f"the Python sampler {own!r}"

    def _unusable(self, defect: str, logits: np.ndarray) -> str:
        """Why the logits the sampler left cannot be sampled from (``_defect`` says how)."""
        who = self.shown_name
        if defect == "-inf":
            return f"{NOTHING_TO_PICK}: {who} set every logit to -inf"
        # The position is the token (id order), whatever the sampler wrote into ``id``.
        token = int(np.argmax(np.isnan(logits) if defect == "NaN" else logits == np.inf))
        if defect == "NaN":
            return f"{who} set the logit of token {token} to NaN: a number is needed (-inf bans)"
        return (
            f"{who} set the logit of token {token} to +inf, which makes every probability NaN: "
            "to force a token, set the other logits to -inf"
        )

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
