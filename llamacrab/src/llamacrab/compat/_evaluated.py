"""What ``eval()`` computed: the logits llama-cpp-python's ``scores`` and ``eval_logits``
show, and which ``sample()`` may pick from."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from llamacrab._types import common_prefix


class Evaluated:
    """The rows of logits ``eval()`` returned, by position: row p rates the token after
    token p, and holds only while the context's tokens up to p are those it was computed
    after. ``keep_all`` (``logits_all=True``) keeps every row, else the last one alone."""

    def __init__(self, n_vocab: int, keep_all: bool) -> None:
        self.n_vocab, self.keep_all = n_vocab, keep_all
        self.tokens: list[int] = []  # the context's tokens right after the last eval()
        self.rows: dict[int, np.ndarray] = {}

    def record(self, held: Sequence[int], new: Sequence[int], logits: np.ndarray) -> None:
        """An eval() of ``new`` after ``held`` returned ``logits``: a row for each of the last
        ``len(logits)`` tokens."""
        tokens = [*held, *new]
        still = common_prefix(self.tokens, held) if self.keep_all else 0
        self.rows = {p: row for p, row in self.rows.items() if p < still}
        start = len(tokens) - len(logits)
        self.rows.update((start + i, row) for i, row in enumerate(logits))
        self.tokens = tokens

    def scores(self, held: Sequence[int]) -> npt.NDArray[np.single]:
        """One row per token the context holds, zeros where no eval() computed it for them."""
        valid = common_prefix(self.tokens, held)
        scores = np.zeros((len(held), self.n_vocab), dtype=np.single)
        for position, row in self.rows.items():
            if position < valid:
                scores[position] = row
        return scores

    def is_last(self, held: Sequence[int], last_logits: np.ndarray | None) -> bool:
        """Whether the context holds what the last eval() left and ``last_logits`` (its last
        decode's last row, None where it has none) are still those eval() returned: the same
        tokens may have been loaded back (load_state) after another request's decode."""
        if not self.tokens or list(held) != self.tokens or last_logits is None:
            return False
        return bool(np.array_equal(last_logits, self.rows[len(self.tokens) - 1]))
