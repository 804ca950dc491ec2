"""DRY samplers built once per model and settings, then cloned for each chain.

``llama_sampler_init_dry`` walks the whole vocabulary once per sequence breaker, detokenizing
every token and tokenizing partial overlaps, in one native call nothing interrupts: 0.1 s for
llama.cpp's 4 defaults on Gemma 3's 262k tokens, 4-5 s for 16 of 40 bytes. Here the breakers
are processed from an index of the vocabulary built once per model (dry_breakers: the same
pairs, 0.2-0.3 s for those 16) and llama.cpp is handed them processed; the walk is left where
llama.cpp does not export what takes them (Windows). A clone copies the processed breakers, so
each model keeps the few samplers it built last."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any

from llamacrab._exceptions import InvalidParameterError
from llamacrab._native.call import c_string, call, call_helper, ffi, lib
from llamacrab._native.dry_breakers import processed_breakers, token_texts
from llamacrab._native.handle import NativeHandle
from llamacrab._native.model import Model

# The most sequence breakers one DRY sampler takes: our server's cap on a request (llama-server
# has none), 4 times llama.cpp's 4 defaults. Each adds its matches to the sampler, which every
# generation's clone copies: on Gemma 3, 16 of 40 bytes make 80k pairs of 780k tokens, 22 ms to
# clone (and, where llama.cpp walks the vocabulary for each, 4-5 s to build).
MAX_DRY_BREAKERS = 16
# llama.cpp keeps a breaker's first 40 bytes (MAX_CHAR_LEN in llama_sampler_init_dry), cut
# wherever they end, even inside a character: a longer one is refused, not silently cut.
MAX_DRY_BREAKER_BYTES = 40
# The DRY settings each model keeps built: a server's clients rarely use more than a couple.
CACHED_PER_MODEL = 4
# Whether llama.cpp takes breakers processed here (dry_breakers): not from a Windows DLL, nor
# from a llamacrab-sys built before llamacrab_dry_from_tokens.
FROM_TOKENS = bool(getattr(lib, "llamacrab_dry_from_tokens_available", lambda: False)())

DryKey = tuple[tuple[str, ...], float, float, int, int]


def check_breakers(breakers: tuple[str, ...]) -> None:
    if len(breakers) > MAX_DRY_BREAKERS:
        raise InvalidParameterError(
            f"dry_sequence_breakers has {len(breakers)} breakers; at most {MAX_DRY_BREAKERS} "
            "are taken (each adds its matches in the vocabulary to every generation's sampler)"
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
    encoded = [c_string(b, "dry breaker") for b in breakers]
    build = from_tokens if FROM_TOKENS else walked
    pointer = build(model, encoded, multiplier, base, allowed_length, window)
    if pointer == ffi.NULL:
        raise InvalidParameterError("llama.cpp rejected the dry sampler settings")
    return pointer


def from_tokens(
    model: Model, breakers: list[bytes], multiplier: float, base: float, allowed_length: int,
    window: int,
) -> Any:  # fmt: skip
    """llama_sampler_init_dry's sampler, its breakers processed here (dry_breakers)."""
    done = processed_breakers(token_texts(model), model.vocab, breakers)
    return call_helper(
        "llamacrab_dry_from_tokens", model.vocab.pointer, multiplier, base, allowed_length,
        window, ffi.from_buffer("llama_token[]", done.heads),
        ffi.from_buffer("int32_t[]", done.tail_lengths), len(done.heads),
        ffi.from_buffer("llama_token[]", done.tails),
    )  # fmt: skip


def walked(
    model: Model, breakers: list[bytes], multiplier: float, base: float, allowed_length: int,
    window: int,
) -> Any:  # fmt: skip
    """llama_sampler_init_dry itself: a walk over the vocabulary per breaker."""
    strings = [ffi.new("char[]", b) for b in breakers]
    return call(
        "llama_sampler_init_dry", model.vocab.pointer, multiplier, base, allowed_length, window,
        ffi.new("const char *[]", strings), len(strings),
    )  # fmt: skip
