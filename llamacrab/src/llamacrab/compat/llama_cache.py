"""llama-cpp-python's prompt caches (``llama_cpp.llama_cache``) as llamacrab's own: give one to
``Llama.set_cache``. States are stored after each completion and the longest cached prefix of
a prompt is restored before it, as in llama-cpp-python; llamacrab keys them by model and KV
settings too, so a state of another model is never loaded."""

from __future__ import annotations

import os

from llamacrab import DiskCache, PromptCache, RamCache


class BaseLlamaCache(PromptCache):
    """llamacrab's PromptCache under llama-cpp-python's name. A custom cache implements
    PromptCache's ``store`` / ``_keys`` / ``_get`` / ``__len__``: llama-cpp-python's
    ``__getitem__`` / ``__setitem__`` interface is not what the engine calls."""

    @property
    def cache_size(self) -> int:
        """Bytes held."""
        return self.size_bytes

    @property
    def size_bytes(self) -> int:
        raise NotImplementedError


class LlamaRAMCache(RamCache, BaseLlamaCache):
    """States in memory, least recently used dropped first beyond ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int = 2 << 30) -> None:
        super().__init__(capacity_bytes)


class LlamaDiskCache(DiskCache, BaseLlamaCache):
    """States in ``cache_dir`` (kept across runs), least recently used evicted beyond
    ``capacity_bytes``."""

    def __init__(
        self,
        cache_dir: str | os.PathLike[str] = ".cache/llama_cache",
        capacity_bytes: int = 2 << 30,
    ) -> None:
        super().__init__(cache_dir, capacity_bytes)
        self.cache_dir = os.fspath(cache_dir)


LlamaCache = LlamaRAMCache  # llama-cpp-python's older name

__all__ = ["BaseLlamaCache", "LlamaCache", "LlamaDiskCache", "LlamaRAMCache"]
