"""DRY samplers built once per model and settings, then cloned for each chain.

``llama_sampler_init_dry`` walks the whole vocabulary once per sequence breaker, detokenizing
every token and tokenizing partial overlaps, in one native call nothing interrupts: 0.1 s for
llama.cpp's 4 defaults on Gemma 3's 262k tokens, 4-5 s for 16 of 40 bytes. Here the breakers
are processed from an index of the vocabulary built once per model (dry_breakers: the same
pairs, 0.2-0.3 s for those 16) and llama.cpp is handed them processed; the walk is left where
llama.cpp does not export what takes them (Windows). A clone copies the processed breakers, so
each model keeps the few samplers it built last, and a request's breakers may make at most
MAX_DRY_PAIRS of them."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any

from llamacrab._exceptions import InvalidParameterError
from llamacrab._native.call import c_string, call, call_helper, ffi, lib
from llamacrab._native.dry_breakers import (
    MAX_BREAKER_BYTES,
    ProcessedBreakers,
    processed_breakers,
    token_texts,
)
from llamacrab._native.fork import reset_in_child
from llamacrab._native.handle import NativeHandle
from llamacrab._native.model import Model

# The most sequence breakers one DRY sampler takes: our server's cap on a request (llama-server
# has none), 4 times llama.cpp's 4 defaults (where llama.cpp walks the vocabulary for each, 16
# of 40 bytes take 4-5 s to build on Gemma 3).
MAX_DRY_BREAKERS = 16
# llama.cpp keeps a breaker's first 40 bytes (MAX_CHAR_LEN in llama_sampler_init_dry), cut
# wherever they end, even inside a character: a longer one is refused, not silently cut.
MAX_DRY_BREAKER_BYTES = MAX_BREAKER_BYTES
# The most (head, tail) pairs, and tokens in their tails, the breakers of one request may make:
# every generation's clone copies them, a hash node per pair and a vector per tail. The count
# of breakers does not bound them: on Gemma 3 one " " makes 137k pairs (3.7 ms, 7.6 MiB a
# clone), 16 breakers of 40 bytes 287k with 3.3M tokens (28 ms, 32 MiB). At the bounds a clone
# takes 1.6 ms and 2.8 MiB; llama.cpp's 4 defaults make 1.3k pairs, with 12 character names
# 9k and 17k tokens.
MAX_DRY_PAIRS = 32_768
MAX_DRY_TAIL_TOKENS = 131_072
# Whether this llamacrab-sys reads the token texts that breakers are processed from (not one
# built before llamacrab_vocab_token_texts): the pairs are counted before llama.cpp builds them.
PROCESSED_HERE = hasattr(lib, "llamacrab_vocab_token_texts")
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
reset_in_child(_lock)  # a thread holding it at fork() is not in the child
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


def check_size(done: ProcessedBreakers) -> None:
    pairs, tail_tokens = len(done.heads), len(done.tails)
    if pairs > MAX_DRY_PAIRS or tail_tokens > MAX_DRY_TAIL_TOKENS:
        raise InvalidParameterError(
            f"dry_sequence_breakers match {pairs} (token, rest) pairs in this model's vocabulary "
            f"with {tail_tokens} tokens of rests; at most {MAX_DRY_PAIRS} pairs and "
            f"{MAX_DRY_TAIL_TOKENS} tokens are taken (every generation copies them): use "
            "breakers fewer tokens contain (most contain a common letter or a space)"
        )


def _build(model: Model, key: DryKey) -> Any:
    breakers, multiplier, base, allowed_length, window = key
    check_breakers(breakers)
    # Each once: llama.cpp would add a copy's pairs again (and walk the vocabulary again).
    encoded = list(dict.fromkeys(c_string(b, "dry breaker") for b in breakers))
    settings = (multiplier, base, allowed_length, window)
    if PROCESSED_HERE:
        done = processed_breakers(token_texts(model), model.vocab, encoded)
        check_size(done)
    if FROM_TOKENS:  # implies PROCESSED_HERE (one llamacrab-sys brought both)
        pointer = from_tokens(model, done, *settings)
    else:
        pointer = walked(model, encoded, *settings)
    if pointer == ffi.NULL:
        raise InvalidParameterError("llama.cpp rejected the dry sampler settings")
    return pointer


def from_tokens(
    model: Model, done: ProcessedBreakers, multiplier: float, base: float, allowed_length: int,
    window: int,
) -> Any:  # fmt: skip
    """llama_sampler_init_dry's sampler, its breakers processed here (dry_breakers)."""
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
