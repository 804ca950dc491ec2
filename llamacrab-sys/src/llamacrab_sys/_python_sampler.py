"""Samplers implemented in Python, as ``struct llama_sampler`` objects a native chain can own.

One static ``llama_sampler_i`` routes every call to the Python object behind the sampler's
``ctx`` (a cffi handle). The handle stays registered until llama.cpp frees the sampler, which it
does when the chain that owns it is freed. Cloning is not supported.
"""

from __future__ import annotations

from typing import Any, Protocol

from llamacrab_sys._callbacks import _report_callback_error
from llamacrab_sys._native import ffi, lib


class SamplerCallbacks(Protocol):
    """What a Python sampler provides. ``apply`` receives the raw ``llama_token_data_array *``."""

    name: str

    def accept(self, token: int) -> None: ...

    def apply(self, candidates: Any) -> None: ...

    def reset(self) -> None: ...


# The object and its handle for every live sampler, keyed by the handle's address.
_live: dict[int, tuple[Any, SamplerCallbacks, Any]] = {}


def _target(sampler: Any) -> SamplerCallbacks:
    return ffi.from_handle(sampler.ctx)  # type: ignore[no-any-return]


@ffi.def_extern(onerror=_report_callback_error)  # type: ignore[misc]
def llamacrab_sampler_name(sampler: Any) -> Any:
    entry = _live.get(int(ffi.cast("uintptr_t", sampler.ctx)))
    return ffi.NULL if entry is None else entry[2]


@ffi.def_extern(onerror=_report_callback_error)  # type: ignore[misc]
def llamacrab_sampler_accept(sampler: Any, token: int) -> None:
    _target(sampler).accept(int(token))


@ffi.def_extern(onerror=_report_callback_error)  # type: ignore[misc]
def llamacrab_sampler_apply(sampler: Any, candidates: Any) -> None:
    _target(sampler).apply(candidates)


@ffi.def_extern(onerror=_report_callback_error)  # type: ignore[misc]
def llamacrab_sampler_reset(sampler: Any) -> None:
    _target(sampler).reset()


@ffi.def_extern(onerror=_report_callback_error)  # type: ignore[misc]
def llamacrab_sampler_free(sampler: Any) -> None:
    _live.pop(int(ffi.cast("uintptr_t", sampler.ctx)), None)


_interface = ffi.new("struct llama_sampler_i *")
_interface.name = lib.llamacrab_sampler_name
_interface.accept = lib.llamacrab_sampler_accept
_interface.apply = lib.llamacrab_sampler_apply
_interface.reset = lib.llamacrab_sampler_reset
_interface.free = lib.llamacrab_sampler_free


def python_sampler(callbacks: SamplerCallbacks) -> Any:
    """A new ``struct llama_sampler *`` calling ``callbacks``; add it to a chain, which owns it."""
    handle = ffi.new_handle(callbacks)
    name = ffi.new("char[]", callbacks.name.encode())
    sampler = lib.llama_sampler_init(_interface, handle)
    if sampler == ffi.NULL:
        raise MemoryError("llama_sampler_init returned NULL")
    _live[int(ffi.cast("uintptr_t", handle))] = (handle, callbacks, name)
    return sampler
