"""Llama: a model plus one context, with tokenization and (streaming) text completion."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Generator, Sequence
from typing import Any

from llamacrab._context import Context, ContextParams
from llamacrab._exceptions import InvalidParameterError
from llamacrab._generation import KvState, Session, generate
from llamacrab._model import Model, ModelParams
from llamacrab._sampler import SamplerChain, SamplingOptions
from llamacrab._types import Completion, CompletionChoice, CompletionChunk, Usage

_MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelParams)}
_CONTEXT_FIELDS = {f.name for f in dataclasses.fields(ContextParams)}
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingOptions)}


def _split_params(options: dict[str, Any]) -> tuple[ModelParams, ContextParams]:
    unknown = set(options) - _MODEL_FIELDS - _CONTEXT_FIELDS
    if unknown:
        raise InvalidParameterError(f"unknown Llama parameters: {sorted(unknown)}")
    model = ModelParams(**{k: v for k, v in options.items() if k in _MODEL_FIELDS})
    context = ContextParams(**{k: v for k, v in options.items() if k in _CONTEXT_FIELDS})
    return model, context


class Llama:
    """A loaded model with one context.

    ``Llama(path, n_ctx=2048, n_threads=4, ...)`` takes any ModelParams / ContextParams field as
    a keyword. Calls are serialized: a completion started from another thread waits for the one
    running, and a new call supersedes an unfinished stream (which then ends "cancelled").
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        model_params: ModelParams | None = None,
        context_params: ContextParams | None = None,
        seed: int | None = None,
        progress: Callable[[float], object] | None = None,
        **options: Any,
    ) -> None:
        if options and (model_params or context_params):
            raise InvalidParameterError("pass parameter objects or keywords, not both")
        if options:
            model_params, context_params = _split_params(options)
        self.model = Model.load(model_path, model_params, progress)
        try:
            self.context = Context(self.model, context_params)
        except BaseException:
            self.model.close()
            raise
        self.seed = seed
        self._kv = KvState(self.context)
        self._lock = threading.RLock()
        self._session: weakref.ReferenceType[Session] | None = None

    @classmethod
    def load(cls, model_path: str | os.PathLike[str], **kwargs: Any) -> Llama:
        return cls(model_path, **kwargs)

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the context and the model. Idempotent."""
        self.model.close()

    @property
    def closed(self) -> bool:
        return self.model.closed

    def __enter__(self) -> Llama:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def reset(self) -> None:
        """Forget the cached prompt: the next call decodes its whole prompt again."""
        with self._lock:
            self._kv.reset()

    # -- tokens --------------------------------------------------------------------------------

    @property
    def vocab(self) -> Any:
        return self.model.vocab

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        return self.model.vocab.tokenize(text, add_special, parse_special)

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> str:
        return self.model.vocab.detokenize(tokens, special)

    # -- completion ----------------------------------------------------------------------------

    def cancel(self) -> None:
        """Stop the running generation (from any thread); it ends with finish_reason "cancelled"."""
        session = self._session() if self._session else None
        if session is not None:
            session.cancelled.set()
        self.context.cancel()

    def stream_completion(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int | None = 16,
        stop: str | Sequence[str] = (),
        echo: bool = False,
        sampling: SamplingOptions | None = None,
        **sampling_options: Any,
    ) -> Generator[CompletionChunk, None, None]:
        """Generate text chunk by chunk. Breaking out of the loop stops generation; the Llama
        stays usable. Keywords are SamplingOptions fields (temperature, top_k, seed, ...)."""
        prompt_tokens, prompt_text = self._prompt(prompt)
        sampler = self._sampler(sampling, sampling_options)
        stops = [stop] if isinstance(stop, str) else list(stop)
        return self._stream(prompt_tokens, prompt_text if echo else "", sampler, max_tokens, stops)

    def create_completion(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int | None = 16,
        stop: str | Sequence[str] = (),
        echo: bool = False,
        sampling: SamplingOptions | None = None,
        **sampling_options: Any,
    ) -> Completion:
        """Generate a completion of ``prompt`` (text, or tokens). See ``stream_completion``."""
        with self._lock:  # a whole completion at once: concurrent callers wait their turn
            stream = self.stream_completion(
                prompt,
                max_tokens=max_tokens,
                stop=stop,
                echo=echo,
                sampling=sampling,
                **sampling_options,
            )
            chunks = list(stream)
        last = chunks[-1]
        assert last.finish_reason is not None and last.usage is not None
        tokens = tuple(t for chunk in chunks for t in chunk.tokens)
        choice = CompletionChoice(0, "".join(c.text for c in chunks), last.finish_reason, tokens)
        return Completion(last.id, last.created, last.model, (choice,), last.usage)

    async def astream_completion(
        self, prompt: str | Sequence[int], **kwargs: Any
    ) -> AsyncIterator[CompletionChunk]:
        """``stream_completion`` for asyncio: each step runs in a worker thread."""
        stream = await asyncio.to_thread(self.stream_completion, prompt, **kwargs)
        done = object()
        try:
            while (chunk := await asyncio.to_thread(next, stream, done)) is not done:
                yield chunk  # type: ignore[misc]
        finally:
            await asyncio.to_thread(stream.close)

    # -- internals -----------------------------------------------------------------------------

    def _prompt(self, prompt: str | Sequence[int]) -> tuple[list[int], str]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidParameterError("the prompt is empty")
            return self.tokenize(prompt), prompt
        tokens = self.model.vocab.check_tokens(prompt).tolist()
        return tokens, self.detokenize(tokens)

    def _sampler(self, sampling: SamplingOptions | None, options: dict[str, Any]) -> SamplerChain:
        unknown = set(options) - _SAMPLING_FIELDS
        if unknown:
            raise InvalidParameterError(f"unknown sampling options: {sorted(unknown)}")
        base = sampling or SamplingOptions(seed=self.seed)
        return SamplerChain(self.model, dataclasses.replace(base, **options) if options else base)

    def _stream(
        self,
        prompt: list[int],
        echo_text: str,
        sampler: SamplerChain,
        max_tokens: int | None,
        stop: list[str],
    ) -> Generator[CompletionChunk, None, None]:
        session = Session()
        with self._lock:
            previous = self._session() if self._session else None
            if previous is not None:
                previous.superseded = True
            self._session = weakref.ref(session)
        chunk_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        name = self.model.path.name
        produced = 0
        try:
            if echo_text:
                yield CompletionChunk(chunk_id, created, name, 0, echo_text)
            for step in generate(self._kv, sampler, prompt, max_tokens, stop, session, self._lock):
                produced += step.token is not None
                usage = Usage(len(prompt), produced) if step.finish_reason else None
                tokens = () if step.token is None else (step.token,)
                yield CompletionChunk(chunk_id, created, name, 0, step.text,
                                      step.finish_reason, usage, tokens)  # fmt: skip
        finally:
            sampler.close()
