"""Log-probabilities of sampled tokens from the pre-sampling distribution, only when asked.

One log-softmax over the vocabulary per token is O(n_vocab) (262,144 for Gemma 3): it runs in
numpy, and only for requests that ask for logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from llamacrab._native.context import Context

# Logits one prompt decode may return when every row is read: llama.cpp keeps an output buffer
# as large as the largest decode asked for (a 512-token chunk of Gemma 3 would take 512 MiB).
_PROMPT_LOGITS_BYTES = 64 << 20


def prompt_rows_per_decode(n_vocab: int) -> int:
    """How many rows' logits one decode may return for prompt logprobs."""
    return max(1, _PROMPT_LOGITS_BYTES // (4 * n_vocab))


def token_logprobs(
    context: Context, token: int, top_n: int, index: int = -1
) -> tuple[float, dict[str, float], tuple[int, ...], tuple[bytes, ...]]:
    """The log-probability of ``token`` under the logits of output ``index`` of the last
    decode, and the ``top_n`` most likely tokens there: by their text, their ids and their
    bytes (each read from C once: the text is the bytes, escaped where not UTF-8)."""
    logits = context.logits(index)
    peak = float(logits.max())
    log_total = peak + float(np.log(np.exp(logits - peak, dtype=np.float64).sum()))
    top: dict[str, float] = {}
    ids: list[int] = []
    raws: list[bytes] = []
    if top_n:
        best = np.argpartition(logits, -top_n)[-top_n:]
        for index in best[np.argsort(-logits[best])]:
            raw = context.model.vocab.token_to_bytes(int(index), special=True)
            piece = raw.decode("utf-8", "backslashreplace")  # as Vocab.token_to_piece
            # Two tokens can spell the same text (an SPM byte token <0x41> and "A"): the
            # likelier one is kept, so ids stay aligned with the texts.
            if piece not in top:
                top[piece] = float(logits[index]) - log_total
                ids.append(int(index))
                raws.append(raw)
    return float(logits[token]) - log_total, top, tuple(ids), tuple(raws)


class PromptLogprobs:
    """The log-probabilities of a prompt's own tokens, read while it is decoded: the logits
    at position i rate the token at i + 1 (the first token has nothing before it)."""

    def __init__(self, prompt: Sequence[int], top_n: int, n_vocab: int) -> None:
        self.prompt, self.top_n = prompt, top_n
        self.max_rows = prompt_rows_per_decode(n_vocab)
        self.values: list[tuple[float, dict[str, float]]] = []  # for tokens 1, 2, ...

    def read(self, context: Context, position: int, count: int, first_row: int = 0) -> None:
        """After a decode of ``count`` prompt tokens from ``position`` (in the batch's rows
        from ``first_row``: other sequences may share it), every row's logits."""
        for row in range(count):
            following = position + row + 1
            if following < len(self.prompt):
                token = self.prompt[following]
                logprob, top, *_ = token_logprobs(context, token, self.top_n, first_row + row)
                self.values.append((logprob, top))


class PromptRows(Protocol):
    """What reads every row's logits of a prompt's decodes (``KvState.decode_prompt``)."""

    max_rows: int  # rows one decode may return

    def read(self, context: Context, position: int, count: int, first_row: int = 0) -> None: ...


class PromptLogits:
    """The raw logits of a prompt's tokens from position ``start`` to ``end`` (``Llama.evaluate``),
    a row each, copied into ``rows`` as the decodes return them (allocated once: no second
    copy of what may be gigabytes)."""

    def __init__(self, start: int, end: int, n_vocab: int) -> None:
        self.start = self.filled = start
        self.max_rows = prompt_rows_per_decode(n_vocab)
        self.rows = np.empty((end - start, n_vocab), dtype=np.float32)

    def read(self, context: Context, position: int, count: int, first_row: int = 0) -> None:
        for row in range(max(0, self.start - position), count):
            at = position + row
            if at == self.filled:  # in order from ``start``; a gap leaves ``filled`` short
                self.rows[at - self.start] = context.logits(first_row + row)
                self.filled = at + 1
