"""Batch: a ``struct llama_batch`` over arrays Python owns, filled with numpy, no per-token loop."""

from __future__ import annotations

from typing import Any

import numpy as np

from llamacrab._exceptions import ClosedHandleError, InvalidParameterError
from llamacrab._field_types import INT32_MAX, INT32_MIN, LAST_POSITION, check_range
from llamacrab._native.call import ffi


def check_positions(low: int, high: int) -> None:
    """Positions run from 0 to LAST_POSITION. llama.cpp takes -1 as the mark of an empty KV
    cell (a token there is held but unseen) and a learned position table's row (BERT aborts)."""
    if low < 0:
        raise InvalidParameterError(f"position {low} is negative: positions start at 0")
    if high > LAST_POSITION:
        raise InvalidParameterError(
            f"position {high} is past the highest llama.cpp's int32 arithmetic leaves room "
            f"for, {LAST_POSITION}"
        )


def _int32s(name: str, values: np.ndarray) -> np.ndarray:
    """``values`` as integers that fit int32 (numpy's assignment would wrap 2**40 to token 0 or
    truncate 1.5 to 1)."""
    array = np.asarray(values)
    if array.dtype.kind not in "iu" or (
        array.size and not (array.min() >= INT32_MIN and array.max() <= INT32_MAX)
    ):
        raise InvalidParameterError(f"{name} must be integers within int32")
    return array


class Batch:
    """Room for ``capacity`` tokens of up to ``n_seq_max`` sequences (one sequence per token).
    Python owns its arrays (nothing native to free); after ``close()`` they are released and
    any use raises ClosedHandleError, as a handle does."""

    closed = False

    def __init__(self, capacity: int, n_seq_max: int = 1) -> None:
        if capacity < 1 or n_seq_max < 1:
            raise InvalidParameterError(f"batch capacity {capacity} / n_seq_max {n_seq_max} < 1")
        self.capacity = capacity
        self._tokens = np.zeros(capacity, dtype=np.int32)
        self._positions = np.zeros(capacity, dtype=np.int32)
        self._n_seq_id = np.ones(capacity, dtype=np.int32)
        self._logits = np.zeros(capacity, dtype=np.int8)
        # One cell per sequence id; each token's seq_id pointer points at the cell of its sequence.
        self._seq_cells = np.arange(n_seq_max, dtype=np.int32)
        self._seq_pointers = np.zeros(capacity, dtype=np.uintp)
        self._cells_address = int(ffi.cast("uintptr_t", ffi.from_buffer(self._seq_cells)))
        self.n_seq_max = n_seq_max
        self.struct = ffi.new("struct llama_batch *")
        self.struct.token = ffi.from_buffer("llama_token[]", self._tokens)
        self.struct.pos = ffi.from_buffer("llama_pos[]", self._positions)
        self.struct.n_seq_id = ffi.from_buffer("int32_t[]", self._n_seq_id)
        self.struct.seq_id = ffi.cast("llama_seq_id **", ffi.from_buffer(self._seq_pointers))
        self.struct.logits = ffi.from_buffer("int8_t[]", self._logits)
        self.struct.embd = ffi.NULL
        self.struct.n_tokens = 0

    def set(
        self,
        tokens: np.ndarray,
        start_pos: int,
        seq_id: int = 0,
        logits_last: bool = True,
        logits_all: bool = False,
    ) -> None:
        """Fill with ``tokens`` at positions ``start_pos..`` of sequence ``seq_id``."""
        self._check_open()
        n = len(tokens)
        if not 0 < n <= self.capacity:
            raise InvalidParameterError(f"{n} tokens do not fit a batch of {self.capacity}")
        self._check_seq_id(seq_id)
        check_range("start_pos", start_pos, INT32_MIN, INT32_MAX)  # numpy would truncate 1.5
        check_positions(start_pos, start_pos + n - 1)
        self._tokens[:n] = _int32s("tokens", tokens)
        self._positions[:n] = np.arange(start_pos, start_pos + n, dtype=np.int32)
        self._seq_pointers[:n] = self._cells_address + 4 * seq_id
        self._logits[:n] = 1 if logits_all else 0
        if logits_last:
            self._logits[n - 1] = 1
        self.struct.n_tokens = n

    def output_all(self) -> None:
        """Make every token an output (reading the last one's logits is unchanged)."""
        self._logits[: self.struct.n_tokens] = 1

    def set_sequences(self, sequences: list[np.ndarray]) -> None:
        """Several whole sequences at once (sequence i gets seq_id i, positions from 0), every
        token an output: the layout of batched embeddings."""
        self._check_open()
        lengths = np.array([len(s) for s in sequences], dtype=np.int64)
        n = int(lengths.sum())
        if not 0 < n <= self.capacity or len(sequences) > self.n_seq_max:
            raise InvalidParameterError(
                f"{len(sequences)} sequences of {n} tokens do not fit a batch of {self.capacity} "
                f"tokens and {self.n_seq_max} sequences"
            )
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        seq_ids = np.repeat(np.arange(len(sequences)), lengths)
        self._tokens[:n] = _int32s("tokens", np.concatenate(sequences))
        self._positions[:n] = np.arange(n) - starts
        self._seq_pointers[:n] = self._cells_address + 4 * seq_ids
        self._logits[:n] = 1
        self.struct.n_tokens = n

    def set_rows(
        self, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray, logits: np.ndarray
    ) -> None:
        """Any mix of sequences, one row per token (continuous batching of parallel slots)."""
        self._check_open()
        n = len(tokens)
        if not 0 < n <= self.capacity:
            raise InvalidParameterError(f"{n} tokens do not fit a batch of {self.capacity}")
        if not len(positions) == len(seq_ids) == len(logits) == n:
            raise InvalidParameterError("tokens, positions, seq_ids and logits differ in length")
        seq_ids = _int32s("seq_ids", seq_ids)
        if seq_ids.min() < 0 or seq_ids.max() >= self.n_seq_max:
            raise InvalidParameterError(f"a seq_id outside 0..{self.n_seq_max - 1}")
        self._tokens[:n] = _int32s("tokens", tokens)
        positions = _int32s("positions", positions)
        check_positions(int(positions.min()), int(positions.max()))
        self._positions[:n] = positions
        self._seq_pointers[:n] = self._cells_address + 4 * seq_ids.astype(np.uintp)
        self._logits[:n] = logits
        self.struct.n_tokens = n

    def output_sequences(self) -> frozenset[int]:
        """The sequence ids of the rows that ask for outputs."""
        n = self.struct.n_tokens
        return self._sequences_of(self._seq_pointers[:n][self._logits[:n] != 0])

    def sequences(self) -> frozenset[int]:
        """The sequence ids of every row."""
        return self._sequences_of(self._seq_pointers[: self.struct.n_tokens])

    def _sequences_of(self, pointers: np.ndarray) -> frozenset[int]:
        return frozenset(((pointers - self._cells_address) // 4).tolist())

    def last_position(self) -> int:
        """The highest position the batch holds (-1 when empty)."""
        n = self.struct.n_tokens
        return int(self._positions[:n].max()) if n else -1

    def set_one(self, token: int, pos: int, seq_id: int = 0) -> None:
        """The per-token fast path of generation: one token, logits wanted."""
        self._check_open()
        # The seq_id pointer must stay inside the cells (llama.cpp reads through it), and the
        # numbers must fit int32 (numpy would raise OverflowError).
        self._check_seq_id(seq_id)
        check_range("token", token, INT32_MIN, INT32_MAX)
        check_range("pos", pos, INT32_MIN, INT32_MAX)
        check_positions(pos, pos)
        self._tokens[0] = token
        self._positions[0] = pos
        self._seq_pointers[0] = self._cells_address + 4 * seq_id
        self._logits[0] = 1
        self.struct.n_tokens = 1

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedHandleError("this batch is closed")

    def close(self) -> None:
        """Release the arrays. Calling it again does nothing."""
        if self.closed:
            return
        self.closed = True
        self.struct.n_tokens = 0
        for field in ("token", "pos", "n_seq_id", "seq_id", "logits"):
            setattr(self.struct, field, ffi.NULL)  # it points into nothing that is freed next
        empty32 = np.zeros(0, dtype=np.int32)
        self._tokens = self._positions = self._n_seq_id = self._seq_cells = empty32
        self._logits = np.zeros(0, dtype=np.int8)
        self._seq_pointers = np.zeros(0, dtype=np.uintp)

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_seq_id(self, seq_id: int) -> None:
        if not 0 <= seq_id < self.n_seq_max:
            raise InvalidParameterError(f"seq_id {seq_id} outside 0..{self.n_seq_max - 1}")

    @property
    def value(self) -> Any:
        """The struct itself, as llama_decode takes it (by value)."""
        self._check_open()
        return self.struct[0]
