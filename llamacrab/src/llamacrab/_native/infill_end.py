"""The token llama.cpp's infill sampler ends a fill with, which it asserts the vocabulary has."""

from __future__ import annotations

from llamacrab._exceptions import InvalidParameterError
from llamacrab._native.vocab import Vocab


def check_infill_end(vocab: Vocab) -> None:
    """Refuse infill sampling with ``vocab`` when it has neither an EOT nor an EOS token: when
    no text token is likely enough, llama.cpp's infill sampler puts in EOT (EOS without one)
    and asserts (an abort, not an exception) that there is one."""
    if vocab.eot is None and vocab.eos is None:
        raise InvalidParameterError(
            "infill sampling needs an end-of-text (EOT) or end-of-sequence (EOS) token; this "
            "model has neither: leave infill off"
        )
