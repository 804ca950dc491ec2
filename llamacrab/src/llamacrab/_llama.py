"""Llama: the facade. A model plus one context, with thin methods over the layers below:
requests are built in ``_features`` and run by ``_engine``."""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import numpy as np

from llamacrab._chat.caps import TemplateCaps
from llamacrab._chat.media_parts import MediaPolicy
from llamacrab._chat.options import ChatOptions
from llamacrab._chat.prompt import (
    answer_prompt,
    assistant_prefill,
    template_in_use,
    template_kwargs,
)
from llamacrab._engine.cache import PromptCache
from llamacrab._engine.generation import Request, Session
from llamacrab._engine.scheduler import Scheduler
from llamacrab._engine.speculative import DraftModel, Speculative, SpeculativeStats
from llamacrab._engine.stream import Stream
from llamacrab._exceptions import InvalidParameterError
from llamacrab._features.chat import chat_completion, chat_request
from llamacrab._features.checkpoint_hints import last_sentence_start
from llamacrab._features.completion import (
    Completer,
    check_generates,
    check_speculation,
    completion_prompt,
)
from llamacrab._features.embeddings import DEFAULT_PACK_TOKENS, Embeddings
from llamacrab._features.hub import HubOptions, ResolvedModel
from llamacrab._features.hub import resolve as resolve_model
from llamacrab._features.infill import InfillLimits, infill_tokens
from llamacrab._features.llama_options import ExtraOptions, take_extra_options
from llamacrab._features.media import MediaInput
from llamacrab._features.params import merge_sampling, split_params, with_slots
from llamacrab._features.presets import with_preset
from llamacrab._field_types import UINT32_MAX, check_range, checked
from llamacrab._native.adapter import LoraAdapter
from llamacrab._native.context import Context, ContextParams
from llamacrab._native.control_vector import ControlVector, ControlVectorSource
from llamacrab._native.media import Media
from llamacrab._native.model import Model, ModelParams
from llamacrab._native.mtmd import Chunks, Projector
from llamacrab._native.sampler import SamplingOptions
from llamacrab._native.state import SavedState
from llamacrab._native.vocab import Vocab
from llamacrab._types import (
    ChatCompletion,
    ChatCompletionChunk,
    Classification,
    Completion,
    CompletionChunk,
    RerankResult,
    SlotInfo,
)


class Llama:
    """A loaded model with one context.

    ``Llama(path, n_ctx=2048, n_threads=4, ...)`` takes any ModelParams / ContextParams field as
    a keyword. ``cache`` (a RamCache or DiskCache) keeps prompt states across calls.
    ``preset`` ("low-ram", "balanced", "max-gpu"; see ``PRESETS``) supplies defaults for
    those keywords; the keywords given override it.
    Files and sizes are keywords too (ExtraOptions): ``lora`` (adapter files or (file, scale)
    pairs, loaded into ``adapters`` and applied), ``control_vectors`` and
    ``control_vector_layers``, ``draft_model`` / ``draft_max`` / ``draft_n_gpu_layers`` or
    ``prompt_lookup`` (speculative decoding), ``prompt_cache`` ("ram" or a directory) and
    ``prompt_cache_bytes``.
    ``path`` may be a Hugging Face repository id (``org/repo``, when no such local
    path exists): HubOptions fields (filename, revision, token, cache_dir, endpoint, offline,
    mmproj) choose what is fetched.

    ``mmproj`` (a projector file; for a Hub model, True fetches the repository's projector)
    makes it multimodal: images and sounds go into
    completions (``media=``, one ``media_marker`` per item in the prompt) and chat messages
    (``image_url`` / ``input_audio`` parts, from where ``media_policy`` allows). The projector
    is loaded in a child process first and refused if that dies (a file whose tensors disagree
    with its description makes libmtmd abort); ``mmproj_probe=False`` skips that second load.

    Calls are serialized: a completion started from another thread waits for the one running,
    and a new call supersedes an unfinished stream (which then ends "cancelled").

    ``parallel=N`` runs generations on N slots instead, as a server does: the slots share the
    context (each gets ``n_ctx / N`` tokens), an engine thread decodes all of them together
    (continuous batching), up to ``max_queue`` more wait for a slot (then QueueFullError), and
    nothing supersedes anything. Completions from several threads or asyncio tasks proceed
    side by side. ``slots()`` describes them; ``save_state``, ``load_state`` and ``reset``
    take ``slot=i``. Speculative decoding needs ``parallel=None``.
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
        mmproj: str | os.PathLike[str] | bool | None = None,
        mmproj_probe: bool = True,
        media_policy: MediaPolicy | None = None,
        preset: str | None = None,
        **options: Any,
    ) -> None:
        if preset is not None:
            if model_params or context_params:
                raise InvalidParameterError("preset= combines with keyword options, not with "
                                            "ModelParams / ContextParams objects")  # fmt: skip
            options = with_preset(preset, options)
        if mmproj is True:  # the Hub repository's projector: a fetch option
            options["mmproj"] = True
        if isinstance(mmproj, bool):
            mmproj = None
        extra = take_extra_options(options)  # files and sizes: adapters, draft model, cache
        if extra.speculative and speculative is not None:
            raise InvalidParameterError("pass speculative= or draft_model/prompt_lookup, not both")
        speculative = speculative if speculative is not None else extra.lookup()
        cache = cache if cache is not None else extra.cache()
        if options and (model_params or context_params or hub):
            raise InvalidParameterError("pass parameter objects or keywords, not both")
        if options:
            model_params, context_params, hub = split_params(options)
        drafting = speculative if speculative is not None else extra.draft_model
        context_params = with_slots(context_params, parallel, max_queue, drafting)
        self.files: ResolvedModel = resolve_model(model_path, hub)
        self.model = Model.load(self.files.path, model_params, progress)
        try:
            self.context = Context(self.model, context_params)
            projector = mmproj or self.files.mmproj
            self.projector: Projector | None = None
            if projector is not None:
                self.projector = Projector(self.model, projector, self.context.params.n_threads,
                                           probe=mmproj_probe)  # fmt: skip
            self.adapters: list[LoraAdapter] = []  # loaded through this Llama: ids, in order
            self._draft: Llama | None = None  # a draft model this Llama opened (and closes)
            speculative = self._apply_extra_options(extra, speculative)
            if speculative is not None:
                check_speculation(self.model)
            self._completer = Completer(self.context, cache, parallel, max_queue)
        except BaseException:
            if getattr(self, "_draft", None) is not None:
                self._draft.close()  # type: ignore[union-attr]
            self.model.close()
            raise
        self._media = MediaInput(self.projector, media_policy or MediaPolicy(),
                                 self.context.n_ctx_seq)  # fmt: skip
        self.seed = seed
        self.speculative = speculative  # the default for completions
        self.chat_format = chat_format  # None: the model's own template
        self._embeddings = Embeddings(self._completer.kv, self._completer.lock)

    def _apply_extra_options(
        self, extra: ExtraOptions, speculative: Speculative | None
    ) -> Speculative | None:
        scales = {}
        for path, scale in extra.scaled_lora():
            adapter = LoraAdapter(self.model, path)  # closed with the model if anything fails
            self.adapters.append(adapter)
            scales[adapter] = scale
        if scales:
            self.context.set_lora_adapters(scales)
        vector = extra.control_vector()
        if vector is not None:
            self.context.set_control_vector(vector, extra.control_vector_layers)
        if extra.draft_model is None:
            return speculative
        params = self.context.params
        draft_options: dict[str, Any] = {"n_ctx": self.context.n_ctx_seq,
                                         "n_threads": params.n_threads,
                         "n_gpu_layers": extra.draft_n_gpu_layers}  # fmt: skip
        self._draft = Llama(extra.draft_model, **{k: v for k, v in draft_options.items()
                                                  if v is not None})  # fmt: skip
        return DraftModel(llama=self._draft, max_draft=extra.draft_max or 8)

    @classmethod
    def load(cls, model_path: str | os.PathLike[str], **kwargs: Any) -> Llama:
        return cls(model_path, **kwargs)

    @property
    def seed(self) -> int | None:
        """The seed of completions that pass none (None: a fresh random one each time)."""
        return self._seed

    @seed.setter
    def seed(self, seed: int | None) -> None:
        # Checked here: a bad value kept would refuse every later completion instead.
        check_range("seed", seed, 0, UINT32_MAX)
        self._seed = seed

    @property
    def scheduler(self) -> Scheduler | None:
        """The engine of ``parallel`` slots (None for one slot)."""
        return self._completer.scheduler

    @property
    def busy(self) -> bool:
        """Whether a generation is under way (an unfinished stream too) or waiting for a
        slot: what a ``ModelRegistry`` never unloads without force."""
        return self._completer.busy

    @property
    def speculative_stats(self) -> SpeculativeStats:
        """Drafted and accepted tokens of the last one-slot completion."""
        return self._completer.speculative_stats

    @property
    def supersede(self) -> bool:
        """``parallel=None``: whether a new call supersedes an unfinished stream (True, the
        default) or waits until it ends (False: what a server of one slot wants)."""
        return self._completer.supersede

    @supersede.setter
    def supersede(self, value: bool) -> None:
        self._completer.supersede = value

    @property
    def cache(self) -> PromptCache | None:
        """The prompt cache (``cache=`` or ``prompt_cache=``); assigning a RamCache, DiskCache
        or None changes where the next prompts are looked up and stored."""
        return self._completer.cache

    @cache.setter
    def cache(self, cache: PromptCache | None) -> None:
        if cache is not None and not isinstance(cache, PromptCache):
            raise InvalidParameterError(
                f"cache must be a RamCache, DiskCache or None, not {type(cache).__name__}"
            )
        self._completer.cache = cache

    @property
    def media_policy(self) -> MediaPolicy:
        return self._media.policy

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the context and the model (and a draft model it opened). Idempotent. From
        inside its own generation (a custom sampler) it raises ConcurrentUseError."""
        self.model.check_closable()  # before the engine stops: a refusal changes nothing
        self._completer.close()
        self.model.close()
        if self._draft is not None:
            self._draft.close()

    @property
    def closed(self) -> bool:
        return self.model.closed

    def __enter__(self) -> Llama:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- slots and their state -----------------------------------------------------------------

    def slots(self) -> list[SlotInfo]:
        """Each generation slot: its id, whether it generates now (``busy``), the tokens its
        memory holds and may hold. ``parallel=None`` has one slot, busy while a stream is
        unfinished."""
        return self._completer.slots()

    @checked
    def held_tokens(self, *, slot: int = 0) -> list[int]:
        """A copy of the tokens slot ``slot``'s memory holds: the last prompt and its answer
        but the last token sampled (decoded only if the answer goes on), what a next prompt
        sharing them reuses. Read without waiting: while the slot generates, a snapshot
        taken mid-step (a new prompt may show only the prefix it reuses)."""
        return self._completer.held_tokens(slot)

    @checked
    def evaluate(
        self,
        tokens: Sequence[int],
        *,
        all_logits: bool = False,
        after: int | None = None,
        slot: int | None = None,
    ) -> np.ndarray:
        """Decode ``tokens`` after the tokens the memory holds (``held_tokens()``), as a
        prompt that continues them, and return their raw logits: the last token's (shape
        ``(n_vocab,)``), or with ``all_logits`` each token's (``(len(tokens), n_vocab)``; row
        i rates the token after ``tokens[i]``). llama-cpp-python's ``eval`` and ``scores``,
        for scoring and perplexity: a completion whose prompt starts with the held tokens
        reuses them, and ``reset()`` starts over (so does a change of adapters, which empties
        ``held_tokens()``). ``after=k`` continues after the first k held tokens instead,
        dropping the rest (a rewind). On one slot (``parallel=None``) it waits for or
        supersedes an unfinished stream as a completion does, and ``cancel()`` stops it
        (DecodeAbortedError); on parallel slots ``slot=i`` evaluates on slot i while it is idle
        (ConcurrentUseError while it generates), the other slots waiting meanwhile. Past the
        context (a slot's share of it): ContextOverflowError."""
        return self._completer.evaluate(tokens, all_logits, after, slot)

    @checked
    def save_state(self, scope: str = "sequence", *, slot: int | None = None) -> SavedState:
        """The KV memory and the tokens it holds (``SavedState.save`` writes it to a file);
        ``scope="context"`` saves the whole context (every sequence, last outputs; one slot
        only).

        ``slot=i`` saves slot i (see ``slots()``) while other slots generate; a slot that is
        generating raises ConcurrentUseError, checked while the engine waits between steps,
        so a slot is never read mid-decode. Without ``slot`` (``parallel=None`` only), the
        memory is saved between two steps of any stream."""
        if slot is not None:
            return self._completer.save(slot, scope)
        with self._completer.lock:
            return self._completer.one_slot("save_state").snapshot(scope)

    @checked
    def load_state(self, state: SavedState, *, slot: int | None = None) -> None:
        """Restore a state saved from this model; the next prompt sharing its tokens reuses it
        (with parallel slots, one goes to the slot holding the longest shared prefix) if it
        is computed with the LoRA adapters and scales, control vector and KV settings the
        state was (``SavedState.kv_fingerprint``). A state from another model, too long for
        the slot, a corrupt blob, or one that records no fingerprint raises StateError.
        ``slot=i`` loads into slot i, as ``save_state`` saves it: ConcurrentUseError while it
        generates. A state saved from any slot loads into any slot; between a one-slot Llama
        and parallel slots only with ``kv_unified=True`` (one KV stream for all slots, as a
        one-slot Llama has), else StateError."""
        if slot is not None:
            self._completer.load(slot, state)
            return
        with self._completer.lock:
            self._completer.one_slot("load_state").restore(state)

    @checked
    def reset(self, *, slot: int | None = None) -> int:
        """Forget the cached prompt: the next call decodes its whole prompt again. ``slot=i``
        forgets slot i's alone (ConcurrentUseError while it generates); without it, every
        slot's (StateError while parallel slots generate). Returns how many tokens were
        forgotten."""
        if slot is not None:
            return self._completer.erase(slot)
        held = sum(info.n_tokens for info in self._completer.slots())
        self._completer.forget()
        return held

    # -- chat ----------------------------------------------------------------------------------

    @checked
    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        chat_format: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        *,
        prefill_assistant: bool = True,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text a chat completion would send for ``messages`` (and ``tools``, and
        ``chat_template_kwargs``): a last assistant message is continued, as there.
        ``add_generation_prompt=False`` leaves out the opening of the answer's turn (not for a
        continued message, which is in that turn)."""
        prefill = assistant_prefill(messages) if prefill_assistant else None
        return answer_prompt(self.model, messages, chat_format or self.chat_format, prefill,
                             tools, template_kwargs(chat_template_kwargs),
                             add_generation_prompt)  # fmt: skip

    @checked
    def chat_template_in_use(self) -> tuple[str, TemplateCaps] | None:
        """The template chat completions render with, and what it can present: its Jinja
        source, or a built-in format's name. None where the model has none to chat with."""
        return template_in_use(self.model, self.chat_format)

    @checked
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
        chat_template_kwargs: Mapping[str, Any] | None = None,
        prefill_assistant: bool = True,
        add_generation_prompt: bool = True,
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
        jsonschema package). A template that cannot present tools gets them the way llama.cpp's
        generic format does: a system message describing them, and a grammar for a JSON
        ``tool_call`` (or, with "auto", a ``response``), parsed back into ``tool_calls``.
        Tools are never executed. ``chat_template_kwargs`` are more variables for a Jinja
        template (llama-server's: ``{"enable_thinking": False}`` for Qwen 3, ...).

        A last assistant message after other turns is continued, as llama-server does (an
        assistant "prefill"): the prompt is the turns before it with the generation prompt,
        then its text, and the answer is what follows that text. It may hold text only, and
        cannot be combined with a response_format, a forced tool_choice or tools the template
        cannot present (InvalidParameterError); one of tool calls is a finished turn.
        ``prefill_assistant=False`` closes that turn and opens a new one instead
        (llama-server's ``--no-prefill-assistant``). ``add_generation_prompt=False`` (the
        Jinja variable, llama-server's body field) leaves out the opening of the answer's turn,
        as ``chat_prompt`` renders it: the answer is what the model writes after the last
        closed turn (a continued message is in the answer's turn, so it is continued all the
        same)."""
        options = ChatOptions(tools, tool_choice, response_format, check_tool_arguments,
                              chat_template_kwargs, prefill_assistant,
                              add_generation_prompt)  # fmt: skip
        tokens, kwargs = self._chat_request(messages, chat_format, options, kwargs)
        return chat_completion(self.create_completion(tokens, max_tokens=max_tokens, **kwargs),
                               options)  # fmt: skip

    @checked
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
        chat_template_kwargs: Mapping[str, Any] | None = None,
        prefill_assistant: bool = True,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> Stream[ChatCompletionChunk]:
        """``create_chat_completion`` as a stream of deltas (the first carries the role).
        With ``tools``, text from a tool-call opener on is held back; the last delta carries
        the parsed ``tool_calls`` (finish_reason "tool_calls"), or the text if none parsed.
        A continued assistant message (a prefill) is not repeated: the deltas follow it."""
        options = ChatOptions(tools, tool_choice, response_format, check_tool_arguments,
                              chat_template_kwargs, prefill_assistant,
                              add_generation_prompt)  # fmt: skip
        tokens, kwargs = self._chat_request(messages, chat_format, options, kwargs)
        stream = self.stream_completion(tokens, max_tokens=max_tokens, **kwargs)
        return stream.then(options.chunks)

    @checked
    def count_chat_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        chat_format: str | None = None,
        response_format: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] = "auto",
        chat_template_kwargs: Mapping[str, Any] | None = None,
        prefill_assistant: bool = True,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> int:
        """How many prompt tokens ``create_chat_completion`` with the same arguments would
        decode (its ``usage.prompt_tokens``; an image or a sound counts the positions it
        takes), found without generating. The messages, tools, tool_choice and response_format
        are checked as it checks them, and ``prefill_assistant`` and ``add_generation_prompt``
        shape the prompt as there; keywords that shape only the answer (max_tokens, sampling)
        are taken and change nothing."""
        options = ChatOptions(tools, tool_choice, response_format, False, chat_template_kwargs,
                              prefill_assistant, add_generation_prompt)  # fmt: skip
        tokens, _ = self._chat_request(messages, chat_format, options, kwargs)
        return len(tokens) if isinstance(tokens, list) else tokens.n_pos

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
        chat_format = chat_format or self.chat_format
        return chat_request(self.model, self._media, messages, chat_format, options, kwargs)

    # -- images and sounds ---------------------------------------------------------------------

    @property
    def media_marker(self) -> str:
        """The text that stands for one image or sound in a multimodal prompt."""
        return self._media.projector.marker

    @checked
    def tokenize_media(
        self,
        text: str,
        media: Sequence[Media | bytes],
        add_special: bool = True,
        parse_special: bool = False,
    ) -> Chunks:
        """A multimodal prompt: ``text`` with one ``media_marker`` per item of ``media``
        (Image, Audio, or an encoded file's bytes: the image or sound its signature says).
        Sounds that cannot fit the context raise ContextOverflowError before libmtmd computes
        their spectrograms."""
        return self._media.tokenize(text, media, add_special, parse_special)

    # -- fill in the middle --------------------------------------------------------------------

    @checked
    def infill_prompt(
        self,
        prefix: str,
        suffix: str,
        *,
        spm: bool = False,
        repo: str | None = None,
        files: Sequence[tuple[str, str]] = (),
        file_name: str | None = None,
        limits: InfillLimits | None = None,
    ) -> list[int]:
        """The tokens ``create_infill`` decodes for these arguments (the model's FIM layout)."""
        check_generates(self.model)  # before its FIM tokens are looked for
        return infill_tokens(self.vocab, prefix, suffix, spm=spm, repo=repo, files=files,
                             file_name=file_name, limits=limits or InfillLimits())  # fmt: skip

    @checked
    def create_infill(
        self,
        prefix: str,
        suffix: str,
        *,
        spm: bool = False,
        repo: str | None = None,
        files: Sequence[tuple[str, str]] = (),
        file_name: str | None = None,
        limits: InfillLimits | None = None,
        **kwargs: Any,
    ) -> Completion:
        """Complete the code between ``prefix`` and ``suffix`` with the model's FIM tokens.
        ``spm`` puts the suffix first; ``repo``, ``files`` and ``file_name`` add repository
        context; ``limits`` cuts the parts to fit (``InfillLimits.llama_server(...)`` as
        llama-server does). Other keywords are those of ``create_completion``."""
        tokens = self.infill_prompt(prefix, suffix, spm=spm, repo=repo, files=files,
                                    file_name=file_name, limits=limits)  # fmt: skip
        return self.create_completion(tokens, **kwargs)

    @checked
    def stream_infill(
        self,
        prefix: str,
        suffix: str,
        *,
        spm: bool = False,
        repo: str | None = None,
        files: Sequence[tuple[str, str]] = (),
        file_name: str | None = None,
        limits: InfillLimits | None = None,
        **kwargs: Any,
    ) -> Stream[CompletionChunk]:
        """``create_infill``, chunk by chunk (see ``stream_completion``)."""
        tokens = self.infill_prompt(prefix, suffix, spm=spm, repo=repo, files=files,
                                    file_name=file_name, limits=limits)  # fmt: skip
        return self.stream_completion(tokens, **kwargs)

    # -- embeddings ----------------------------------------------------------------------------

    @checked
    def embed(
        self,
        texts: str | Sequence[str | Sequence[int]],
        *,
        normalize: bool = True,
        truncate: bool = False,
        pooling: str | None = None,
        pack_tokens: int = DEFAULT_PACK_TOKENS,
    ) -> np.ndarray | list[np.ndarray]:
        """Embeddings of one text or many (each may be token ids), as a float32 array of shape
        (n_texts, n_embd); for a context with ``pooling="none"`` (and no ``pooling`` here),
        token-level embeddings: one (n_tokens, n_embd) array per text, as ``embed_tokens``
        returns.

        Needs ``Llama(..., embeddings=True)``. Pooling is the context's (the model's by default,
        or ``Llama(..., pooling=...)``), computed by llama.cpp. ``pooling="mean"|"cls"|"last"``
        here chooses per call, computed in numpy from token vectors: that needs a context with
        ``pooling="none"``. Texts longer than one decode raise ContextOverflowError unless
        ``truncate``.
        """
        return self._embeddings.embed(texts, normalize, truncate, pooling, pack_tokens)

    @checked
    def rerank(
        self, query: str, documents: Sequence[str], *, top_n: int | None = None,
        truncate: bool = False,
    ) -> list[RerankResult]:  # fmt: skip
        """Score each document against ``query`` with a reranker (a context with rank pooling),
        many pairs per decode; most relevant first, the best ``top_n`` if given."""
        return self._embeddings.rerank(query, documents, top_n, truncate)

    @checked
    def classify(
        self, texts: str | Sequence[str | tuple[str, str]], *, truncate: bool = False
    ) -> list[Classification]:
        """Classify each text (or pair of texts, laid out as a reranker's query and document)
        with a sequence classifier: a context with rank pooling, as ``rerank`` needs. Each
        result lists the model's labels, most likely first, with the head's outputs and their
        probabilities; in the order of ``texts``."""
        return self._embeddings.classify(texts, truncate)

    @checked
    def embed_tokens(
        self,
        texts: str | Sequence[str | Sequence[int]],
        *,
        normalize: bool = False,
        truncate: bool = False,
    ) -> list[np.ndarray]:
        """Token-level embeddings (a context with ``pooling="none"``): (n_tokens, n_embd) each."""
        return self._embeddings.embed_tokens(texts, normalize, truncate)

    # -- adapters ------------------------------------------------------------------------------

    @checked
    def load_lora(self, path: str | os.PathLike[str], scale: float = 1.0) -> LoraAdapter:
        """Load a LoRA adapter for this model and apply it (alongside any others) at ``scale``."""
        adapter = LoraAdapter(self.model, path)
        try:
            self.set_lora_adapters({**self.context.lora_adapters, adapter: scale})
        except BaseException:
            adapter.close()  # refused (slots busy): not left loaded and unused
            raise
        self.adapters.append(adapter)
        return adapter

    @property
    def lora_adapters(self) -> dict[LoraAdapter, float]:
        """The default adapters and their scales: what a completion without ``lora=`` uses."""
        return self.context.lora_adapters

    @checked
    def set_control_vector(
        self,
        vector: ControlVector | Sequence[ControlVectorSource] | None,
        layers: tuple[int, int] | None = None,
    ) -> None:
        """Steer generations with control vectors: a ControlVector, or GGUF control-vector
        files (paths or (path, strength) pairs, summed), added to the hidden state of
        ``layers`` (first and last, inclusive; default every layer). None removes it. A
        vector for another model (width, layers, architecture) or a range outside the model
        raises InvalidParameterError; KV computed before is never reused. Refused
        (ConcurrentUseError) while parallel slots generate."""
        if vector is not None and not isinstance(vector, ControlVector):
            vector = ControlVector.load(vector)
        with self._completer.lock:
            self.context.set_control_vector(vector, layers)
            if self.scheduler is None:
                self._completer.forget()

    @checked
    def set_lora_adapters(self, adapters: Mapping[LoraAdapter, float]) -> None:
        """Apply exactly these adapters; KV computed with the old weights is never reused.
        Refused (ConcurrentUseError) while parallel slots generate."""
        with self._completer.lock:
            self.context.set_lora_adapters(adapters)
            if self.scheduler is None:
                self._completer.forget()  # a running one-slot stream's prefix used old weights

    # -- tokens --------------------------------------------------------------------------------

    @property
    def vocab(self) -> Vocab:
        return self.model.vocab

    @checked
    def tokenize(
        self, text: str | bytes, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        """Tokens of ``text``; bytes are tokenized as they are, UTF-8 or not (as
        llama-cpp-python's ``tokenize`` takes them)."""
        return self.model.vocab.tokenize(text, add_special, parse_special)

    @checked
    def detokenize(self, tokens: Sequence[int], special: bool = False) -> str:
        return self.model.vocab.detokenize(tokens, special)

    # -- completion ----------------------------------------------------------------------------

    def cancel(self) -> None:
        """Stop the running generation (from any thread); it ends with finish_reason "cancelled"."""
        self._completer.cancel()

    @checked
    def stream_completion(
        self,
        prompt: str | Sequence[int] | Chunks,
        *,
        media: Sequence[Media] = (),
        max_tokens: int | None = 16,
        min_tokens: int = 0,
        stop: str | Sequence[str] = (),
        min_indent: int = 0,
        stop_at_newline_after: float | None = None,
        echo: bool = False,
        suffix: str = "",
        logprobs: int | None = None,
        speculative: Speculative | None = None,
        timeout: float | None = None,
        cancel: threading.Event | None = None,
        sampling: SamplingOptions | None = None,
        lora: Mapping[LoraAdapter, float] | None = None,
        checkpoint_at: Sequence[int] = (),
        **sampling_options: Any,
    ) -> Stream[CompletionChunk]:
        """Generate text chunk by chunk; the last chunk has ``finish_reason`` and ``usage``,
        and each chunk of generated text ``usage_so_far`` (the tokens and times up to it).

        ``media`` (Image / Audio, with a projector) fill the prompt's ``media_marker`` places in
        order; a prompt from ``tokenize_media`` works too.

        Breaking out of the loop stops generation; the Llama stays usable. ``max_tokens=None``
        runs until the end of the context. ``min_tokens`` forbids ending earlier. Two rules for
        code completion (llama-server's ``n_indent`` and ``t_max_predict_ms``) end it with
        finish_reason "length": ``min_indent`` at the first line after a newline that opens with
        fewer spaces and tabs (its text cut after them; a blank line counts, the first line does
        not), and ``stop_at_newline_after`` (seconds from the first token) at the first token
        bringing a newline once that time has passed. ``logprobs=N``
        reports each token's log-probability and its N most likely alternatives; with ``echo``
        the echoed prompt's too, from its second token on (its whole prompt is decoded again,
        no cached prefix; one slot only). ``suffix`` is
        appended after the generated text. ``speculative`` (PromptLookup or DraftModel, default
        the Llama's) drafts tokens that one batched decode verifies: the same sampling rule, but
        batched arithmetic may flip a near-tie. ``timeout`` (seconds, counted from the call)
        ends the generation with finish_reason "cancelled", and so does setting ``cancel`` (an
        event that may stop several calls, e.g. all the choices of ``create_completion``, from
        any thread; nothing needs the stream object). ``lora`` ({adapter: scale}, adapters of
        this model) replaces the default adapters for this call alone; parallel slots run
        calls with different sets side by side, one set per decode, taking turns.
        ``checkpoint_at`` (positions among the prompt's tokens) asks a sliding-window or
        recurrent model for checkpoints there too, besides 4 and 4 + n_ubatch tokens before
        the prompt's end and (for a text prompt) where its last sentence or line starts: a
        later prompt that leaves this one at such a point (a new question after a shared
        document) resumes there from the memory or a prompt cache; the chat methods pass
        where the last message's content starts. Other keywords are SamplingOptions fields
        (temperature, top_k, top_p, seed, grammar, logit_bias, ...); ``penalize_prompt=True``
        has the penalties and DRY count the prompt's tokens too, as llama-server does (by
        default they count the generated tokens alone, as llama-cpp-python's).
        """
        parts = completion_prompt(self.vocab, self._media, prompt, media)
        checkpoint_at = tuple(checkpoint_at)
        if isinstance(prompt, str) and not media and self.model.needs_checkpoints:
            sentence = last_sentence_start(self.vocab, prompt, parts.tokens)
            checkpoint_at += () if sentence is None else (sentence,)
        stops = [stop] if isinstance(stop, str) else stop
        if lora is not None:
            self.context.check_lora(lora)
        request = Request(parts.tokens, max_tokens, min_tokens, stops, logprobs, parts.chunks,
                          None if lora is None else dict(lora),
                          prompt_logprobs=echo and logprobs is not None,
                          checkpoint_at=checkpoint_at, min_indent=min_indent,
                          stop_at_newline_after=stop_at_newline_after)  # fmt: skip
        options = merge_sampling(sampling, sampling_options, self.seed)
        return self._completer.stream(parts, request, options, Session(timeout, cancel),
                                      (speculative, self.speculative), echo, suffix)  # fmt: skip

    @checked
    def create_completion(
        self,
        prompt: str | Sequence[int] | Chunks,
        *,
        n: int | None = 1,
        best_of: int | None = None,
        **kwargs: Any,
    ) -> Completion:
        """Generate ``n`` completions of ``prompt`` (text or tokens) at once (None: one).

        ``best_of`` > n samples that many and keeps the n with the highest total
        log-probability. Other keywords are those of ``stream_completion``.
        """
        return self._completer.complete(
            lambda **kw: self.stream_completion(prompt, **kw), n, best_of, kwargs
        )

    async def astream_completion(
        self, prompt: str | Sequence[int] | Chunks, **kwargs: Any
    ) -> AsyncIterator[CompletionChunk]:
        """``stream_completion`` for asyncio: a worker thread drives the stream."""
        stream = self.stream_completion(prompt, **kwargs)
        async for chunk in stream:
            yield chunk
