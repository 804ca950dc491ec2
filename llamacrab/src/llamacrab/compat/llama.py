"""``Llama`` with llama-cpp-python's constructor, methods and dict results, run by llamacrab.

Every generation goes through llamacrab's engine (``llamacrab.Llama``): this module translates
keywords on the way in and results on the way out, and holds no generation loop of its own.
"""

from __future__ import annotations

import logging
import os
import random
import re
import time
import uuid
from collections import deque
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any, Literal, cast

import numpy as np
import numpy.typing as npt

import llamacrab
from llamacrab import (
    ChatCompletionChunk,
    CompletionChunk,
    DraftModel,
    HubOptions,
    InvalidParameterError,
    ModelParams,
    PromptCache,
    PromptLookup,
    SamplerChain,
    SamplingOptions,
    SavedState,
    Stream,
    TemplateError,
    ToolCall,
)
from llamacrab._field_types import check_range, checked, stop_strings
from llamacrab._types import common_prefix
from llamacrab.compat import _convert as convert
from llamacrab.compat._chat_inputs import (
    check_chat_format,
    current_messages,
    native_chat_format,
)
from llamacrab.compat._constants import (
    KV_TYPES,
    LLAMA_ATTENTION_TYPE_UNSPECIFIED,
    LLAMA_DEFAULT_SEED,
    LLAMA_POOLING_TYPE_UNSPECIFIED,
    LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED,
    LLAMA_SPLIT_MODE_LAYER,
    POOLING_TYPES,
    ROPE_SCALING_TYPES,
    SPLIT_MODES,
)
from llamacrab.compat._errors import UnsupportedParameterError, unknown_keywords
from llamacrab.compat._evaluated import Evaluated
from llamacrab.compat._hooks import (
    Hooks,
    LogitsProcessor,
    LogitsProcessorList,
    MinTokensLogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
)
from llamacrab.compat._sampling import Sampling
from llamacrab.compat._turns import Turns
from llamacrab.compat._vocab_only import ContextSizes, VocabOnly
from llamacrab.compat.llama_chat_format import ProjectorChatHandler
from llamacrab.compat.llama_grammar import LlamaGrammar
from llamacrab.compat.llama_speculative import LlamaDraftModel
from llamacrab.compat.llama_types import (
    ChatCompletionRequestMessage,
    ChatCompletionResponseMessage,
    ChatCompletionStreamResponseDelta,
    CreateChatCompletionResponse,
    CreateChatCompletionStreamResponse,
    CreateCompletionResponse,
    CreateEmbeddingResponse,
    Embedding,
    FinishReason,
)

_SPLIT_PART = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
# llama-cpp-python's numa: True, or ggml's strategy numbers (4, mirror, is not llama-server's).
_NUMA = {1: "distribute", 2: "isolate", 3: "numactl"}


class LlamaState:
    """A saved state (``Llama.save_state``): llamacrab's ``SavedState`` as bytes in
    ``llama_state`` (picklable), the tokens it holds, and the sampling seed to restore.
    ``scores`` is empty: llamacrab keeps no logits history."""

    def __init__(
        self,
        input_ids: npt.NDArray[np.intc],
        scores: npt.NDArray[np.single],
        n_tokens: int,
        llama_state: bytes,
        llama_state_size: int,
        seed: int,
    ) -> None:
        self.input_ids = input_ids
        self.scores = scores
        self.n_tokens = n_tokens
        self.llama_state = llama_state
        self.llama_state_size = llama_state_size
        self.seed = seed


logger = logging.getLogger("llamacrab")


def _projector_of(chat_handler: object, problems: list[str]) -> str | None:
    """The projector a llama_chat_format handler names (None for no handler); another handler
    is a problem: llamacrab renders chats with the model's template or chat_format=."""
    if chat_handler is None:
        return None
    if not isinstance(chat_handler, ProjectorChatHandler):
        problems.append(
            f"chat_handler={type(chat_handler).__name__} (llamacrab renders chats with the "
            "model's template or chat_format= (a name or a Jinja template); it takes the "
            "projector of llamacrab.compat.llama_chat_format's handlers)"
        )
        return None
    if getattr(chat_handler, "use_gpu", True) is False:
        problems.append("chat_handler use_gpu=False (llamacrab places the projector as the model)")
    return chat_handler.clip_model_path


def _chat_format_of_its_own(
    llm: llamacrab.Llama, metadata: Mapping[str, str], vocab_only: bool
) -> str:
    """llama-cpp-python's chat_format where none is asked: the GGUF's template, else Llama 2's
    format. llamacrab also renders some models' turns without a template (Gemma's): those
    keep them."""
    if "tokenizer.chat_template" in metadata:
        return "chat_template.default"
    if not vocab_only:  # (a vocabulary alone renders nothing)
        try:
            llm.chat_prompt([{"role": "user", "content": ""}])
        except TemplateError:
            pass
        else:
            return "chat_template.default"
    return "llama-2"


def _training_context(model: llamacrab.Model) -> int:
    """llama-cpp-python's n_ctx=0: the model's training context, 4096 where none is recorded."""
    arch = model.metadata.get("general.architecture", "")
    return int(model.metadata.get(f"{arch}.context_length", 0)) or 4096


def _tokenize(llm: llamacrab.Llama, text: bytes | str, add_bos: bool, special: bool) -> list[int]:
    """As llama-cpp-python: bytes as they are, UTF-8 or not (a piece cut mid-character)."""
    return llm.tokenize(text, add_special=add_bos, parse_special=special)


def _detokenize(llm: llamacrab.Llama, tokens: Sequence[int], special: bool) -> bytes:
    vocab = llm.vocab
    tokens = [int(t) for t in tokens]
    vocab.check_tokens(tokens)
    out = b"".join(vocab.token_to_bytes(t, special) for t in tokens)
    if tokens and tokens[0] == vocab.bos and out.startswith(b" "):
        out = out[1:]
    return out


class LlamaTokenizer:
    """The model's own tokenizer, in llama-cpp-python's interface."""

    def __init__(self, llama: Llama) -> None:
        # The llamacrab Llama underneath, not ``llama``: Llama.tokenizer_ holds this object, and
        # a cycle would keep a dropped Llama's model until the cyclic collector ran.
        self._llm = llama.llamacrab

    @checked
    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True) -> list[int]:
        return _tokenize(self._llm, text, add_bos, special)

    @checked
    def detokenize(
        self, tokens: Sequence[int], prev_tokens: Sequence[int] | None = None, special: bool = False
    ) -> bytes:
        return _detokenize(self._llm, tokens, special)

    @checked
    def encode(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        return self.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)

    @checked
    def decode(self, tokens: Sequence[int]) -> str:
        return self.detokenize(tokens).decode("utf-8", errors="ignore")


@dataclass
class _Outcome:
    """How a generation ended, filled in while its pieces are read."""

    finish: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    calls: tuple[ToolCall, ...] = ()


class Llama:
    """A model and its context with llama-cpp-python's API: ``Llama(model_path, n_ctx=...,
    ...)``, then ``llm(prompt)`` / ``create_completion`` / ``create_chat_completion`` (dicts,
    or iterators of dict chunks with ``stream=True``), ``create_embedding`` / ``embed``,
    ``tokenize`` / ``detokenize`` on bytes, ``save_state`` / ``load_state``, ``reset``.

    Each keyword maps to llamacrab's own setting. One that llamacrab cannot honour raises
    ``UnsupportedParameterError`` naming it, and an unknown keyword raises TypeError, where
    llama-cpp-python would ignore it. Differences from llama-cpp-python: ``flash_attn=None``
    (the default) lets llama.cpp choose; ``logits_all`` is accepted but not needed (logprobs
    are computed when asked for); calls from several threads take turns instead of corrupting
    each other. ``llamacrab`` is the underlying ``llamacrab.Llama``, for everything else.
    """

    @checked
    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        # Model parameters
        n_gpu_layers: int = 0,
        split_mode: int = LLAMA_SPLIT_MODE_LAYER,
        main_gpu: int = 0,
        tensor_split: Sequence[float] | None = None,
        vocab_only: bool = False,
        use_mmap: bool = True,
        use_mlock: bool = False,
        kv_overrides: Mapping[str, bool | int | float | str] | None = None,
        # Context parameters
        seed: int | None = LLAMA_DEFAULT_SEED,
        n_ctx: int = 512,
        n_batch: int = 512,
        n_ubatch: int = 512,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        rope_scaling_type: int | None = LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED,
        pooling_type: int = LLAMA_POOLING_TYPE_UNSPECIFIED,
        attention_type: int = LLAMA_ATTENTION_TYPE_UNSPECIFIED,
        rope_freq_base: float = 0.0,
        rope_freq_scale: float = 0.0,
        yarn_ext_factor: float = -1.0,
        yarn_attn_factor: float = 1.0,
        yarn_beta_fast: float = 32.0,
        yarn_beta_slow: float = 1.0,
        yarn_orig_ctx: int = 0,
        logits_all: bool = False,
        embedding: bool = False,
        offload_kqv: bool = True,
        flash_attn: bool | None = None,
        op_offload: bool | None = None,
        swa_full: bool | None = None,
        # Sampling parameters
        no_perf: bool = False,
        last_n_tokens_size: int = 64,
        # LoRA
        lora_base: str | None = None,
        lora_scale: float = 1.0,
        lora_path: str | None = None,
        # Backend
        numa: bool | int = False,
        # Chat
        chat_format: str | None = None,
        chat_handler: object | None = None,
        # Speculative decoding
        draft_model: LlamaDraftModel | PromptLookup | DraftModel | None = None,
        # Tokenizer override
        tokenizer: object | None = None,
        # KV cache types
        type_k: int | str | None = None,
        type_v: int | str | None = None,
        # Misc
        spm_infill: bool = False,
        verbose: bool = True,
        **kwargs: Any,
    ) -> None:
        # What pickling keeps (as llama-cpp-python does): the arguments, to load again.
        arguments = dict(locals())  # the parameters alone: nothing else is bound yet
        del arguments["self"]
        arguments.update(arguments.pop("kwargs"))
        self._arguments = arguments
        problems: list[str] = []
        _legacy_keywords(kwargs, problems)
        if vocab_only and lora_path:
            problems.append("lora_path with vocab_only=True (no weights to apply it to)")
        for name, value, default in (
            ("attention_type", attention_type, LLAMA_ATTENTION_TYPE_UNSPECIFIED),
            ("yarn_attn_factor", yarn_attn_factor, 1.0),
            ("yarn_beta_fast", yarn_beta_fast, 32.0),
            ("yarn_beta_slow", yarn_beta_slow, 1.0),
        ):
            if value != default:
                problems.append(f"{name}={value!r} (llamacrab keeps the model's own)")
        if op_offload is False:
            problems.append("op_offload=False (llamacrab keeps llama.cpp's host-op offload)")
        if lora_base is not None:
            problems.append("lora_base (llama.cpp applies LoRA adapters without a base model)")
        numa_strategy = _NUMA.get(int(numa)) if numa is not True else "distribute"
        if numa and numa_strategy is None:
            problems.append(f"numa={numa!r} (llamacrab places threads by distribute, isolate or "
                            "numactl: 1, 2 or 3)")  # fmt: skip
        projector = _projector_of(chat_handler, problems)
        if tokenizer is not None:
            problems.append("tokenizer (llamacrab always uses the model's own tokenizer)")
        speculative = _speculative(draft_model, problems)
        native: dict[str, Any] = {
            "n_gpu_layers": 0x7FFFFFFF if n_gpu_layers == -1 else n_gpu_layers,
            "split_mode": _named("split_mode", split_mode, SPLIT_MODES, problems),
            "main_gpu": main_gpu,
            "tensor_split": None if tensor_split is None else tuple(tensor_split),
            "use_mmap": use_mmap,
            "use_mlock": use_mlock,
            "kv_overrides": kv_overrides,
            # llama-cpp-python: 0, as None, asks for the default.
            "n_threads": n_threads or None,
            "n_threads_batch": n_threads_batch or None,
            "rope_scaling": _named(
                "rope_scaling_type",
                LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED
                if rope_scaling_type is None
                else rope_scaling_type,
                ROPE_SCALING_TYPES,
                problems,
            ),
            "pooling": _named("pooling_type", pooling_type, POOLING_TYPES, problems),
            "rope_freq_base": rope_freq_base,
            "rope_freq_scale": rope_freq_scale,
            "yarn_ext_factor": yarn_ext_factor,
            "yarn_orig_ctx": yarn_orig_ctx,
            "embeddings": embedding,
            "offload_kqv": offload_kqv,
        }
        if flash_attn is not None:
            native["flash_attn"] = "on" if flash_attn else "off"
        if swa_full is not None:
            native["swa_full"] = swa_full
        for name, kv_type in (("type_k", type_k), ("type_v", type_v)):
            if kv_type is not None:
                native[name] = (
                    kv_type
                    if isinstance(kv_type, str)
                    else _named(name, kv_type, KV_TYPES, problems)
                )
        if problems:
            raise UnsupportedParameterError(problems)
        if numa_strategy is not None and numa:
            llamacrab.init_numa(numa_strategy)  # before the model loads, as llama-cpp-python
        check_chat_format(chat_format)  # now, not at the first chat (nor after the load)
        if not os.path.exists(model_path):
            raise InvalidParameterError(f"Model path does not exist: {os.fspath(model_path)}")

        # llama-cpp-python: n_ctx 0 is the model's training context; batches fit the context.
        def load(context: int) -> llamacrab.Llama:
            batch = min(context, n_batch)
            return llamacrab.Llama(
                model_path,
                n_ctx=context,
                n_batch=batch,
                n_ubatch=min(batch, n_ubatch),
                speculative=speculative,
                chat_format=native_chat_format(chat_format),
                mmproj=projector,
                **native,
            )

        if vocab_only:  # llama-cpp-python's tokenizer-only Llama: no weights, no context
            weightless = VocabOnly.load(model_path, native)
            n_ctx = n_ctx or _training_context(weightless.model)
            self._llm = llm = cast(llamacrab.Llama, weightless)
            sizes = ContextSizes.asked(n_ctx, n_batch, n_ubatch, native)
        else:
            if n_ctx == 0:  # the training context, from the header (a vocab-only load reads it)
                with llamacrab.Model.load(model_path, ModelParams(vocab_only=True)) as probe:
                    n_ctx = _training_context(probe)
            self._llm = llm = load(n_ctx)
            try:
                if lora_path:
                    llm.load_lora(lora_path, lora_scale)
            except BaseException:
                llm.close()
                raise
            sizes = ContextSizes.of(llm.context)

        self.model_path = os.fspath(model_path)
        self.verbose = verbose
        self.n_batch = sizes.n_batch
        self.n_threads = sizes.n_threads  # what llama.cpp computes on, asked or not
        self.n_threads_batch = sizes.n_threads_batch
        self.context_params = SimpleNamespace(
            **asdict(sizes),
            embeddings=embedding,
            rope_freq_base=rope_freq_base,
            rope_freq_scale=rope_freq_scale,
            yarn_ext_factor=yarn_ext_factor,
            yarn_orig_ctx=yarn_orig_ctx,
            offload_kqv=offload_kqv,
        )
        self.model_params = SimpleNamespace(
            n_gpu_layers=native["n_gpu_layers"],
            split_mode=split_mode,
            main_gpu=main_gpu,
            vocab_only=vocab_only,
            use_mmap=use_mmap,
            use_mlock=use_mlock,
        )
        self.tensor_split = tensor_split
        self.kv_overrides = kv_overrides
        self.metadata: dict[str, str] = dict(llm.model.metadata)
        if chat_format is None:
            chat_format = _chat_format_of_its_own(llm, self.metadata, vocab_only)
            if chat_format == "llama-2" and not vocab_only:  # (a vocabulary alone never chats)
                logger.warning(
                    "%s has no chat template: its chats use llama-cpp-python's fallback, the "
                    "llama-2 format (pass chat_format= to choose another)",
                    os.path.basename(model_path),
                )
        self.chat_format = chat_format
        self.chat_handler = chat_handler
        self.draft_model = draft_model
        self.lora_base = lora_base
        self.lora_path = lora_path
        self.lora_scale = lora_scale
        self.last_n_tokens_size = last_n_tokens_size
        self.spm_infill = spm_infill
        self._logits_all = logits_all
        self._embedding = embedding
        self._seed = seed or LLAMA_DEFAULT_SEED
        self._n_vocab = llm.vocab.n_tokens
        self._n_ctx = sizes.n_ctx
        self._turns = Turns()
        self._evaluated = Evaluated(self._n_vocab, logits_all)
        self._rewound: tuple[int, list[int]] | None = None  # n_tokens set: (kept, held then)
        self.tokenizer_ = LlamaTokenizer(self)

    # -- what is underneath -------------------------------------------------------------------

    @property
    def llamacrab(self) -> llamacrab.Llama:
        """The llamacrab.Llama doing the work (its API: typed results, parallel slots, ...);
        made with ``vocab_only=True``, a stand-in that tokenizes and raises ContextError for
        the rest."""
        return self._llm

    def close(self) -> None:
        """Free the model and its context."""
        self._llm.close()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (or deep-copied), a Llama is the arguments it was made with: unpickling
        loads the model again, as llama-cpp-python does (what its context holds is not
        kept; ``save_state`` carries that)."""
        return dict(self._arguments)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def __enter__(self) -> Llama:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @classmethod
    @checked
    def from_pretrained(
        cls,
        repo_id: str,
        filename: str | None,
        additional_files: Sequence[str] | None = None,
        local_dir: str | os.PathLike[str] | None = None,
        local_dir_use_symlinks: bool | Literal["auto"] = "auto",
        cache_dir: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> Llama:
        """Download ``filename`` (exact or a glob) from a Hugging Face repository into the
        standard cache (llamacrab.resolve: HF_TOKEN / HF_ENDPOINT / HF_HUB_OFFLINE apply) and
        load it. Every part of a split model comes along, so ``additional_files`` may only
        name such parts."""
        problems = []
        if local_dir is not None:
            problems.append("local_dir (models go to the Hugging Face cache: pass cache_dir)")
        for pattern in additional_files or ():
            if not _SPLIT_PART.search(pattern):
                problems.append(
                    f"additional_files entry {pattern!r} (only the parts of a "
                    "split model, which are fetched anyway)"
                )
        if problems:
            raise UnsupportedParameterError(problems)
        files = llamacrab.resolve(repo_id, HubOptions(filename=filename, cache_dir=cache_dir))
        return cls(files.path, **kwargs)

    # -- tokens -------------------------------------------------------------------------------

    @checked
    def tokenize(self, text: bytes | str, add_bos: bool = True, special: bool = False) -> list[int]:
        """Tokens of ``text`` (bytes as they are, UTF-8 or not); ``add_bos`` adds the special
        tokens the model wants around a text, ``special`` parses control-token text such as
        ``<bos>``."""
        return _tokenize(self._llm, text, add_bos, special)

    @checked
    def detokenize(
        self, tokens: Sequence[int], prev_tokens: Sequence[int] | None = None, special: bool = False
    ) -> bytes:
        """The bytes of ``tokens`` (possibly part of a UTF-8 character); a leading space after
        BOS is dropped, as llama-cpp-python does. ``prev_tokens`` changes nothing."""
        return _detokenize(self._llm, tokens, special)

    def tokenizer(self) -> LlamaTokenizer:
        return LlamaTokenizer(self)

    def n_ctx(self) -> int:
        return self._n_ctx

    def n_embd(self) -> int:
        return self._llm.model.n_embd

    def n_vocab(self) -> int:
        return self._n_vocab

    def token_bos(self) -> int:
        bos = self._llm.vocab.bos
        return -1 if bos is None else bos

    def token_eos(self) -> int:
        eos = self._llm.vocab.eos
        return -1 if eos is None else eos

    def token_nl(self) -> int:
        nl = self._llm.vocab.nl
        return -1 if nl is None else nl

    def pooling_type(self) -> int:
        pooling = self._llm.context.pooling
        return next(k for k, v in POOLING_TYPES.items() if v == pooling)

    # -- what the context holds ---------------------------------------------------------------

    def _held_tokens(self) -> list[int]:
        """The tokens in the context's memory: the prompt and output of the last generation
        but its last sampled token, which nothing decoded yet; only the first ``n_tokens``
        of them after a rewind (until the memory changes)."""
        held = self._llm.held_tokens()
        if self._rewound is not None:
            kept, when = self._rewound
            if held == when:
                return held[:kept]
            self._rewound = None
        return held

    @property
    def n_tokens(self) -> int:
        """How many tokens the context holds. Set lower, as llama-cpp-python's callers do, it
        rewinds: the next ``eval()`` continues after that many (0: from the start)."""
        return len(self._held_tokens())

    @n_tokens.setter
    def n_tokens(self, value: int) -> None:
        held = self._llm.held_tokens()
        check_range("n_tokens", value, 0, len(held))
        self._rewound = (value, held)

    @property
    def input_ids(self) -> npt.NDArray[np.intc]:
        """The tokens the context holds, then zeros up to ``n_ctx()`` (llama-cpp-python's
        shape). A read-only copy: llamacrab's engine keeps its own record."""
        held = self._input_ids
        ids = np.zeros(self._n_ctx, dtype=np.intc)
        ids[: len(held)] = held
        ids.flags.writeable = False
        return ids

    @property
    def _input_ids(self) -> npt.NDArray[np.intc]:
        """``input_ids`` up to ``n_tokens``."""
        ids = np.asarray(self._held_tokens(), dtype=np.intc)
        ids.flags.writeable = False
        return ids

    @property
    def scores(self) -> npt.NDArray[np.single]:
        """The logits ``eval()`` computed, a row per token the context holds (``(n_tokens,
        n_vocab())``): every row it decoded with ``logits_all=True``, its last otherwise;
        zeros for tokens a completion decoded (llamacrab samples those in llama.cpp; a
        ``logits_processor`` sees each token's)."""
        return self._evaluated.scores(self._held_tokens())

    @property
    def eval_tokens(self) -> deque[int]:
        """The tokens the context holds."""
        return deque(self._held_tokens(), maxlen=self._n_ctx)

    @property
    def eval_logits(self) -> deque[list[float]]:
        """``scores`` as lists: every row with ``logits_all=True``, the last otherwise."""
        rows = self.scores if self._logits_all else self.scores[-1:]
        return deque(rows.tolist(), maxlen=self._n_ctx if self._logits_all else 1)

    # -- state --------------------------------------------------------------------------------

    @checked
    def set_seed(self, seed: int) -> None:
        """The seed the next call without ``seed=`` derives its sampling seed from."""
        self._seed = seed

    @property
    def cache(self) -> PromptCache | None:
        """The prompt cache (``set_cache``); None when prompts are not cached."""
        return self._llm.cache

    @cache.setter
    def cache(self, cache: PromptCache | None) -> None:
        self.set_cache(cache)

    def set_cache(self, cache: PromptCache | None) -> None:
        """Keep prompt states in ``cache`` (``LlamaRAMCache``, ``LlamaDiskCache``, or
        llamacrab's ``RamCache`` / ``DiskCache``) from the next call on; None stops caching."""
        if cache is not None and not isinstance(cache, PromptCache):
            raise UnsupportedParameterError(
                [
                    f"set_cache({type(cache).__name__}) (llamacrab caches prompts in "
                    "llamacrab.compat.LlamaRAMCache / LlamaDiskCache or llamacrab's RamCache / "
                    "DiskCache; llama-cpp-python's own cache classes are not those)"
                ]
            )
        with self._turns.turn():
            self._llm.cache = cache

    def reset(self) -> None:
        """Forget the tokens in the KV memory: the next prompt is decoded whole."""
        with self._turns.turn():
            self._llm.reset()

    def save_state(self) -> LlamaState:
        """The KV memory, its tokens and the seed (llamacrab checks them when loaded)."""
        with self._turns.turn():
            saved = self._llm.save_state()
        blob = saved.to_bytes()
        return LlamaState(
            input_ids=np.asarray(saved.tokens, dtype=np.intc),
            scores=np.zeros((0, self._n_vocab), dtype=np.single),
            n_tokens=len(saved.tokens),
            llama_state=blob,
            llama_state_size=len(blob),
            seed=self._seed,
        )

    def load_state(self, state: LlamaState) -> None:
        """Restore a state from ``save_state`` of this model. A state from llama-cpp-python
        itself, another model or a smaller context, or one an earlier llamacrab saved (before
        state format 5), raises ``llamacrab.StateError``."""
        blob = getattr(state, "llama_state", None)
        if not isinstance(blob, bytes | bytearray | memoryview):
            raise InvalidParameterError(
                f"load_state takes a LlamaState from save_state, not {type(state).__name__}"
            )
        seed = getattr(state, "seed", None)
        if not isinstance(seed, int):  # checked before the memory changes
            raise InvalidParameterError(f"a LlamaState's seed is an int, not {seed!r}")
        saved = SavedState.from_bytes(bytes(blob))
        with self._turns.turn():
            self._llm.load_state(saved)
        self._seed = seed

    # -- embeddings ---------------------------------------------------------------------------

    @checked
    def embed(
        self,
        input: str | Sequence[str],
        normalize: bool = False,
        truncate: bool = True,
        return_count: bool = False,
    ) -> Any:
        """Embeddings as lists of floats: one list for a string, a list per text for a list
        (per token, a list of lists, when the context does not pool). ``return_count`` adds
        the number of tokens embedded."""
        if not self._embedding:
            raise InvalidParameterError(
                "Llama model must be created with embedding=True to call this method"
            )
        texts = [input] if isinstance(input, str) else [str(t) for t in input]
        if not texts:
            return ([], 0) if return_count else []
        with self._turns.turn():
            vectors = self._llm.embed(texts, normalize=normalize, truncate=truncate)
        data: list[Any] = (
            [v.tolist() for v in vectors] if isinstance(vectors, list) else vectors.tolist()
        )
        output = data[0] if isinstance(input, str) else data
        if not return_count:
            return output
        limit = self._llm.context.max_decode if truncate else None
        count = sum(len(self._llm.tokenize(t)[:limit]) for t in texts)
        return output, count

    @checked
    def create_embedding(
        self, input: str | Sequence[str], model: str | None = None
    ) -> CreateEmbeddingResponse:
        """An OpenAI-shaped embeddings response (not normalized, as in llama-cpp-python)."""
        texts = [input] if isinstance(input, str) else list(input)
        vectors, count = self.embed(texts, return_count=True)
        data: list[Embedding] = [
            {"object": "embedding", "embedding": vector, "index": i}
            for i, vector in enumerate(vectors)
        ]
        return {
            "object": "list",
            "data": data,
            "model": model if model is not None else self.model_path,
            "usage": {"prompt_tokens": count, "total_tokens": count},
        }

    # -- completion ---------------------------------------------------------------------------

    @checked
    def create_completion(
        self,
        prompt: str | Sequence[int],
        suffix: str | None = None,
        max_tokens: int | None = 16,
        temperature: float = 0.8,
        top_p: float = 0.95,
        min_p: float = 0.05,
        typical_p: float = 1.0,
        logprobs: int | None = None,
        echo: bool = False,
        stop: str | Sequence[str] | None = None,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        repeat_penalty: float = 1.0,
        top_k: int = 40,
        stream: bool = False,
        seed: int | None = None,
        tfs_z: float = 1.0,
        mirostat_mode: int = 0,
        mirostat_tau: float = 5.0,
        mirostat_eta: float = 0.1,
        model: str | None = None,
        stopping_criteria: StoppingCriteria | None = None,
        logits_processor: LogitsProcessor | None = None,
        grammar: LlamaGrammar | str | None = None,
        logit_bias: Mapping[int | str, float] | None = None,
    ) -> CreateCompletionResponse | Iterator[CreateCompletionResponse]:
        """Complete ``prompt`` (text, whose control-token text is parsed, or tokens). Returns
        a ``text_completion`` dict, or with ``stream=True`` an iterator of chunks (the last
        has empty text and the finish_reason). ``suffix`` fills in the middle with the
        model's FIM tokens. ``max_tokens`` None or <= 0 runs to the end of the context.
        Sampling without ``seed`` follows the Llama's seed: reproducible run to run."""
        sampling = self._sampling(Sampling.of(locals()), self._call_seed(seed))
        options: dict[str, Any] = {
            "max_tokens": _max_tokens(max_tokens),
            "stop": _stops(stop),
            "logprobs": logprobs,
        }
        engine_echo: _EngineEcho | None = None
        if suffix is not None:
            if not isinstance(prompt, str):
                raise InvalidParameterError("suffix= needs a text prompt")
            if stopping_criteria is not None or logits_processor is not None:
                raise UnsupportedParameterError(
                    ["logits processors or stopping criteria with suffix= (fill in the middle)"]
                )
            if echo and logprobs is not None:
                raise UnsupportedParameterError(
                    ["logprobs with echo=True and suffix= (the prompt is the model's FIM layout)"]
                )
            engine = self._llm.stream_infill(
                prompt, suffix, spm=self.spm_infill, **options, **sampling
            )
            prompt_text = prompt
        else:
            if isinstance(prompt, str):
                tokens = self._llm.tokenize(prompt, add_special=True, parse_special=True)
                prompt_text = prompt
            else:
                tokens = [int(t) for t in prompt]
                prompt_text = self._llm.detokenize(tokens)
            if not tokens:
                raise InvalidParameterError("the prompt is empty")
            self._hooks(tokens, logits_processor, stopping_criteria, sampling)
            if echo and logprobs is not None:  # the engine echoes, to rate the prompt's tokens
                vocab = self._llm.vocab
                first = None if tokens[0] == vocab.bos else vocab.token_to_piece(tokens[0], True)
                engine_echo = _EngineEcho(prompt_text, first)
            engine = self._llm.stream_completion(
                tokens, echo=engine_echo is not None, **options, **sampling
            )
        meta = _Meta(model if model is not None else self.model_path, "cmpl-")
        if engine_echo is not None:  # its offsets count the echoed prompt already
            chunks = self._completion_chunks(engine, meta, engine_echo, 0)
        else:
            echo_text = prompt_text if echo else ""
            chunks = self._completion_chunks(engine, meta, echo_text, len(prompt_text))
        if stream:
            return chunks
        return self._completion_result(chunks, meta)

    __call__ = create_completion

    def _completion_chunks(
        self,
        engine: Stream[CompletionChunk],
        meta: _Meta,
        echo: str | _EngineEcho,
        offset: int,
    ) -> Generator[CreateCompletionResponse, None, None]:
        """Chunks as llama-cpp-python streams them: text pieces, then an empty last one with
        the finish_reason; ``meta.outcome`` gets the usage. ``echo``: the prompt text to echo
        first, or the engine's echo chunk (with the prompt's logprobs) to show as the prompt."""
        ticket = self._turns.acquire()
        try:
            if isinstance(echo, _EngineEcho):
                rated = convert.echo_logprobs(next(engine).logprobs, echo.first)
                yield convert.completion_chunk(meta.id, meta.created, meta.model, echo.text, rated)
            elif echo:
                yield convert.completion_chunk(meta.id, meta.created, meta.model, echo)
            for chunk in engine:
                logprobs = convert.completion_logprobs(chunk.logprobs, offset)
                if chunk.text or logprobs is not None:
                    yield convert.completion_chunk(
                        meta.id, meta.created, meta.model, chunk.text, logprobs
                    )
                meta.record(chunk.finish_reason, chunk.usage)
            yield convert.completion_chunk(
                meta.id, meta.created, meta.model, "", None, meta.outcome.finish
            )
        finally:
            engine.close()
            self._turns.release(ticket)

    @staticmethod
    def _completion_result(
        chunks: Iterator[CreateCompletionResponse], meta: _Meta
    ) -> CreateCompletionResponse:
        texts: list[str] = []
        logprobs: dict[str, list[Any]] | None = None
        for chunk in chunks:
            choice = chunk["choices"][0]
            texts.append(choice["text"])
            if choice["logprobs"] is not None:
                logprobs = logprobs or {k: [] for k in choice["logprobs"]}
                for key, values in choice["logprobs"].items():
                    logprobs[key].extend(cast(list[Any], values))
        outcome = meta.outcome
        return {
            "id": meta.id,
            "object": "text_completion",
            "created": meta.created,
            "model": meta.model,
            "choices": [
                {
                    "text": "".join(texts),
                    "index": 0,
                    "logprobs": cast(Any, logprobs),
                    "finish_reason": outcome.finish,
                }
            ],
            "usage": convert.usage(outcome.prompt_tokens, outcome.completion_tokens),
        }

    @checked
    def generate(
        self,
        tokens: Sequence[int],
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        typical_p: float = 1.0,
        temp: float = 0.80,
        repeat_penalty: float = 1.0,
        reset: bool = True,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        tfs_z: float = 1.0,
        mirostat_mode: int = 0,
        mirostat_tau: float = 5.0,
        mirostat_eta: float = 0.1,
        penalize_nl: bool = True,
        logits_processor: LogitsProcessor | None = None,
        stopping_criteria: StoppingCriteria | None = None,
        grammar: LlamaGrammar | str | None = None,
    ) -> Generator[int, Sequence[int] | None, None]:
        """The sampled tokens of ``tokens``' continuation, one by one, as llamacrab's engine
        produces them; at an end of the generation the end-of-generation token sampled is
        yielded last, and the generator ends there or at the end of the context (a stopping
        criterion ends it silently).
        ``reset=False`` continues the sequence the context holds (``input_ids``): ``tokens``
        follow it, as in llama-cpp-python, and only they are decoded (none given: the last
        held token again, for its logits)."""
        keywords = Sampling.of({**locals(), "temperature": temp, "logit_bias": None})
        sampling = self._sampling(keywords, self._seed % 2**32)
        prompt = [int(t) for t in tokens]
        if not reset:  # the engine finds the held tokens in memory: a prefix it keeps
            prompt = self._held_tokens() + prompt
        self._hooks(prompt, logits_processor, stopping_criteria, sampling)
        engine = self._llm.stream_completion(prompt, max_tokens=None, **sampling)
        return self._tokens(engine)

    def _tokens(
        self, engine: Stream[CompletionChunk]
    ) -> Generator[int, Sequence[int] | None, None]:
        ticket = self._turns.acquire()
        try:
            for chunk in engine:
                for token in chunk.tokens:
                    if (yield token) is not None:
                        raise UnsupportedParameterError(
                            [
                                "sending tokens into generate() "
                                "(speculative decoding is llamacrab's "
                                "own: draft_model=)"
                            ]
                        )
                # The end token sampled, as llama-cpp-python yields it (<end_of_turn>, not
                # <eos>); none where a complete grammar ended a vocabulary without one.
                if chunk.finish_reason == "eos" and engine.session.end_token is not None:
                    yield engine.session.end_token
        finally:
            engine.close()
            self._turns.release(ticket)

    @checked
    def eval(self, tokens: Sequence[int]) -> None:
        """Decode ``tokens`` after the ones the context holds (``n_tokens``): ``input_ids``
        gains them, ``scores`` a row of logits for each with ``logits_all=True`` (for the
        last alone otherwise), and ``sample()`` picks from the last one's."""
        with self._turns.turn():
            held = self._held_tokens()
            if not len(tokens):
                return
            logits = self._llm.evaluate(tokens, all_logits=self._logits_all, after=len(held))
            rows = logits if self._logits_all else logits[np.newaxis]
            self._evaluated.record(held, [int(t) for t in tokens], rows)

    def _last_logits(self) -> npt.NDArray[np.single] | None:
        """The last row of the context's last decode, if it has one."""
        try:
            return self._llm.context.logits(-1)
        except InvalidParameterError:  # no decode yet, or one whose tokens were sampled in it
            return None

    @checked
    def sample(
        self,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        typical_p: float = 1.0,
        temp: float = 0.80,
        repeat_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        tfs_z: float = 1.0,
        mirostat_mode: int = 0,
        mirostat_eta: float = 0.1,
        mirostat_tau: float = 5.0,
        penalize_nl: bool = True,
        logits_processor: LogitsProcessor | None = None,
        grammar: LlamaGrammar | None = None,
        idx: int | None = None,
    ) -> int:
        """A token picked from the logits of the last ``eval()`` (``idx``: of that position,
        within its last decode) with a fresh sampler chain seeded by the Llama's seed, as
        llama-cpp-python picks. The penalties count the last ``last_n_tokens_size`` tokens
        the context holds (llama-cpp-python's fresh chain counted none). A grammar follows a
        whole generation: ``generate()`` and ``create_completion()`` take one."""
        if grammar is not None:
            grammar_note = ("sample(grammar=) (a grammar follows a whole generation: pass it "
                            "to generate() or create_completion())")  # fmt: skip
            raise UnsupportedParameterError([grammar_note])
        keywords = Sampling.of({**locals(), "temperature": temp, "logit_bias": None})
        with self._turns.turn():
            held = self._held_tokens()
            if not self._evaluated.is_last(held, self._last_logits()):
                raise InvalidParameterError(
                    "sample() picks from the logits of the last eval(), and the context "
                    "changed since (a completion, reset() or load_state()) or none ran"
                )
            index = -1 if idx is None else idx - len(held)
            sampling = self._sampling(keywords, self._seed % 2**32)
            self._hooks(held, logits_processor, None, sampling)
            with SamplerChain(self._llm.model, SamplingOptions(**sampling)) as chain:
                chain.accept_prompt(held)
                return chain.sample(self._llm.context, index)

    # -- chat ---------------------------------------------------------------------------------

    @checked
    def create_chat_completion(
        self,
        messages: Sequence[ChatCompletionRequestMessage | Mapping[str, Any]],
        functions: Sequence[Mapping[str, Any]] | None = None,
        function_call: str | Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        temperature: float = 0.2,
        top_p: float = 0.95,
        top_k: int = 40,
        min_p: float = 0.05,
        typical_p: float = 1.0,
        stream: bool = False,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        response_format: Mapping[str, Any] | None = None,
        max_tokens: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repeat_penalty: float = 1.0,
        tfs_z: float = 1.0,
        mirostat_mode: int = 0,
        mirostat_tau: float = 5.0,
        mirostat_eta: float = 0.1,
        model: str | None = None,
        logits_processor: LogitsProcessor | None = None,
        grammar: LlamaGrammar | str | None = None,
        logit_bias: Mapping[int | str, float] | None = None,
        logprobs: bool | int | None = None,
        top_logprobs: int | None = None,
    ) -> CreateChatCompletionResponse | Iterator[CreateChatCompletionStreamResponse]:
        """Answer ``messages`` with the model's chat template (or ``chat_format``). Returns a
        ``chat.completion`` dict, or with ``stream=True`` an iterator of chunks: the role,
        then content deltas, then an empty delta with the finish_reason. ``tools`` go to the
        template; calls the model makes (always, with ``tool_choice`` "required" or a named
        function, which a grammar enforces) come back as ``message.tool_calls``.
        ``response_format`` {"type": "json_object"} (optionally with "schema") or
        {"type": "json_schema", ...} constrains the answer. Legacy ``function`` messages
        become tool messages, an assistant's ``function_call`` its tool call."""
        sampling = self._sampling(Sampling.of(locals()), self._call_seed(seed))
        if functions is not None and tools is None:
            tools = [{"type": "function", "function": f} for f in functions]
        if function_call is not None and tool_choice is None:
            tool_choice = _function_choice(function_call)
        chat: dict[str, Any] = {
            "max_tokens": _max_tokens(max_tokens),
            "stop": _stops(stop),
            "response_format": response_format,
            "tools": tools or None,
            "tool_choice": _tool_choice(tool_choice, tools),
            "logprobs": _chat_logprobs(logprobs, top_logprobs),
            # llama-cpp-python closes a last assistant turn and opens a new one.
            "prefill_assistant": False,
        }
        chat_format = native_chat_format(self.chat_format)
        turns = current_messages(messages)  # legacy function messages as tool messages
        if logits_processor is not None:
            prompt = self._chat_prompt_tokens(turns, chat_format, tools)
            self._hooks(prompt, logits_processor, None, sampling)
        engine = self._llm.stream_chat_completion(
            turns, chat_format=chat_format, **chat, **sampling
        )
        meta = _Meta(model if model is not None else self.model_path, "chatcmpl-")
        chunks = self._chat_chunks(engine, meta)
        if stream:
            return chunks
        return self._chat_result(chunks, meta)

    def create_chat_completion_openai_v1(self, *args: Any, **kwargs: Any) -> Any:
        """``create_chat_completion`` as the ``openai`` package's types."""
        from openai.types.chat import ChatCompletion, ChatCompletionChunk  # optional

        if kwargs.get("stream", False):
            chunks = cast(Iterator[Any], self.create_chat_completion(*args, **kwargs))
            return (ChatCompletionChunk(**chunk) for chunk in chunks)
        return ChatCompletion(**cast(Any, self.create_chat_completion(*args, **kwargs)))

    def _chat_prompt_tokens(
        self,
        messages: Sequence[Mapping[str, Any]],
        chat_format: str | None,
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> list[int]:
        """The prompt tokens a chat request decodes (for logits processors' input_ids)."""
        text = self._llm.chat_prompt(messages, chat_format, tools=tools, prefill_assistant=False)
        vocab = self._llm.vocab
        has_bos = vocab.bos is not None and text.startswith(vocab.token_to_piece(vocab.bos, True))
        return self._llm.tokenize(text, add_special=not has_bos, parse_special=True)

    def _chat_chunks(
        self, engine: Stream[ChatCompletionChunk], meta: _Meta
    ) -> Generator[CreateChatCompletionStreamResponse, None, None]:
        ticket = self._turns.acquire()
        try:
            yield convert.chat_chunk(meta.id, meta.created, meta.model, {"role": "assistant"})
            for chunk in engine:
                logprobs = convert.chat_logprobs(chunk.logprobs)
                if chunk.delta.content or logprobs is not None:
                    content: ChatCompletionStreamResponseDelta = {"content": chunk.delta.content}
                    yield convert.chat_chunk(
                        meta.id, meta.created, meta.model, content, None, logprobs
                    )
                if chunk.delta.tool_calls:
                    meta.outcome.calls = chunk.delta.tool_calls
                    calls: ChatCompletionStreamResponseDelta = {
                        "content": None,
                        "tool_calls": convert.tool_call_chunks(chunk.delta.tool_calls),
                    }
                    yield convert.chat_chunk(meta.id, meta.created, meta.model, calls)
                meta.record(chunk.finish_reason, chunk.usage)
            yield convert.chat_chunk(meta.id, meta.created, meta.model, {}, meta.outcome.finish)
        finally:
            engine.close()
            self._turns.release(ticket)

    @staticmethod
    def _chat_result(
        chunks: Iterator[CreateChatCompletionStreamResponse], meta: _Meta
    ) -> CreateChatCompletionResponse:
        texts: list[str] = []
        tokens: list[Any] = []
        for chunk in chunks:
            choice = chunk["choices"][0]
            delta = cast(ChatCompletionStreamResponseDelta, choice["delta"])
            texts.append(delta.get("content") or "")
            if choice["logprobs"] is not None:
                tokens.extend(choice["logprobs"]["content"] or ())
        outcome = meta.outcome
        content = "".join(texts)
        message: ChatCompletionResponseMessage = {"role": "assistant", "content": content}
        if outcome.calls:
            calls = convert.tool_calls(outcome.calls)
            first = calls[0]["function"]
            message = {
                "role": "assistant",
                "content": content or None,
                "tool_calls": calls,
                "function_call": {"name": first["name"], "arguments": first["arguments"]},
            }
        return {
            "id": meta.id,
            "object": "chat.completion",
            "created": meta.created,
            "model": meta.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": {"content": tokens, "refusal": None} if tokens else None,
                    "finish_reason": outcome.finish,
                }
            ],
            "usage": convert.usage(outcome.prompt_tokens, outcome.completion_tokens),
        }

    # -- keyword translation ------------------------------------------------------------------

    def _call_seed(self, seed: int | None) -> int:
        """llama-cpp-python's seeding: an explicit seed is used (and becomes the Llama's);
        without one, the next seed is drawn from the Llama's, so runs are reproducible."""
        self._seed = seed if seed is not None else random.Random(self._seed).randint(0, 2**32)
        return self._seed % 2**32

    def _sampling(self, keywords: Sampling, seed: int) -> dict[str, Any]:
        return keywords.options(seed, self.last_n_tokens_size)

    def _hooks(
        self,
        prompt: Sequence[int],
        processors: LogitsProcessor | None,
        criteria: StoppingCriteria | None,
        sampling: dict[str, Any],
    ) -> None:
        """A CustomSampler running ``processors`` / ``criteria``, added to ``sampling``."""
        if processors is not None or criteria is not None:
            hooks = Hooks(prompt, processors, criteria, self._n_vocab)
            sampling["custom_samplers"] = (hooks,)

    # -- utilities llama-cpp-python offers ----------------------------------------------------

    @staticmethod
    def logits_to_logprobs(logits: npt.ArrayLike, axis: int = -1) -> npt.NDArray[np.single]:
        """Log-softmax of ``logits`` along ``axis``."""
        values = np.asarray(logits, dtype=np.single)
        if -values.ndim <= axis < values.ndim and values.shape[axis] == 0:
            # numpy said "zero-size array to reduction operation maximum" (as llama-cpp-python
            # does); a ValueError still, that says what is missing.
            raise InvalidParameterError(
                f"logits_to_logprobs needs at least one logit along axis {axis}: "
                f"the logits have shape {values.shape}"
            )
        top = np.max(values, axis=axis, keepdims=True)
        top = np.where(np.isfinite(top), top, 0)
        shifted = values - top
        with np.errstate(divide="ignore"):
            return cast(
                npt.NDArray[np.single],
                shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True)),
            )

    longest_token_prefix = staticmethod(common_prefix)


@dataclass(frozen=True)
class _EngineEcho:
    """The engine echoes the prompt (to rate its tokens): shown as ``text``; ``first`` is
    the first prompt token's text when it is not a BOS (the engine does not list it)."""

    text: str
    first: str | None


class _Meta:
    """The id, time and model name shared by one call's chunks, and how it ended."""

    def __init__(self, model: str, prefix: str) -> None:
        self.id = prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.outcome = _Outcome()

    def record(self, reason: str | None, usage: llamacrab.Usage | None) -> None:
        if reason is None:
            return
        self.outcome.finish = convert.finish_reason(reason)
        if usage is not None:
            self.outcome.prompt_tokens = usage.prompt_tokens
            self.outcome.completion_tokens = usage.completion_tokens


# Keywords of older llama-cpp-python versions that it now ignores (older integrations still
# pass them), with the values that ask for nothing: None means "any value".
_LEGACY: dict[str, tuple[object, ...] | None] = {
    "n_parts": (-1, None),  # models load whole
    "n_gqa": (None,),  # GGML-era grouped-query setting: read from GGUF now
    "rms_norm_eps": (None,),  # likewise
    "device": (None,),  # offload with n_gpu_layers
    "f16_kv": None,  # KV types are type_k / type_v
    "mul_mat_q": None,  # a kernel choice, no longer a switch
    "low_vram": None,  # likewise
}


def _legacy_keywords(kwargs: dict[str, Any], problems: list[str]) -> None:
    """Legacy keywords are accepted where ignoring them changes nothing, refused otherwise;
    any other unknown keyword is a TypeError."""
    unknown = set(kwargs) - set(_LEGACY)
    if unknown:
        raise unknown_keywords("Llama()", unknown)
    for name, value in kwargs.items():
        allowed = _LEGACY[name]
        if allowed is not None and value not in allowed:
            problems.append(f"{name}={value!r} (no longer a llama.cpp setting)")


def _named(name: str, value: int, table: Mapping[int, str], problems: list[str]) -> str:
    if value not in table:
        problems.append(f"{name}={value!r} (known: {sorted(table)})")
        return next(iter(table.values()))
    return table[value]


def _speculative(
    draft: LlamaDraftModel | PromptLookup | DraftModel | None, problems: list[str]
) -> PromptLookup | DraftModel | None:
    if draft is None or isinstance(draft, PromptLookup | DraftModel):
        return draft
    try:
        return draft.speculative()
    except NotImplementedError:
        problems.append(
            f"draft_model={type(draft).__name__} (llamacrab drafts with "
            "LlamaPromptLookupDecoding, llamacrab.PromptLookup or DraftModel)"
        )
        return None


def _max_tokens(max_tokens: int | None) -> int | None:
    return None if max_tokens is None or max_tokens <= 0 else max_tokens


def _stops(stop: str | Sequence[str] | None) -> list[str]:
    try:
        return list(stop_strings(stop))
    except InvalidParameterError as error:
        # An empty one, where llama-cpp-python ends before the first token with no text, or
        # one no text can match: llamacrab refuses both (and honours neither here).
        raise UnsupportedParameterError([f"stop={stop!r} ({error})"]) from None


def _tool_choice(
    choice: str | Mapping[str, Any] | None, tools: Sequence[Mapping[str, Any]] | None
) -> str | Mapping[str, Any]:
    """llamacrab's tool_choice: None is "auto"; a tool's bare name forces that tool."""
    if choice is None:
        return "auto"
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        functions = [t.get("function") for t in tools or ()]
        names = {f.get("name") for f in functions if isinstance(f, Mapping)}
        if choice in names:
            return {"type": "function", "function": {"name": choice}}
    return choice


def _function_choice(function_call: str | Mapping[str, Any]) -> str | Mapping[str, Any]:
    """The legacy ``function_call`` ("auto", "none", a name, or {"name": ...}) as a
    tool_choice."""
    if isinstance(function_call, str):
        return function_call
    name = function_call.get("name")
    if not isinstance(name, str):
        raise InvalidParameterError(
            f'function_call must be "auto", "none" or {{"name": ...}}, not {function_call!r}'
        )
    return {"type": "function", "function": {"name": name}}


def _chat_logprobs(logprobs: bool | int | None, top_logprobs: int | None) -> int | None:
    if not logprobs:
        return None
    if top_logprobs is not None:
        return top_logprobs
    return 0 if isinstance(logprobs, bool) else int(logprobs)


# What llama_cpp.llama exports besides Llama.
__all__ = [
    "Llama",
    "LlamaDraftModel",
    "LlamaGrammar",
    "LlamaState",
    "LlamaTokenizer",
    "LogitsProcessor",
    "LogitsProcessorList",
    "MinTokensLogitsProcessor",
    "StoppingCriteria",
    "StoppingCriteriaList",
]
