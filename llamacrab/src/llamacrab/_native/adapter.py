"""LoraAdapter: wraps ``struct llama_adapter_lora``; a child of its model, applied to contexts."""

from __future__ import annotations

import os
import weakref
from typing import Any, Protocol

from llamacrab._exceptions import ModelLoadError
from llamacrab._field_types import file_path
from llamacrab._native.call import c_path, call, ffi, lib, read_string
from llamacrab._native.gguf.check import validate_gguf
from llamacrab._native.handle import NativeHandle
from llamacrab._native.logging import log_lines
from llamacrab._native.model import Model
from llamacrab._native.signals import held_signals


class AdapterUser(Protocol):
    """A context applying adapters: told to drop one before it is freed."""

    def remove_lora_adapter(self, adapter: LoraAdapter) -> None: ...


class LoraAdapter(NativeHandle):
    """A LoRA adapter loaded for one model. Closing it first removes it from every context
    that applies it, so no context ever points at a freed adapter."""

    kind = "LoRA adapter"

    def __init__(self, model: Model, path: str | os.PathLike[str]) -> None:
        file = file_path("the adapter path", path)
        validate_gguf(file, kind="adapter")
        stat = file.stat()  # before loading: the identity describes the bytes llama.cpp reads
        log_lines.take_errors()
        # Set before it is adopted: closing the model from another thread may close it at once.
        self._users: weakref.WeakSet[AdapterUser] = weakref.WeakSet()
        # Closing the model from another thread waits for the load, then closes this too;
        # signals wait for the handle (signals.py).
        with held_signals(), model.in_flight() as model_pointer:
            pointer = call("llama_adapter_lora_init", model_pointer, c_path(file, "adapter path"))
            if pointer == ffi.NULL:
                reason = log_lines.take_errors() or "see the llamacrab logger"
                raise ModelLoadError(f"llama.cpp could not load the LoRA adapter {file}: {reason}")
            super().__init__(pointer, lib.llama_adapter_lora_free, model)
        self.model = model
        self.path = file
        with self.in_flight() as adapter:
            count = int(lib.llama_adapter_get_alora_n_invocation_tokens(adapter))
            tokens = lib.llama_adapter_get_alora_invocation_tokens(adapter)
            # aLoRA: the adapter applies from the last occurrence of these tokens in a prompt.
            self.alora_invocation_tokens = tuple(int(tokens[i]) for i in range(count))
        # What prompt caches tell adapters apart by, across processes too: the file as loaded.
        self.identity = f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"

    @property
    def metadata(self) -> dict[str, str]:
        result = {}
        with self.in_flight() as adapter:
            for i in range(lib.llama_adapter_meta_count(adapter)):
                key = read_string(
                    lambda b, n, i=i: lib.llama_adapter_meta_key_by_index(adapter, i, b, n)
                )
                result[key] = read_string(
                    lambda b, n, i=i: lib.llama_adapter_meta_val_str_by_index(adapter, i, b, n)
                )
        return result

    def _used_by(self, context: AdapterUser) -> None:
        self._users.add(context)

    def _unused_by(self, context: AdapterUser) -> None:
        self._users.discard(context)

    def _close(self, timeout: float | None) -> bool:
        for context in list(self._users):
            context.remove_lora_adapter(self)
        return super()._close(timeout)

    def __repr__(self) -> str:
        return f"<LoraAdapter {self.path.name}{' closed' if self.closed else ''}>"

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: Any) -> bool:
        return self is other
