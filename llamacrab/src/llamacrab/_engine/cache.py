"""Prompt caches: saved KV states keyed by their tokens, found by longest shared prefix.

``RamCache`` keeps them in memory (LRU, bounded by bytes); ``DiskCache`` in a directory through
the ``diskcache`` package (bounded, survives restarts). A completion whose prompt shares a prefix
with a cached state restores it and decodes only the rest. States live in namespaces: Llama
uses its context's ``kv_fingerprint`` (model, LoRA adapters and scales, rope and KV settings),
so a state computed under other weights or settings is never found.
"""

from __future__ import annotations

import abc
import io
import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from llamacrab._exceptions import InvalidParameterError, StateError
from llamacrab._native.state import SavedState
from llamacrab._types import common_prefix


class PromptCache(abc.ABC):
    """Where Llama keeps and finds saved prompt states."""

    def longest_prefix(
        self, tokens: Sequence[int], namespace: bytes = b""
    ) -> tuple[int, SavedState] | None:
        """The state in ``namespace`` sharing most leading tokens with ``tokens``, and how many."""
        best: tuple[int, tuple[int, ...]] | None = None
        for key in self._keys(namespace):
            shared = common_prefix(key, tokens)
            if shared and (best is None or shared > best[0]):
                best = (shared, key)
        if best is None:
            return None
        state = self._get(namespace, best[1])
        return None if state is None else (best[0], state)

    @abc.abstractmethod
    def store(self, state: SavedState, namespace: bytes = b"") -> None: ...

    @abc.abstractmethod
    def _keys(self, namespace: bytes) -> Iterable[tuple[int, ...]]:
        """The tokens of the states in ``namespace``."""

    @abc.abstractmethod
    def _get(self, namespace: bytes, tokens: tuple[int, ...]) -> SavedState | None: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...


def _check_capacity(capacity_bytes: int) -> None:
    if capacity_bytes < 1:
        raise InvalidParameterError(f"capacity_bytes must be positive, not {capacity_bytes}")


class RamCache(PromptCache):
    """States in memory, least recently used dropped first beyond ``capacity_bytes``. They are
    kept as objects: nothing is serialized or checksummed on the way in or out."""

    def __init__(self, capacity_bytes: int = 2 << 30) -> None:
        _check_capacity(capacity_bytes)
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[tuple[bytes, tuple[int, ...]], SavedState] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    @property
    def size_bytes(self) -> int:
        return self._size

    def store(self, state: SavedState, namespace: bytes = b"") -> None:
        size = state.size_bytes
        if size > self.capacity_bytes:
            return  # larger than the whole cache: keeping it would evict everything
        key = (namespace, state.tokens)
        with self._lock:
            old = self._entries.pop(key, None)
            self._size += size - (old.size_bytes if old else 0)
            self._entries[key] = state
            while self._size > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._size -= evicted.size_bytes

    def _keys(self, namespace: bytes) -> list[tuple[int, ...]]:
        with self._lock:
            return [tokens for space, tokens in self._entries if space == namespace]

    def _get(self, namespace: bytes, tokens: tuple[int, ...]) -> SavedState | None:
        with self._lock:
            state = self._entries.get((namespace, tokens))
            if state is not None:
                self._entries.move_to_end((namespace, tokens))
        return state

    def __len__(self) -> int:
        return len(self._entries)


class DiskCache(PromptCache):
    """States in ``directory`` (a ``diskcache.Cache``), least recently used evicted beyond
    ``capacity_bytes``. A corrupt entry is discarded with a warning."""

    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int = 8 << 30) -> None:
        import diskcache  # type: ignore[import-untyped]

        _check_capacity(capacity_bytes)
        self.capacity_bytes = capacity_bytes
        self._cache: Any = diskcache.Cache(
            os.fspath(directory), size_limit=capacity_bytes,
            eviction_policy="least-recently-used", cull_limit=0,
        )  # fmt: skip

    @property
    def size_bytes(self) -> int:
        return int(self._cache.volume())

    def store(self, state: SavedState, namespace: bytes = b"") -> None:
        # As a file to read: diskcache writes plain bytes line by line (one write per b"\n").
        self._cache.set(_key(namespace, state.tokens), io.BytesIO(state.to_bytes()), read=True)
        self._cache.cull()  # enforce the size limit now, not on some later write

    def _keys(self, namespace: bytes) -> list[tuple[int, ...]]:
        # Keys of another form (an older llamacrab's bare token bytes) belong to no namespace.
        return [
            tuple(np.frombuffer(key[1], dtype="<i4").tolist())
            for key in self._cache.iterkeys()
            if isinstance(key, tuple) and key[0] == namespace
        ]

    def _get(self, namespace: bytes, tokens: tuple[int, ...]) -> SavedState | None:
        key = _key(namespace, tokens)
        raw = self._cache.get(key)
        if raw is None:
            return None
        try:
            return SavedState.from_bytes(raw)
        except StateError as error:
            warnings.warn(f"discarding a corrupt prompt-cache entry: {error}", stacklevel=3)
            self._cache.delete(key)
            return None

    def close(self) -> None:
        self._cache.close()

    def __len__(self) -> int:
        return len(self._cache)


def _key(namespace: bytes, tokens: Sequence[int]) -> tuple[bytes, bytes]:
    return namespace, np.asarray(tokens, dtype="<i4").tobytes()
