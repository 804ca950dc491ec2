"""DRY samplers built once per model and settings, then cloned for each chain.

``llama_sampler_init_dry`` walks the whole vocabulary once per sequence breaker, detokenizing
every token and tokenizing partial overlaps (0.15 s for llama.cpp's 4 defaults on Gemma 3's
262k tokens, seconds for 16 long ones), in one native call nothing interrupts. Its clone copies
the processed breakers without walking again, so each model keeps the few it built last."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any

from llamacrab._exceptions import InvalidParameterError
from llamacrab._native.call import c_string, call, ffi, lib
from llamacrab._native.handle import NativeHandle
from llamacrab._native.model import Model

# The most sequence breakers one DRY sampler takes: our server's cap on a request (llama-server
# has none), 4 times llama.cpp's 4 defaults. Each costs one walk over the vocabulary.
MAX_DRY_BREAKERS = 16
# llama.cpp keeps a breaker's first 40 bytes (MAX_CHAR_LEN in llama_sampler_init_dry), cut
# wherever they end, even inside a character: a longer one is refused, not silently cut.
MAX_DRY_BREAKER_BYTES = 40
# The DRY settings each model keeps built: a server's clients rarely use more than a couple.
CACHED_PER_MODEL = 4

DryKey = tuple[tuple[str, ...], float, float, int, int]


def check_breakers(breakers: tuple[str, ...]) -> None:
    if len(breakers) > MAX_DRY_BREAKERS:
        raise InvalidParameterError(
            f"dry_sequence_breakers has {len(breakers)} breakers; at most {MAX_DRY_BREAKERS} "
            "are taken (llama.cpp walks the whole vocabulary once for each)"
        )
    for breaker in breakers:
        size = len(breaker.encode("utf-8", "surrogatepass"))
        if size > MAX_DRY_BREAKER_BYTES:
            raise InvalidParameterError(
                f"dry_sequence_breakers: {breaker[:20]!r}... is {size} bytes of UTF-8; llama.cpp "
                f"reads at most {MAX_DRY_BREAKER_BYTES} (it cuts the rest)"
            )


class _BuiltDry(NativeHandle):
    """A DRY sampler that only ever gets cloned: never in a chain, its state stays empty. It
    holds token ids and its settings alone, no pointer into the model, so it does not keep the
    model alive (the cache holds it by the model, weakly); the model's close frees it first."""

    kind = "DRY sampler"

    def __init__(self, pointer: Any, model: Model) -> None:
        super().__init__(pointer, lib.llama_sampler_free, None)
        try:
            model._adopt(self)
        except BaseException:
            self._finalizer()  # the model is closing: freed now
            raise


_lock = threading.Lock()
_built: weakref.WeakKeyDictionary[Model, OrderedDict[DryKey, _BuiltDry]] = (
    weakref.WeakKeyDictionary()
)


def dry_sampler(model: Model, key: DryKey) -> Any:
    """A new native DRY sampler (the caller owns it) for ``key``: (breakers, multiplier, base,
    allowed length, window). Called with ``model`` held in flight, signals held."""
    with _lock:
        cached = _built.setdefault(model, OrderedDict())
        built = cached.get(key)
        if built is not None and not built.closed:
            cached.move_to_end(key)
    if built is None or built.closed:
        built = _BuiltDry(_build(model, key), model)
        with _lock:
            cached[key] = built  # a build racing this one: the last stays
            cached.move_to_end(key)
            while len(cached) > CACHED_PER_MODEL:
                cached.popitem(last=False)  # freed once no thread is cloning it
    with built.in_flight() as pointer:
        return call("llama_sampler_clone", pointer)


def _build(model: Model, key: DryKey) -> Any:
    breakers, multiplier, base, allowed_length, window = key
    check_breakers(breakers)
    strings = [ffi.new("char[]", c_string(b, "dry breaker")) for b in breakers]
    pointer = call(
        "llama_sampler_init_dry", model.vocab.pointer, multiplier, base, allowed_length, window,
        ffi.new("const char *[]", strings), len(strings),
    )  # fmt: skip
    if pointer == ffi.NULL:
        raise InvalidParameterError("llama.cpp rejected the dry sampler settings")
    return pointer
