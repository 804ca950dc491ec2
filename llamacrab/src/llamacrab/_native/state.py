"""SavedState: a context's KV state with a header that makes loading it into the wrong place fail.

Layout (little-endian): magic ``LCRBSTAT``, format version (u32), scope (u32: 0 sequence 0,
1 whole context), n_ctx (u32), model identity
(32-byte sha256), token count (u32); from version 4 the KV fingerprint (32 bytes, zeros: not
recorded; version 4's is of an earlier layout, which no context makes now: read as not
recorded); tokens (i32 each), payload length (u64) and llama.cpp's
own state bytes; from version 2 a checkpoint count (u32) and per checkpoint its token count
(u32), payload length (u64) and payload; then a checksum of everything before it: from version 3
the 16-byte XXH3-128, before it a sha256. A truncated or altered blob fails the checksum (a
length it declares that its bytes do not hold, first) before llama.cpp reads a byte of it.
Versions 1 (no checkpoints), 2, 3 and 4 are still read, without a KV fingerprint: a state of
them does not say what its memory was computed with.
"""

from __future__ import annotations

import hashlib
import io
import mmap
import os
import stat
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import xxhash

from llamacrab._exceptions import StateError
from llamacrab._field_types import file_path


class _Checksum(Protocol):
    @property
    def digest_size(self) -> int: ...

    def update(self, data: Any, /) -> None: ...

    def digest(self) -> bytes: ...


MAGIC = b"LCRBSTAT"
FORMAT_VERSION = 5
_HEAD = struct.Struct("<8sIII32sI")
_FINGERPRINT = struct.Struct("32s")  # after the head, from version 4 (4's: an earlier layout)
_UNRECORDED = bytes(_FINGERPRINT.size)
_CHECKPOINT_HEAD = struct.Struct("<IQ")
_SCOPES = ("sequence", "context")
# The checksum guards against damage, not against a writer (anyone can compute one; every
# length is checked on its own). XXH3-128 checks a 29 MB state in ~3 ms where sha256 took
# ~27 ms: a prompt cache on disk pays it on every restore.
_CHECKSUMS: dict[int, Callable[..., _Checksum]] = {
    1: hashlib.sha256, 2: hashlib.sha256, 3: xxhash.xxh3_128, 4: xxhash.xxh3_128,
    5: xxhash.xxh3_128,
}  # fmt: skip


@dataclass(frozen=True)
class StateCheckpoint:
    """The windowed layers' cells of a sliding-window model after its first ``n_tokens``
    tokens (llama.cpp's partial sequence state). Those layers keep only the window before the
    newest token, so a memory cut back before that window goes on from here instead: the full
    layers are cut to ``n_tokens`` and these cells put back."""

    n_tokens: int
    payload: bytes | memoryview  # a view, as SavedState's: checkpoints add megabytes

    def __hash__(self) -> int:
        # Not the payload's: a view of numpy memory (what a snapshot holds) cannot be hashed.
        return hash((self.n_tokens, len(self.payload)))

    def __reduce__(self) -> tuple[Any, ...]:
        return StateCheckpoint, (self.n_tokens, bytes(self.payload))  # a view cannot pickle


@dataclass(frozen=True, eq=False)
class SavedState:
    """KV memory for ``tokens`` from a model identified by ``model_id``: of sequence 0
    (``scope="sequence"``) or of the whole context (``"context"``: all sequences and the
    outputs of the last decode). ``kv_fingerprint``: what, besides the tokens, the memory was
    computed with (``Context.fingerprint``: the model, KV settings, control vector, LoRA
    files and scales); None where not recorded (formats before 5)."""

    tokens: tuple[int, ...]
    payload: bytes | memoryview  # a view into the blob it was read from: states are large
    model_id: bytes
    n_ctx: int
    scope: str = "sequence"
    checkpoints: tuple[StateCheckpoint, ...] = ()  # by n_tokens, each within ``tokens``
    kv_fingerprint: bytes | None = None

    def __post_init__(self) -> None:
        if self.kv_fingerprint is not None and (
            len(self.kv_fingerprint) != _FINGERPRINT.size or self.kv_fingerprint == _UNRECORDED
        ):
            raise StateError(f"a KV fingerprint is {_FINGERPRINT.size} bytes, not all zero")
        previous = 0
        for checkpoint in self.checkpoints:
            if not previous < checkpoint.n_tokens <= len(self.tokens):
                raise StateError(
                    f"a checkpoint after {checkpoint.n_tokens} tokens does not fit a state of "
                    f"{len(self.tokens)} tokens (checkpoints go by increasing token counts)"
                )
            previous = checkpoint.n_tokens
        if self.checkpoints and self.scope != "sequence":
            raise StateError("only a sequence's state has checkpoints")

    @property
    def size_bytes(self) -> int:
        """Memory it holds: llama.cpp's payloads and the tokens."""
        extra = sum(len(checkpoint.payload) for checkpoint in self.checkpoints)
        return len(self.payload) + extra + 4 * len(self.tokens)

    def to_bytes(self) -> bytes:
        return b"".join(self.blob_parts())

    def blob_parts(self) -> list[bytes | memoryview]:
        """``to_bytes`` in parts, the payloads as they are held: a writer can send them on
        without joining tens of megabytes into one more copy first."""
        head = _HEAD.pack(
            MAGIC, FORMAT_VERSION, _SCOPES.index(self.scope), self.n_ctx, self.model_id,
            len(self.tokens),
        )  # fmt: skip
        parts: list[bytes | memoryview] = [
            head, self.kv_fingerprint or _UNRECORDED,
            np.asarray(self.tokens, dtype="<i4").tobytes(),
            struct.pack("<Q", len(self.payload)), self.payload,
            struct.pack("<I", len(self.checkpoints)),
        ]  # fmt: skip
        for checkpoint in self.checkpoints:
            parts += [_CHECKPOINT_HEAD.pack(checkpoint.n_tokens, len(checkpoint.payload)),
                      checkpoint.payload]  # fmt: skip
        digest = _CHECKSUMS[FORMAT_VERSION]()
        for part in parts:
            digest.update(part)
        return [*parts, digest.digest()]

    @classmethod
    def from_bytes(cls, blob: bytes | mmap.mmap) -> SavedState:
        """The state in ``blob``; StateError for anything that is not a whole, well-formed one."""
        # Views, not slices: copying tens of megabytes would cost more than the checksum.
        try:
            view = memoryview(blob).cast("B")
        except TypeError as error:  # not bytes-like, or not contiguous
            raise StateError(
                f"a saved state is contiguous bytes, not {type(blob).__name__}"
            ) from error
        if len(view) < _HEAD.size or bytes(view[: len(MAGIC)]) != MAGIC:
            raise StateError("not a llamacrab state (bad magic or too short)")
        # The version picks the checksum.
        version = _HEAD.unpack_from(view)[1]
        checksum = _CHECKSUMS.get(version)
        if checksum is None:
            raise StateError(f"state format {version} is not supported (expected {FORMAT_VERSION})")
        digest_size = checksum().digest_size
        if len(view) < _HEAD.size + 8 + digest_size:
            raise StateError("not a llamacrab state (too short)")
        body, digest = view[:-digest_size], view[-digest_size:]
        # The lengths the blob declares first, each checked against the bytes there: a 3 GiB
        # sparse file declaring a few tokens was hashed for 16 s before it was refused. The
        # checksum proves the blob whole, not its writer honest: they are checked either way.
        parts = _parts(body, version)
        if checksum(body).digest() != digest:
            raise StateError("the state is truncated or corrupted (checksum mismatch)")
        return cls(tuple(parts.tokens.tolist()), parts.payload, parts.model_id, parts.n_ctx,
                   parts.scope, parts.checkpoints, parts.fingerprint)  # fmt: skip

    def __reduce__(self) -> tuple[Any, ...]:
        # As its checked blob: the payloads are views (of a mapped file, of the buffer
        # llama.cpp wrote), which pickle cannot take.
        return SavedState.from_bytes, (self.to_bytes(),)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SavedState):
            return NotImplemented
        return (self.tokens, self.model_id, self.n_ctx, self.scope, self.checkpoints,
                self.kv_fingerprint) == (
            other.tokens, other.model_id, other.n_ctx, other.scope, other.checkpoints,
            other.kv_fingerprint,
        ) and self.payload == other.payload  # fmt: skip

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write to ``path`` atomically (a crash never leaves half a file behind, and a failed
        write, a full disk, leaves neither half a file nor its partial copy). The partial copy
        is a new file of a name of its own (mode 0600): a fixed ``NAME.partial`` planted as a
        link in the folder was followed, and the state written over the file it named."""
        target = file_path("the state path", path)
        descriptor, name = tempfile.mkstemp(
            prefix=target.name + ".", suffix=".partial", dir=target.parent
        )
        try:
            with os.fdopen(descriptor, "wb") as file:
                for part in self.blob_parts():
                    file.write(part)
            os.replace(name, target)
        except BaseException:
            Path(name).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SavedState:
        """The state saved at ``path``: a regular file (opening a FIFO would wait for a writer
        for ever, so the file is opened without waiting and refused unless regular)."""
        file = file_path("the state path", path)
        descriptor = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            os.close(descriptor)
            raise StateError(f"{file} is not a regular file")
        with open(descriptor, "rb") as opened:
            return cls.from_file(opened)

    @classmethod
    def from_file(cls, file: io.BufferedIOBase) -> SavedState:
        """The state in an open file (a real one, with a descriptor), mapped rather than read:
        reading copies tens of megabytes into fresh memory, which costs more than the checksum (a
        29 MB state: ~30 ms read, ~3 ms checked, here). As with a model file llama.cpp maps,
        a file cut short by another program while mapped ends the process (SIGBUS); nothing
        of ours shortens a state file in place (a DiskCache writes new files and unlinks old
        ones, ``save`` replaces atomically), and the payload views keep the mapping alive."""
        if os.fstat(file.fileno()).st_size == 0:  # mmap refuses empty files
            return cls.from_bytes(b"")
        return cls.from_bytes(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ))


@dataclass(frozen=True)
class _Parts:
    """A state blob's fields, the large ones views into it."""

    scope: str
    n_ctx: int
    model_id: bytes
    fingerprint: bytes | None
    tokens: np.ndarray[Any, np.dtype[np.int32]]
    payload: memoryview
    checkpoints: tuple[StateCheckpoint, ...]


def _parts(body: memoryview, version: int) -> _Parts:
    """The fields of a state's ``body`` (its blob less the checksum) as ``version`` lays them
    out; StateError where a length it declares does not fit the bytes there."""
    _, _, scope, n_ctx, model_id, n_tokens = _HEAD.unpack_from(body)
    if scope >= len(_SCOPES):
        raise StateError(f"unknown state scope {scope}")
    offset, fingerprint = _HEAD.size, None
    if version >= 4:
        if offset + _FINGERPRINT.size > len(body):
            raise StateError("the state ends inside its KV fingerprint")
        (fingerprint,) = _FINGERPRINT.unpack_from(body, offset)
        offset += _FINGERPRINT.size
    tokens_at, offset = offset, offset + 4 * n_tokens
    if offset + 8 > len(body):
        raise StateError(
            f"the state header says {n_tokens} tokens, more than its {len(body)} bytes hold"
        )
    tokens = np.frombuffer(body, dtype="<i4", count=n_tokens, offset=tokens_at)
    (size,) = struct.unpack_from("<Q", body, offset)
    offset += 8
    rest = len(body) - offset
    if size > rest or (version == 1 and size != rest):
        raise StateError(f"the state payload has {rest} bytes, its header says {size}")
    payload = body[offset : offset + size]  # still a view
    checkpoints = () if version == 1 else _read_checkpoints(body, offset + size)
    if version < FORMAT_VERSION or fingerprint == _UNRECORDED:
        fingerprint = None
    return _Parts(_SCOPES[scope], n_ctx, model_id, fingerprint, tokens, payload, checkpoints)


def _read_checkpoints(body: memoryview, offset: int) -> tuple[StateCheckpoint, ...]:
    """The checkpoints after the payload, each length checked against the bytes there."""
    if offset + 4 > len(body):
        raise StateError("the state ends before its checkpoint count")
    (count,) = struct.unpack_from("<I", body, offset)
    offset += 4
    checkpoints = []
    for _ in range(count):
        if offset + _CHECKPOINT_HEAD.size > len(body):
            raise StateError(f"the state ends inside its {count} checkpoints")
        n_tokens, size = _CHECKPOINT_HEAD.unpack_from(body, offset)
        offset += _CHECKPOINT_HEAD.size
        if offset + size > len(body):
            raise StateError(f"a checkpoint says {size} bytes, more than the state holds")
        checkpoints.append(StateCheckpoint(n_tokens, body[offset : offset + size]))
        offset += size
    if offset != len(body):
        raise StateError(f"{len(body) - offset} bytes follow the state's checkpoints")
    return tuple(checkpoints)
