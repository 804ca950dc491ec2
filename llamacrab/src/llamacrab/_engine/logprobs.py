"""Log-probabilities of sampled tokens from the pre-sampling distribution, only when asked.

One log-softmax over the vocabulary per token is O(n_vocab) (262,144 for Gemma 3): it runs in
numpy, and only for requests that ask for logprobs.
"""

from __future__ import annotations

import numpy as np

from llamacrab._native.context import Context


def token_logprobs(
    context: Context, token: int, top_n: int, index: int = -1
) -> tuple[float, dict[str, float]]:
    """The log-probability of ``token`` under the logits of output ``index`` of the last
    decode, and the ``top_n`` most likely tokens there."""
    logits = context.logits(index)
    peak = float(logits.max())
    log_total = peak + float(np.log(np.exp(logits - peak, dtype=np.float64).sum()))
    top: dict[str, float] = {}
    if top_n:
        best = np.argpartition(logits, -top_n)[-top_n:]
        for index in best[np.argsort(-logits[best])]:
            piece = context.model.vocab.token_to_piece(int(index), special=True)
            top[piece] = float(logits[index]) - log_total
    return float(logits[token]) - log_total, top
