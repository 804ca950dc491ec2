"""Llama: a model plus one context, with tokenization and (streaming) text completion."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from llamacrab._chat.media_parts import MediaPolicy, extract_media, has_media
from llamacrab._chat.options import ChatOptions
from llamacrab._chat.prompt import chat_prompt, template_source
from llamacrab._engine.cache import PromptCache
from llamacrab._engine.generation import MEDIA_TOKEN, KvState, Request, Session, Step, generate
from llamacrab._engine.scheduler import Scheduler
from llamacrab._engine.speculative import Drafter, DraftModel, PromptLookup, SpeculativeStats
from llamacrab._engine.stream import Stream
from llamacrab._exceptions import InvalidParameterError, MediaError
from llamacrab._features.embeddings import (
    DEFAULT_PACK_TOKENS,
    Embedder,
    normalized,
    pool_tokens,
    rerank_tokens,
)
from llamacrab._features.hub import HubOptions, ResolvedModel
from llamacrab._features.hub import resolve as resolve_model
from llamacrab._features.infill import infill_tokens
from llamacrab._native.adapter import LoraAdapter
from llamacrab._native.context import Context, ContextParams
from llamacrab._native.media import Media
from llamacrab._native.model import Model, ModelParams
from llamacrab._native.mtmd import Chunks, Projector
from llamacrab._native.sampler import Samplers, SamplingOptions
from llamacrab._native.state import SavedState
from llamacrab._native.vocab import Vocab
from llamacrab._types import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    CompletionChunk,
    Logprobs,
    RerankResult,
    Usage,
)

Speculative = PromptLookup | DraftModel
_MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelParams)}
_CONTEXT_FIELDS = {f.name for f in dataclasses.fields(ContextParams)}
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingOptions)}
_HUB_FIELDS = {f.name for f in dataclasses.fields(HubOptions)}


def _split_params(options: dict[str, Any]) -> tuple[ModelParams, ContextParams, HubOptions]:
    unknown = set(options) - _MODEL_FIELDS - _CONTEXT_FIELDS - _HUB_FIELDS
    if unknown:
        raise InvalidParameterError(f"unknown Llama parameters: {sorted(unknown)}")
    model = ModelParams(**{k: v for k, v in options.items() if k in _MODEL_FIELDS})
    context_options = {k: v for k, v in options.items() if k in _CONTEXT_FIELDS}
    if context_options.get("embeddings"):
        # Batched embeddings pack many texts as sequences of one shared memory.
        context_options = {"n_seq_max": 64, "kv_unified": True, **context_options}
    context = ContextParams(**context_options)
    hub = HubOptions(**{k: v for k, v in options.items() if k in _HUB_FIELDS})
    return model, context, hub


class Llama:
    """A loaded model with one context.

    ``Llama(path, n_ctx=2048, n_threads=4, ...)`` takes any ModelParams / ContextParams field as
    a keyword. ``cache`` (a RamCache or DiskCache) keeps prompt states across calls.
    ``path`` may be a Hugging Face repository id (``org/repo``, when no such local
    path exists): HubOptions fields (filename, revision, token, cache_dir, endpoint, offline,
    mmproj) choose what is fetched.

    ``mmproj`` (or the Hub's projector) makes it multimodal: images and sounds go into
    completions (``media=``, one ``media_marker`` per item in the prompt) and chat messages
    (``image_url`` / ``input_audio`` parts, from where ``media_policy`` allows).

    Calls are serialized: a completion started from another thread waits for the one running,
    and a new call supersedes an unfinished stream (which then ends "cancelled").

    ``parallel=N`` runs generations on N slots instead, as a server does: the slots share the
    context (each gets ``n_ctx / N`` tokens), an engine thread decodes all of them together
    (continuous batching), up to ``max_queue`` more wait for a slot (then QueueFullError), and
    nothing supersedes anything. Completions from several threads or asyncio tasks proceed
    side by side. State save/load and speculative decoding need ``parallel=None``.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        model_params: ModelParams | None = None,
        context_params: ContextParams | None = None,
        hub: HubOptions | None = None,
        cache: PromptCache | None = None,
        speculative: Speculative | None = None,
        chat_format: str | None = None,
        seed: int | None = None,
        progress: Callable[[float], object] | None = None,
        parallel: int | None = None,
        max_queue: int = 64,
        mmproj: str | os.PathLike[str] | None = None,
        media_policy: MediaPolicy | None = None,
        **options: Any,
    ) -> None:
        if options and (model_params or context_params or hub):
            raise InvalidParameterError("pass parameter objects or keywords, not both")
        if options:
            model_params, context_params, hub = _split_params(options)
        context_params = _with_slots(context_params, parallel, max_queue, speculative)
        self.files: ResolvedModel = resolve_model(model_path, hub)
        self.model = Model.load(self.files.path, model_params, progress)
        try:
            self.context = Context(self.model, context_params)
        except BaseException:
            self.model.close()
            raise
        self.projector: Projector | None = None
        projector_path = mmproj or self.files.mmproj
        if projector_path is not None:
            try:
                self.projector = Projector(
                    self.model, projector_path, self.context.params.n_threads
                )
            except BaseException:
                self.model.close()
                raise
        self.media_policy = media_policy or MediaPolicy()
        self.seed = seed
        self.speculative = speculative  # the default for completions
        self.chat_format = chat_format  # None: the model's own template
        self.speculative_stats = SpeculativeStats()  # of the last completion
        self._kv = KvState(self.context, cache)
        self._lock = threading.RLock()
        self._session: weakref.ReferenceType[Session] | None = None
        self._embedder_cache: Embedder | None = None
        self.scheduler: Scheduler | None = None
        if parallel is not None:
            self.scheduler = Scheduler(self.context, self._lock, parallel, max_queue, cache)
            # Collected or closed, the Llama stops its engine thread before the context goes.
            self._stop_engine = weakref.finalize(self, self.scheduler.close)

    @classmethod
    def load(cls, model_path: str | os.PathLike[str], **kwargs: Any) -> Llama:
        return cls(model_path, **kwargs)

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the context and the model. Idempotent."""
        if self.scheduler is not None:
            self._stop_engine()
        self.model.close()

    @property
    def closed(self) -> bool:
        return self.model.closed

    def __enter__(self) -> Llama:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def save_state(self, scope: str = "sequence") -> SavedState:
        """The KV memory and the tokens it holds (``SavedState.save`` writes it to a file);
        ``scope="context"`` saves the whole context (every sequence, last outputs)."""
        with self._lock:
            return self._one_slot("save_state").snapshot(scope)

    def load_state(self, state: SavedState) -> None:
        """Restore a state saved from this model; the next prompt sharing its tokens reuses it.
        A state from another model, a smaller context, or a corrupt blob raises StateError."""
        with self._lock:
            self._one_slot("load_state").restore(state)

    def reset(self) -> None:
        """Forget the cached prompt: the next call decodes its whole prompt again."""
        self._forget()

    def _forget(self) -> None:
        if self.scheduler is not None:
            self.scheduler.forget()
        else:
            with self._lock:
                self._kv.reset()

    def _one_slot(self, what: str) -> KvState:
        if self.scheduler is not None:
            raise InvalidParameterError(f"{what} needs a Llama with parallel=None")
        return self._kv

    # -- chat ----------------------------------------------------------------------------------

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        chat_format: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text a chat completion would send for ``messages`` (and ``tools``)."""
        return chat_prompt(self.model, messages, chat_format or self.chat_format, tools=tools)

    def create_chat_completion(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        chat_format: str | None = None,
        max_tokens: int | None = None,
        response_format: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] = "auto",
        check_tool_arguments: bool = False,
        **kwargs: Any,
    ) -> ChatCompletion:
        """Answer ``messages`` (OpenAI-shaped dicts: role, content) with the model's chat
        template. ``max_tokens=None`` runs to the end of the turn or of the context.
        ``response_format`` ({"type": "json_object"} or {"type": "json_schema", "json_schema":
        {"schema": ...}}) constrains the answer with a grammar. Other keywords are those of
        ``create_completion`` (sampling, stop, logprobs, n, seed, ...).

        ``tools`` (OpenAI function definitions) are given to the chat template; calls in the
        answer come back in ``message.tool_calls`` with finish_reason "tool_calls".
        ``tool_choice`` "none" ignores them; "auto" lets the model decide, and where the chat
        template shows a tool-call opener (``<tool_call>``, ``[TOOL_CALLS]``,
        ``<|python_tag|>``) a lazy grammar makes any call the model starts well-formed;
        "required" or {"type": "function", "function": {"name": ...}} forces a call with a
        grammar (as generic JSON), so it always parses. ``check_tool_arguments`` validates
        each call's arguments against its tool's schema (ToolCallError if not; needs the
        jsonschema package). Tools are never executed."""
        options = ChatOptions(tools, tool_choice, response_format, check_tool_arguments)
        tokens, kwargs = self._chat_request(messages, chat_format, options, kwargs)
        result = self.create_completion(tokens, max_tokens=max_tokens, **kwargs)
        choices = tuple(options.choice(c) for c in result.choices)
        chat_id = "chatcmpl-" + result.id.removeprefix("cmpl-")
        return ChatCompletion(chat_id, result.created, result.model, choices, result.usage)

    def stream_chat_completion(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        chat_format: str | None = None,
        max_tokens: int | None = None,
        response_format: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] = "auto",
        check_tool_arguments: bool = False,
        **kwargs: Any,
    ) -> Stream[ChatCompletionChunk]:
        """``create_chat_completion`` as a stream of deltas (the first carries the role).
        With ``tools``, text from a tool-call opener on is held back; the last delta carries
        the parsed ``tool_calls`` (finish_reason "tool_calls"), or the text if none parsed."""
        options = ChatOptions(tools, tool_choice, response_format, check_tool_arguments)
        tokens, kwargs = self._chat_request(messages, chat_format, options, kwargs)
        stream = self.stream_completion(tokens, max_tokens=max_tokens, **kwargs)
        return stream.then(options.chunks)

    async def astream_chat_completion(
        self, messages: Sequence[Mapping[str, Any]], **kwargs: Any
    ) -> AsyncIterator[ChatCompletionChunk]:
        """``stream_chat_completion`` for asyncio: a worker thread drives the stream."""
        stream = self.stream_chat_completion(messages, **kwargs)
        async for chunk in stream:
            yield chunk

    def _chat_request(
        self,
        messages: Sequence[Mapping[str, Any]],
        chat_format: str | None,
        options: ChatOptions,
        kwargs: dict[str, Any],
    ) -> tuple[list[int] | Chunks, dict[str, Any]]:
        """The prompt (tokens, or chunks with media) and the completion keywords."""
        chat_format = chat_format or self.chat_format
        tokens = self._chat_tokens(messages, chat_format, options.tools)
        template = template_source(self.model, chat_format)
        return tokens, options.completion_kwargs(kwargs, template)

    def _chat_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        chat_format: str | None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int] | Chunks:
        media: list[Media] = []
        if has_media(messages):
            messages, media = extract_media(messages, self.media_marker, self.media_policy)
        prompt = self.chat_prompt(messages, chat_format, tools)
        bos = self.vocab.bos
        # A template that writes BOS itself must not get a second one from the tokenizer.
        has_bos = bos is not None and prompt.startswith(self.vocab.token_to_piece(bos, True))
        if media:
            return self.tokenize_media(prompt, media, add_special=not has_bos, parse_special=True)
        return self.tokenize(prompt, add_special=not has_bos, parse_special=True)

    # -- images and sounds ---------------------------------------------------------------------

    @property
    def media_marker(self) -> str:
        """The text that stands for one image or sound in a multimodal prompt."""
        return self._projector().marker

    def tokenize_media(
        self,
        text: str,
        media: Sequence[Media],
        add_special: bool = True,
        parse_special: bool = False,
    ) -> Chunks:
        """A multimodal prompt: ``text`` with one ``media_marker`` per item of ``media``."""
        projector = self._projector()
        if len(media) > self.media_policy.max_media:
            raise MediaError(f"more than {self.media_policy.max_media} images/sounds at once")
        bitmaps = [projector.bitmap(item) for item in media]
        try:
            return projector.tokenize(text, bitmaps, add_special, parse_special)
        finally:
            for bitmap in bitmaps:
                bitmap.close()  # the chunks hold what they need

    def _projector(self) -> Projector:
        if self.projector is None:
            raise InvalidParameterError("this Llama has no projector: pass mmproj= for media")
        return self.projector

    # -- fill in the middle --------------------------------------------------------------------

    def create_infill(
        self,
        prefix: str,
        suffix: str,
        *,
        spm: bool = False,
        repo: str | None = None,
        files: Sequence[tuple[str, str]] = (),
        file_name: str | None = None,
        **kwargs: Any,
    ) -> Completion:
        """Complete the code between ``prefix`` and ``suffix`` with the model's FIM tokens.
        ``spm`` puts the suffix first; ``repo``, ``files`` and ``file_name`` add repository
        context. Other keywords are those of ``create_completion``."""
        tokens = infill_tokens(self.vocab, prefix, suffix, spm=spm, repo=repo, files=files,
                               file_name=file_name)  # fmt: skip
        return self.create_completion(tokens, **kwargs)

    def stream_infill(
        self,
        prefix: str,
        suffix: str,
        *,
        spm: bool = False,
        repo: str | None = None,
        files: Sequence[tuple[str, str]] = (),
        file_name: str | None = None,
        **kwargs: Any,
    ) -> Stream[CompletionChunk]:
        """``create_infill``, chunk by chunk (see ``stream_completion``)."""
        tokens = infill_tokens(self.vocab, prefix, suffix, spm=spm, repo=repo, files=files,
                               file_name=file_name)  # fmt: skip
        return self.stream_completion(tokens, **kwargs)

    # -- embeddings ----------------------------------------------------------------------------

    def embed(
        self,
        texts: str | Sequence[str],
        *,
        normalize: bool = True,
        truncate: bool = False,
        pooling: str | None = None,
        pack_tokens: int = DEFAULT_PACK_TOKENS,
    ) -> np.ndarray | list[np.ndarray]:
        """Embeddings of one text or many, as a float32 array of shape (n_texts, n_embd); for a
        context with ``pooling="none"`` (and no ``pooling`` here), token-level embeddings: one
        (n_tokens, n_embd) array per text, as ``embed_tokens`` returns.

        Needs ``Llama(..., embeddings=True)``. Pooling is the context's (the model's by default,
        or ``Llama(..., pooling=...)``), computed by llama.cpp. ``pooling="mean"|"cls"|"last"``
        here chooses per call, computed in numpy from token vectors: that needs a context with
        ``pooling="none"``. Texts longer than one decode raise ContextOverflowError unless
        ``truncate``.
        """
        native = self._embedder(pack_tokens).pooled
        if pooling is not None and native:
            raise InvalidParameterError(
                f"pooling={pooling!r} per call needs a Llama created with pooling='none'; "
                "this context already pools"
            )
        if pooling is None and not native:
            return self.embed_tokens(texts, normalize=normalize, truncate=truncate)
        vectors = self._embed(texts, truncate, pack_tokens)
        if pooling is not None:
            vectors = [pool_tokens(v, pooling) for v in vectors]
        array = np.stack(vectors) if vectors else np.empty((0, self.model.n_embd), np.float32)
        return normalized(array) if normalize else array

    def rerank(
        self, query: str, documents: Sequence[str], *, top_n: int | None = None,
        truncate: bool = False,
    ) -> list[RerankResult]:  # fmt: skip
        """Score each document against ``query`` with a reranker (a context with rank pooling),
        many pairs per decode; most relevant first, the best ``top_n`` if given."""
        if top_n is not None and top_n < 0:
            raise InvalidParameterError(f"top_n must be >= 0, not {top_n}")
        with self._lock:
            embedder = self._embedder(DEFAULT_PACK_TOKENS)
            if not embedder.ranks:
                raise InvalidParameterError('reranking needs a context with pooling="rank"')
            pairs = [
                embedder.fit(rerank_tokens(self.model, query, doc), i, truncate)
                for i, doc in enumerate(documents)
            ]
            self._kv.tokens.clear()
            scores = [float(s[0]) for s in embedder.run(pairs)]
        order = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n]
        return [RerankResult(i, scores[i], documents[i]) for i in order]

    def embed_tokens(
        self, texts: str | Sequence[str], *, normalize: bool = False, truncate: bool = False
    ) -> list[np.ndarray]:
        """Token-level embeddings (a context with ``pooling="none"``): (n_tokens, n_embd) each."""
        if self._embedder(DEFAULT_PACK_TOKENS).pooled:
            raise InvalidParameterError('token embeddings need a context with pooling="none"')
        vectors = self._embed(texts, truncate, DEFAULT_PACK_TOKENS)
        return [normalized(v) if normalize else v for v in vectors]

    def _embedder(self, pack_tokens: int) -> Embedder:
        embedder = self._embedder_cache
        if embedder is None or embedder.pack_tokens != min(pack_tokens, embedder.limit):
            embedder = self._embedder_cache = Embedder(self.context, pack_tokens)
        return embedder

    def _embed(
        self, texts: str | Sequence[str], truncate: bool, pack_tokens: int
    ) -> list[np.ndarray]:
        items = [texts] if isinstance(texts, str) else list(texts)
        with self._lock:
            embedder = self._embedder(pack_tokens)
            tokens = [embedder.fit(self.tokenize(t), i, truncate) for i, t in enumerate(items)]
            self._kv.tokens.clear()  # the memory is reused for embedding batches
            return embedder.run(tokens)

    # -- adapters ------------------------------------------------------------------------------

    def load_lora(self, path: str | os.PathLike[str], scale: float = 1.0) -> LoraAdapter:
        """Load a LoRA adapter for this model and apply it (alongside any others) at ``scale``."""
        adapter = LoraAdapter(self.model, path)
        self.set_lora_adapters({**self.context.lora_adapters, adapter: scale})
        return adapter

    def set_lora_adapters(self, adapters: Mapping[LoraAdapter, float]) -> None:
        """Apply exactly these adapters; the prompt cache is dropped (it used the old weights)."""
        with self._lock:
            self.context.set_lora_adapters(adapters)
        self._forget()

    # -- tokens --------------------------------------------------------------------------------

    @property
    def vocab(self) -> Vocab:
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
        if self.scheduler is not None:
            self.scheduler.cancel_all()
            return
        session = self._session() if self._session else None
        if session is not None:
            session.cancelled.set()
        self.context.cancel()

    def stream_completion(
        self,
        prompt: str | Sequence[int] | Chunks,
        *,
        media: Sequence[Media] = (),
        max_tokens: int | None = 16,
        min_tokens: int = 0,
        stop: str | Sequence[str] = (),
        echo: bool = False,
        suffix: str = "",
        logprobs: int | None = None,
        speculative: Speculative | None = None,
        timeout: float | None = None,
        cancel: threading.Event | None = None,
        sampling: SamplingOptions | None = None,
        **sampling_options: Any,
    ) -> Stream[CompletionChunk]:
        """Generate text chunk by chunk; the last chunk has ``finish_reason`` and ``usage``.

        ``media`` (Image / Audio, with a projector) fill the prompt's ``media_marker`` places in
        order; a prompt from ``tokenize_media`` works too.

        Breaking out of the loop stops generation; the Llama stays usable. ``max_tokens=None``
        runs until the end of the context. ``min_tokens`` forbids ending earlier. ``logprobs=N``
        reports each token's log-probability and its N most likely alternatives. ``suffix`` is
        appended after the generated text. ``speculative`` (PromptLookup or DraftModel, default
        the Llama's) drafts tokens that one batched decode verifies: the same sampling rule, but
        batched arithmetic may flip a near-tie. ``timeout`` (seconds, counted from the call)
        ends the generation with finish_reason "cancelled", and so does setting ``cancel`` (an
        event that may stop several calls, e.g. all the choices of ``create_completion``, from
        any thread; nothing needs the stream object). Other keywords are SamplingOptions
        fields (temperature, top_k, top_p, seed, grammar, logit_bias, ...).
        """
        tokens, text, media_chunks = self._prompt(prompt, media)
        if media_chunks is not None and (echo or speculative is not None):
            raise InvalidParameterError("echo and speculative decoding take text prompts only")
        request = Request(tokens, max_tokens, min_tokens, [stop] if isinstance(stop, str) else stop,
                          logprobs, media_chunks)  # fmt: skip
        request.check(self.context.n_ctx_seq)
        options = self._sampling(sampling, sampling_options)
        if speculative is not None and self.scheduler is not None:
            raise InvalidParameterError("speculative decoding needs a Llama with parallel=None")
        speculative = speculative if speculative is not None else self.speculative
        drafter = speculative.drafter(self.model) if speculative is not None else None
        session = Session(timeout, cancel)
        samplers = Samplers(self.model, options, request.min_tokens)
        if self.scheduler is None:
            steps = self._one_slot_steps(request, samplers, session, drafter)
            chunks = self._chunks(request, steps, session, text if echo else "", suffix, samplers)
        else:
            try:  # queued now: a full queue fails here, and slots start at once
                steps = self.scheduler.submit(request, samplers, session)
            except BaseException:
                samplers.close()
                raise
            # From here the engine owns the samplers (it frees them when the job ends).
            chunks = self._chunks(request, steps, session, text if echo else "", suffix, None)
        return Stream(chunks, session)

    def create_completion(
        self,
        prompt: str | Sequence[int] | Chunks,
        *,
        n: int = 1,
        best_of: int | None = None,
        **kwargs: Any,
    ) -> Completion:
        """Generate ``n`` completions of ``prompt`` (text or tokens) at once.

        ``best_of`` > n samples that many and keeps the n with the highest total
        log-probability. Other keywords are those of ``stream_completion``.
        """
        best_of = best_of or n
        if not 1 <= n <= best_of:
            raise InvalidParameterError(f"need 1 <= n ({n}) <= best_of ({best_of})")
        seed = kwargs.pop("seed", None)
        want_logprobs = kwargs.get("logprobs")
        if best_of > n and want_logprobs is None:
            kwargs["logprobs"] = 0  # needed to rank the candidates
        seeds = [None if seed is None else (seed + i) % 2**32 for i in range(best_of)]
        if self.scheduler is None:
            # One slot: whole completions at once; concurrent callers wait their turn.
            with self._lock:
                streams = [list(self.stream_completion(prompt, seed=s, **kwargs)) for s in seeds]
        else:
            # Parallel slots: every candidate is queued first, so they generate side by side.
            pending: list[Stream[CompletionChunk]] = []
            try:
                for s in seeds:
                    pending.append(self.stream_completion(prompt, seed=s, **kwargs))
                streams = [list(stream) for stream in pending]
            finally:
                for stream in pending:
                    stream.cancel()  # a failure part-way must not leave candidates running
        candidates = [
            _choice(i, chunks, want_logprobs is not None) for i, chunks in enumerate(streams)
        ]
        if best_of > n:
            candidates.sort(key=lambda c: -sum(c[1]))
        kept = candidates[:n]
        choices = tuple(dataclasses.replace(c, index=i) for i, (c, _, _) in enumerate(kept))
        first = candidates[0][2]
        completion_tokens = sum(u.completion_tokens for _, _, u in candidates)
        usage = Usage(first.prompt_tokens, completion_tokens, first.cached_tokens)
        return Completion(f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.model.path.name,
                          choices, usage)  # fmt: skip

    async def astream_completion(
        self, prompt: str | Sequence[int] | Chunks, **kwargs: Any
    ) -> AsyncIterator[CompletionChunk]:
        """``stream_completion`` for asyncio: a worker thread drives the stream."""
        stream = self.stream_completion(prompt, **kwargs)
        async for chunk in stream:
            yield chunk

    # -- internals -----------------------------------------------------------------------------

    def _prompt(
        self, prompt: str | Sequence[int] | Chunks, media: Sequence[Media]
    ) -> tuple[list[int], str, Chunks | None]:
        """Prompt tokens (MEDIA_TOKEN where media sit), its text, and the multimodal chunks."""
        if media:
            if not isinstance(prompt, str):
                raise InvalidParameterError("media= needs a text prompt with media markers")
            prompt = self.tokenize_media(prompt, media)
        if isinstance(prompt, Chunks):
            return [MEDIA_TOKEN] * prompt.n_pos, "", prompt
        tokens, text = self._text_prompt(prompt)
        return tokens, text, None

    def _text_prompt(self, prompt: str | Sequence[int]) -> tuple[list[int], str]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidParameterError("the prompt is empty")
            return self.tokenize(prompt), prompt
        tokens = self.model.vocab.check_tokens(prompt).tolist()
        return tokens, self.detokenize(tokens)

    def _sampling(
        self, sampling: SamplingOptions | None, options: dict[str, Any]
    ) -> SamplingOptions:
        unknown = set(options) - _SAMPLING_FIELDS
        if unknown:
            raise InvalidParameterError(f"unknown sampling options: {sorted(unknown)}")
        base = sampling or SamplingOptions(seed=self.seed)
        return dataclasses.replace(base, **options) if options else base

    def _one_slot_steps(
        self, request: Request, samplers: Samplers, session: Session, drafter: Drafter | None
    ) -> Iterator[Step]:
        """The generation on this Llama's one slot; it starts (superseding the stream before
        it) when the first chunk is asked for."""
        with self._lock:
            previous = self._session() if self._session else None
            if previous is not None:
                previous.superseded = True
            self._session = weakref.ref(session)
        self.speculative_stats = stats = SpeculativeStats()
        yield from generate(self._kv, samplers, request, session, self._lock, drafter, stats)

    def _chunks(
        self,
        request: Request,
        steps: Iterator[Step],
        session: Session,
        echo_text: str,
        suffix: str,
        samplers: Samplers | None,
    ) -> Generator[CompletionChunk, None, None]:
        """Steps as completion chunks; ``samplers`` (if the engine does not own them) are
        freed at the end."""
        chunk_id, created, name = f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.model.path.name
        produced, offset = 0, len(echo_text)
        try:
            if echo_text:
                yield CompletionChunk(chunk_id, created, name, 0, echo_text)
            for step in steps:
                produced += step.token is not None
                text = step.text
                if step.finish_reason not in (None, "cancelled"):
                    text += suffix
                usage = None
                if step.finish_reason:
                    usage = Usage(len(request.prompt), produced, session.reused)
                tokens = () if step.token is None else (step.token,)
                logprobs = _step_logprobs(self.model.vocab, step, offset)
                offset += len(text)
                yield CompletionChunk(chunk_id, created, name, 0, text, step.finish_reason,
                                      usage, tokens, logprobs)  # fmt: skip
        finally:
            session.cancel()  # a consumer that left early stops the generation at once
            if samplers is not None:
                samplers.close()


def _with_slots(
    params: ContextParams | None, parallel: int | None, max_queue: int, speculative: object
) -> ContextParams | None:
    """Context parameters with room for ``parallel`` sequences."""
    if parallel is None:
        return params
    if parallel < 1 or max_queue < 0:
        raise InvalidParameterError(f"need parallel >= 1 ({parallel}) and max_queue >= 0")
    if speculative is not None:
        raise InvalidParameterError("speculative decoding needs a Llama with parallel=None")
    params = params or ContextParams()
    if params.embeddings:
        raise InvalidParameterError("parallel slots are for generation, not embeddings contexts")
    if params.n_seq_max not in (1, parallel):
        raise InvalidParameterError(f"n_seq_max {params.n_seq_max} != parallel {parallel}")
    return dataclasses.replace(params, n_seq_max=parallel)


def _step_logprobs(vocab: Vocab, step: Step, offset: int) -> Logprobs | None:
    if step.logprob is None or step.token is None:
        return None
    return Logprobs(
        (vocab.token_to_piece(step.token, special=True),),
        (step.logprob,),
        (step.top_logprobs or {},),
        (offset,),
    )


def _choice(
    index: int, chunks: list[CompletionChunk], keep_logprobs: bool
) -> tuple[CompletionChoice, tuple[float, ...], Usage]:
    """Fold a finished stream into a choice, its token log-probabilities, and its usage."""
    last = chunks[-1]
    assert last.finish_reason is not None and last.usage is not None
    parts = [c.logprobs for c in chunks if c.logprobs is not None]
    logprobs = Logprobs.join(parts) if parts else None
    choice = CompletionChoice(
        index,
        "".join(c.text for c in chunks),
        last.finish_reason,
        tuple(t for c in chunks for t in c.tokens),
        logprobs if keep_logprobs else None,
    )
    return choice, logprobs.token_logprobs if logprobs else (), last.usage
