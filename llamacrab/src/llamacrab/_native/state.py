"""SavedState: a context's KV state with a header that makes loading it into the wrong place fail.

Layout (little-endian): magic ``LCRBSTAT``, format version (u32), scope (u32: 0 sequence 0,
1 whole context), n_ctx (u32), model identity
(32-byte sha256), token count (u32) and tokens (i32 each), payload length (u64) and llama.cpp's
own state bytes, then a sha256 of everything before it. A truncated or altered blob fails the
checksum before llama.cpp reads a byte of it.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llamacrab._exceptions import StateError

MAGIC = b"LCRBSTAT"
FORMAT_VERSION = 1
_HEAD = struct.Struct("<8sIII32sI")
_SCOPES = ("sequence", "context")
_DIGEST = 32


@dataclass(frozen=True, eq=False)
class SavedState:
    """KV memory for ``tokens`` from a model identified by ``model_id``: of sequence 0
    (``scope="sequence"``) or of the whole context (``"context"``: all sequences and the
    outputs of the last decode)."""

    tokens: tuple[int, ...]
    payload: bytes | memoryview  # a view into the blob it was read from: states are large
    model_id: bytes
    n_ctx: int
    scope: str = "sequence"

    @property
    def size_bytes(self) -> int:
        """Memory it holds: llama.cpp's payload and the tokens."""
        return len(self.payload) + 4 * len(self.tokens)

    def to_bytes(self) -> bytes:
        tokens = np.asarray(self.tokens, dtype="<i4").tobytes()
        body = (
            _HEAD.pack(
                MAGIC,
                FORMAT_VERSION,
                _SCOPES.index(self.scope),
                self.n_ctx,
                self.model_id,
                len(self.tokens),
            )
            + tokens
            + struct.pack("<Q", len(self.payload))
            + self.payload
        )
        return body + hashlib.sha256(body).digest()

    @classmethod
    def from_bytes(cls, blob: bytes) -> SavedState:
        """The state in ``blob``; StateError for anything that is not a whole, well-formed one."""
        # Views, not slices: copying tens of megabytes would cost more than the checksum.
        try:
            view = memoryview(blob).cast("B")
        except TypeError as error:  # not bytes-like, or not contiguous
            raise StateError(
                f"a saved state is contiguous bytes, not {type(blob).__name__}"
            ) from error
        if len(view) < _HEAD.size + 8 + _DIGEST or bytes(view[: len(MAGIC)]) != MAGIC:
            raise StateError("not a llamacrab state (bad magic or too short)")
        body, digest = view[:-_DIGEST], view[-_DIGEST:]
        if hashlib.sha256(body).digest() != digest:
            raise StateError("the state is truncated or corrupted (checksum mismatch)")
        # The checksum proves the blob is whole, not that whoever wrote it was honest: every
        # length below is checked against the bytes actually there.
        _, version, scope, n_ctx, model_id, n_tokens = _HEAD.unpack_from(body)
        if version != FORMAT_VERSION:
            raise StateError(f"state format {version} is not supported (expected {FORMAT_VERSION})")
        if scope >= len(_SCOPES):
            raise StateError(f"unknown state scope {scope}")
        offset = _HEAD.size + 4 * n_tokens
        if offset + 8 > len(body):
            raise StateError(
                f"the state header says {n_tokens} tokens, more than its {len(body)} bytes hold"
            )
        tokens = np.frombuffer(body, dtype="<i4", count=n_tokens, offset=_HEAD.size)
        (size,) = struct.unpack_from("<Q", body, offset)
        payload = body[offset + 8 :]  # still a view
        if len(payload) != size:
            raise StateError(f"the state payload has {len(payload)} bytes, its header says {size}")
        return cls(tuple(int(t) for t in tokens), payload, model_id, n_ctx, _SCOPES[scope])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SavedState):
            return NotImplemented
        return (self.tokens, self.model_id, self.n_ctx, self.scope) == (
            other.tokens, other.model_id, other.n_ctx, other.scope
        ) and self.payload == other.payload  # fmt: skip

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write to ``path`` atomically (a crash never leaves half a file behind)."""
        target = Path(path)
        partial = target.with_name(target.name + ".partial")
        partial.write_bytes(self.to_bytes())
        partial.replace(target)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SavedState:
        return cls.from_bytes(Path(path).read_bytes())
