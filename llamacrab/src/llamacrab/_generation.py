"""The generation loop: prompt decoding with KV prefix reuse, token sampling, stop handling."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from llamacrab._batch import Batch
from llamacrab._context import Context
from llamacrab._exceptions import ContextOverflowError, DecodeAbortedError, InvalidParameterError
from llamacrab._sampler import SamplerChain
from llamacrab._stop import StopMatcher
from llamacrab._types import FinishReason
from llamacrab._vocab import IncrementalDecoder


@dataclass
class Step:
    """What one generation step produced: new text, and the reason when it is the last."""

    text: str
    token: int | None
    finish_reason: FinishReason | None = None


class KvState:
    """The tokens currently held in sequence 0 of a context, to reuse a shared prompt prefix."""

    def __init__(self, context: Context) -> None:
        self.context = context
        self.tokens: list[int] = []
        self.batch = Batch(context.n_batch)

    def prepare(self, prompt: Sequence[int]) -> int:
        """Drop what the new prompt does not share; return how many prompt tokens to keep."""
        keep = 0
        for cached, wanted in zip(self.tokens, prompt, strict=False):
            if cached != wanted:
                break
            keep += 1
        keep = min(keep, len(prompt) - 1)  # the last prompt token is decoded again for its logits
        if keep < len(self.tokens) and not self.context.remove(0, keep, -1):
            self.context.clear()  # this memory cannot drop a suffix: start over
            keep = 0
        del self.tokens[keep:]
        return keep

    def reset(self) -> None:
        self.context.clear()
        self.tokens.clear()

    def decode_prompt(self, prompt: Sequence[int], keep: int) -> None:
        todo = np.asarray(prompt[keep:], dtype=np.int32)
        step = self.batch.capacity
        for start in range(0, len(todo), step):
            chunk = todo[start : start + step]
            self.batch.set(chunk, len(self.tokens), logits_last=start + step >= len(todo))
            self.decode_tracked(chunk.tolist())

    def decode_one(self, token: int) -> None:
        self.batch.set_one(token, len(self.tokens))
        self.decode_tracked([token])

    def decode_tracked(self, tokens: list[int]) -> None:
        try:
            self.context.decode(self.batch)
        except BaseException:
            self.reset()  # a failed decode may leave part of the batch in memory
            raise
        self.tokens.extend(tokens)


class Session:
    """One generation. A newer session on the same Llama supersedes it (it ends "cancelled")."""

    def __init__(self) -> None:
        self.superseded = False
        self.cancelled = threading.Event()


def _rest(stops: StopMatcher, decoder: IncrementalDecoder) -> str:
    """Everything held back, at the end of a generation that no stop string ended."""
    text = stops.push(decoder.flush())
    return text if stops.stopped else text + stops.flush()


def generate(
    kv: KvState,
    sampler: SamplerChain,
    prompt: Sequence[int],
    max_tokens: int | None,
    stop: Sequence[str],
    session: Session,
    lock: threading.RLock,
) -> Iterator[Step]:
    """Yield Steps until a finish reason. Each step holds ``lock``, so steps of concurrent
    generations never interleave inside llama.cpp."""
    context = kv.context
    if not prompt:
        raise InvalidParameterError("the prompt is empty (no tokens to decode)")
    if len(prompt) >= context.n_ctx:
        raise ContextOverflowError(
            f"the prompt has {len(prompt)} tokens; the context holds {context.n_ctx}"
        )
    if max_tokens is not None and max_tokens < 0:
        raise InvalidParameterError(f"max_tokens must be >= 0 or None, not {max_tokens}")
    vocab = context.model.vocab
    decoder = vocab.decoder()
    stops = StopMatcher(stop)
    with lock:
        keep = kv.prepare(prompt)
        try:
            kv.decode_prompt(prompt, keep)
        except DecodeAbortedError:
            yield Step("", None, "cancelled")
            return
    produced = 0
    while True:
        if session.superseded or session.cancelled.is_set():
            yield Step(stops.flush(), None, "cancelled")
            return
        if max_tokens is not None and produced >= max_tokens:
            yield Step(_rest(stops, decoder), None, "length")
            return
        with lock:
            if session.superseded:
                continue
            token = sampler.sample(context)
            produced += 1
            if vocab.is_eog(token):
                yield Step(_rest(stops, decoder), None, "eos")  # the end token is not output
                return
            text = stops.push(decoder.feed([token]))
            if stops.stopped:
                yield Step(text, token, "stop")
                return
            at_limit = max_tokens is not None and produced >= max_tokens
            if not at_limit:
                if len(kv.tokens) + 1 >= context.n_ctx:
                    yield Step(text + _rest(stops, decoder), token, "length")
                    return
                try:
                    kv.decode_one(token)
                except DecodeAbortedError:
                    yield Step(text, token, "cancelled")
                    return
        yield Step(text, token)
