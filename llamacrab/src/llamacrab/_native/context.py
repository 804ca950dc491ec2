"""Context: wraps ``struct llama_context`` (KV memory, decode, logits); a child of its model."""

from __future__ import annotations

import hashlib
import math
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from llamacrab._exceptions import (
    ClosedHandleError,
    ContextError,
    ContextOverflowError,
    DecodeAbortedError,
    DecodeError,
    InvalidModelError,
    InvalidParameterError,
    StateError,
)
from llamacrab._field_types import (
    FLOAT32_MAX,
    INT32_MAX,
    INT32_MIN,
    LAST_POSITION,
    UINT32_MAX,
    check_field_types,
    check_range,
    is_number,
)
from llamacrab._native.adapter import LoraAdapter
from llamacrab._native.batch import Batch
from llamacrab._native.call import call, ffi, lib
from llamacrab._native.claims import Exclusive
from llamacrab._native.control_vector import ControlVector
from llamacrab._native.devices import accelerator_present
from llamacrab._native.fork import note_compute_threads, thread_limit
from llamacrab._native.gguf import archs
from llamacrab._native.handle import NativeHandle
from llamacrab._native.host_limits import GGML_MAX_N_THREADS, default_threads, host_memory_left
from llamacrab._native.kv_layout import CELL_PAD, kv_streams, pad_cells
from llamacrab._native.logging import log_lines, logger
from llamacrab._native.model import Model
from llamacrab._native.seq_state import SequenceMemory, check_sequence_state
from llamacrab._native.signals import arm_sigint, held_signals

KV_CELL_BYTES = 48  # llama_kv_cells: pos, shift and ext (x, y) int32s, a std::bitset<256>
# llama_batch_allocr::ubatch_reserve zero-fills, per token of the micro-batch it reserves the
# graph with, a token, up to 4 positions (M-RoPE), a sequence count, a sequence pointer and an
# output flag: 33 bytes, in host memory for every model (a recurrent one counts nothing else).
UBATCH_TOKEN_BYTES = 33
# llama.cpp pads n_ctx to a multiple of 256 in uint32 (n_ctx 2^32 - 1 became 0 and asserted),
# then, with a KV stream per sequence, gives each stream n_ctx / n_seq_max padded to 256 again
# and makes n_ctx that times n_seq_max: at most 255 cells more per stream. Below this bound
# neither step wraps for any n_seq_max llama.cpp allows.
MAX_N_CTX = UINT32_MAX + 1 - CELL_PAD * lib.llama_max_parallel_sequences()

FLASH_ATTN = {
    "auto": lib.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": lib.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": lib.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}
POOLING = {
    "unspecified": lib.LLAMA_POOLING_TYPE_UNSPECIFIED,
    "none": lib.LLAMA_POOLING_TYPE_NONE,
    "mean": lib.LLAMA_POOLING_TYPE_MEAN,
    "cls": lib.LLAMA_POOLING_TYPE_CLS,
    "last": lib.LLAMA_POOLING_TYPE_LAST,
    "rank": lib.LLAMA_POOLING_TYPE_RANK,
}
ROPE_SCALING = {
    "unspecified": lib.LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED,
    "none": lib.LLAMA_ROPE_SCALING_TYPE_NONE,
    "linear": lib.LLAMA_ROPE_SCALING_TYPE_LINEAR,
    "yarn": lib.LLAMA_ROPE_SCALING_TYPE_YARN,
    "longrope": lib.LLAMA_ROPE_SCALING_TYPE_LONGROPE,
}
KV_TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7}
# The ContextParams that change what the KV memory holds for the same tokens (values or layout).
KV_SETTINGS = ("rope_scaling", "rope_freq_base", "rope_freq_scale", "yarn_ext_factor",
               "yarn_orig_ctx", "type_k", "type_v", "flash_attn", "swa_full")  # fmt: skip

# Where a generation's sampler chain runs when all of it can run inside the compute graph:
# "auto" there when the output layer is computed on a GPU of this machine (no logits copied
# back per token; _graph_sampling_pays), "on" there always, "off" never (the CPU chain
# samples). On the CPU backend the graph's sampling costs more than the CPU chain at the pin
# (docs/graph-sampling.md), hence "auto".
GRAPH_SAMPLING = ("auto", "on", "off")
# Added by llamacrab's patch to llama.cpp: a build a user brings lacks it, and its removals
# leave freed cells as they were.
ZEROES_FREED_CELLS = hasattr(lib, "safe_llama_memory_seq_rm_zeroed")

# LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY, a #define cffi does not carry: a sequence state of the
# sliding-window layers only (and the recurrent states of hybrid models).
_PARTIAL_ONLY = 1

_DECODE_STATUS = {
    1: "no KV cache slot for the batch (the context is full)",
    -1: "invalid batch (tokens or positions rejected)",
}


def _choice(name: str, value: str, table: dict[str, Any]) -> int:
    if value not in table:
        raise InvalidParameterError(f"{name} must be one of {sorted(table)}, not {value!r}")
    return int(table[value])


@dataclass(frozen=True, kw_only=True)
class ContextParams:
    """How to create a context. ``None`` keeps llama.cpp's default."""

    n_ctx: int | None = None  # None: the model's training context, at most 4096
    n_batch: int = 2048
    n_ubatch: int = 512
    n_seq_max: int = 1
    n_threads: int | None = None
    n_threads_batch: int | None = None
    flash_attn: str = "auto"
    offload_kqv: bool = True
    type_k: str = "f16"
    type_v: str = "f16"
    rope_scaling: str = "unspecified"
    rope_freq_base: float = 0.0
    rope_freq_scale: float = 0.0
    yarn_ext_factor: float = -1.0
    yarn_orig_ctx: int = 0
    embeddings: bool = False
    pooling: str = "unspecified"
    # llama-server's and llama-bench's choice, not the C default: windowed layers keep the
    # window (plus a batch) instead of n_ctx cells. Half of Gemma 3 270M's memory at 32k, and
    # prefill and decode at depth stop attending over cells the window masks anyway.
    swa_full: bool = False
    kv_unified: bool = False
    graph_sampling: str = "auto"  # see GRAPH_SAMPLING
    # Checkpoints of a sliding-window model's windowed layers kept per sequence (llama-server's
    # --ctx-checkpoints; 0: none). Each holds a window of cells: ~7.5 MiB for Gemma 3 270M,
    # hundreds of MiB for 27B-class models.
    ctx_checkpoints: int = 3
    # llama.cpp's tools' --warmup (theirs is on by default): one decode at creation, so the
    # first request does not pay for faulting the weights in and the first graph's setup.
    warmup: bool = False

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("n_batch", "n_ubatch", "n_seq_max"):
            check_range(name, getattr(self, name), 1, UINT32_MAX)
        check_range("n_ctx", self.n_ctx, 1, MAX_N_CTX)
        if self.n_seq_max > lib.llama_max_parallel_sequences():
            raise InvalidParameterError(
                f"n_seq_max {self.n_seq_max} exceeds {lib.llama_max_parallel_sequences()}"
            )
        for name in ("n_threads", "n_threads_batch"):
            check_range(name, getattr(self, name), 1, GGML_MAX_N_THREADS)
        check_range("yarn_orig_ctx", self.yarn_orig_ctx, 0, INT32_MAX)  # read as an int
        for name in ("rope_freq_base", "rope_freq_scale", "yarn_ext_factor"):
            if not math.isfinite(getattr(self, name)):  # NaN positions: every logit NaN
                raise InvalidParameterError(f"{name} must be finite, not {getattr(self, name)}")
        for name in ("rope_freq_base", "rope_freq_scale"):  # 0: the model's own
            if not 0 <= getattr(self, name) <= FLOAT32_MAX:  # NaN positions too
                raise InvalidParameterError(
                    f"{name} must be 0 (the model's) or a positive 32-bit float, not "
                    f"{getattr(self, name)}"
                )
        _choice("flash_attn", self.flash_attn, FLASH_ATTN)
        _choice("pooling", self.pooling, POOLING)
        _choice("rope_scaling", self.rope_scaling, ROPE_SCALING)
        _choice("type_k", self.type_k, KV_TYPES)
        _choice("type_v", self.type_v, KV_TYPES)
        if self.ctx_checkpoints < 0:
            raise InvalidParameterError(f"ctx_checkpoints must be >= 0, not {self.ctx_checkpoints}")
        if self.graph_sampling not in GRAPH_SAMPLING:
            raise InvalidParameterError(
                f"graph_sampling must be one of {GRAPH_SAMPLING}, not {self.graph_sampling!r}"
            )

    def to_c(self, n_ctx_train: int) -> Any:
        c = lib.llama_context_default_params()
        c.n_ctx = self.n_ctx if self.n_ctx is not None else min(n_ctx_train or 4096, 4096)
        for name in ("n_batch", "n_seq_max", "rope_freq_base", "rope_freq_scale",
                     "yarn_ext_factor", "yarn_orig_ctx", "embeddings", "offload_kqv",
                     "swa_full", "kv_unified"):  # fmt: skip
            setattr(c, name, getattr(self, name))
        # llama.cpp aborts (GGML_ASSERT) when a context has more sequences than rows: its
        # output buffer holds a row per sequence within n_batch rows (n_batch cut to n_ctx for
        # causal models), and the graph it reserves at creation has an n_ubatch-token batch of
        # n_seq_max sequences, which pooling cannot build with fewer tokens than sequences. So
        # all three are at least n_seq_max (n_ctx is padded to a multiple of 256 anyway).
        c.n_batch = max(c.n_batch, self.n_seq_max)
        c.n_ubatch = max(min(self.n_ubatch, self.n_batch), self.n_seq_max)
        c.n_ctx = max(c.n_ctx, self.n_seq_max)
        threads = default_threads().amount
        c.n_threads = thread_limit(self.n_threads or threads)
        c.n_threads_batch = thread_limit(self.n_threads_batch or self.n_threads or threads)
        c.flash_attn_type = FLASH_ATTN[self.flash_attn]
        c.pooling_type = POOLING[self.pooling]
        c.rope_scaling_type = ROPE_SCALING[self.rope_scaling]
        c.type_k = KV_TYPES[self.type_k]
        c.type_v = KV_TYPES[self.type_v]
        return c


class WeightsGuard(Protocol):
    """Runs generations on a context's sequences: sees every change of its adapters coming."""

    def weights_change(self) -> AbstractContextManager[None]:
        """Entered around the change: raises to refuse it (nothing is applied then)."""
        ...


class GraphSampler(Protocol):
    """A sampler chain that can run inside a context's compute graph (a SamplerChain)."""

    def in_flight(self) -> AbstractContextManager[Any]: ...

    def claim_graph(self, context: Context) -> None:
        """Raise unless the chain may go into ``context``'s graph, and mark it as given:
        llama.cpp initializes a chain for one graph once in its life."""
        ...


class Context(NativeHandle):
    """A llama.cpp context. Not for concurrent use: a second thread entering raises
    ConcurrentUseError instead of corrupting state. ``cancel()`` may be called from any thread."""

    kind = "context"

    def __init__(self, model: Model, params: ContextParams | None = None) -> None:
        params = params or ContextParams()
        if model.params.vocab_only:
            raise InvalidParameterError(f"{model!r} was loaded with vocab_only: it has no weights")
        _check_rope_freq_base(model, params)
        # A sequence's share of the context (n_ctx_seq) past the training length is allowed, as
        # llama.cpp allows it: llama_init_from_model logs a warning ("possible training
        # context overflow") to the llamacrab logger. Only the share counts: n_ctx 1024 for
        # two slots of a model trained for 512 is within it.
        log_lines.take_errors()
        note_compute_threads()
        # Closing the model from another thread waits for the creation, then closes this too;
        # signals wait for the handle (signals.py).
        with held_signals(), model.in_flight() as model_pointer:
            _check_encoder_decoder(model, params)
            c_params = params.to_c(model.n_ctx_train)  # reads the model: inside the call
            _fit_graph(model, params, c_params)
            _check_quantized_keys(model, c_params)
            _check_host_memory(model, params, c_params)
            pointer = call("llama_init_from_model", model_pointer, c_params)
            if pointer == ffi.NULL:
                reason = log_lines.take_errors() or "see the llamacrab logger"
                raise ContextError(f"llama.cpp could not create a context ({params}): {reason}")
            # ggml polls the abort callback at every graph node: a C function reading flags
            # keeps that poll free of the GIL; cancel() just sets one.
            self._abort_flags = ffi.new("llamacrab_abort_flags *")
            super().__init__(pointer, lib.llama_free, model, keep_alive=self._abort_flags)
            with self.in_flight():
                self._setup(model, params, pointer)
            if params.embeddings and self.pooling == "rank":
                self._check_classifier(model, params)
            if self.encoder_decoder and (pooling := self.pooling) != "none":
                self.close()
                raise ContextError(
                    f"{model!r} ({model.arch}) is an encoder-decoder model: with pooling "
                    f"{pooling!r} llama.cpp hands its decoder an encoder output that only "
                    'pooling "none" fills, and the decoder ignores the prompt'
                )
        if params.warmup:
            self._warm_up()

    def _setup(self, model: Model, params: ContextParams, pointer: Any) -> None:
        lib.llama_set_abort_callback(pointer, lib.llamacrab_abort_on_flags, self._abort_flags)
        self.model = model
        self.params = params
        self._busy = Exclusive()  # one thread's native call at a time
        self._adapters: dict[LoraAdapter, float] = {}  # the default set
        self._applied: dict[LoraAdapter, float] = {}  # what llama.cpp applies now (scale != 0)
        self._cvec: tuple[ControlVector, int, int] | None = None
        self._guards: weakref.WeakSet[WeightsGuard] = weakref.WeakSet()
        # Sampler chains llama.cpp runs inside the compute graph, by sequence (set_graph_sampler).
        self._graph_samplers: dict[int, GraphSampler] = {}
        # Why the logits buffer holds no outputs of the last call (None: it does): every output
        # was sampled in the graph, or the call was an encode.
        self._no_logits: str | None = None
        # Bumped by every change of the adapters: KV computed under an older value is stale.
        self.weights_generation = 0
        # By sequence, bumped by every change of its KV memory other than a decode (clear,
        # remove, copy into it, keep, shift, divide, a state loaded): the engine tells its own
        # changes from a user's by these (memory_generation).
        self._memory_changes = [0] * params.n_seq_max
        # The sequences whose next removal zeroes the cells it frees (note_non_finite).
        self._zero_when_removed: set[int] = set()
        # llama.cpp loads a state only into as many KV streams as it was saved from: one per
        # sequence without kv_unified (a recurrent model's memory has none).
        attends = not lib.llama_model_is_recurrent(model.pointer)
        self.kv_streams = 1 if params.kv_unified or not attends else params.n_seq_max
        # What, besides the tokens, decides the KV memory: the model, the adapters (file
        # identity and scale), KV_SETTINGS and the streams. Prompt caches keep states under it.
        self.kv_fingerprint = self._fingerprint()
        self.n_ctx = int(lib.llama_n_ctx(pointer))
        self.n_batch = int(lib.llama_n_batch(pointer))
        self.n_threads = int(lib.llama_n_threads(pointer))  # as computed, asked or by default
        self.n_threads_batch = int(lib.llama_n_threads_batch(pointer))
        self.n_ctx_seq = int(lib.llama_n_ctx_seq(pointer))  # what one sequence may hold
        self.n_swa = model.n_swa
        self.recurrent = model.recurrent
        self.encoder_decoder = model.encoder_decoder
        # The sequences the last encode() read, which decodes may attend to: llama.cpp keeps one
        # encoder output per context, and asserts (an abort) when a decode finds none.
        self._encoded: frozenset[int] = frozenset()
        self.needs_checkpoints = model.needs_checkpoints
        # llama_decode asserts n_ubatch >= n_tokens (an abort) with non-causal attention, and
        # so does the encoder it runs for a model without KV memory (BERT, gemma-embedding).
        whole = not lib.llama_get_causal_attn(pointer) or lib.llama_get_memory(pointer) == ffi.NULL
        self.max_decode = int(lib.llama_n_ubatch(pointer)) if whole else self.n_batch
        self.n_vocab = model.vocab.n_tokens
        # chameleon's graph asserts an output row in every micro-batch (gguf.archs).
        self._output_all = model.arch in archs.OUTPUT_EVERY_UBATCH
        mode = params.graph_sampling
        if mode == "auto":
            mode = "on" if _graph_sampling_pays(model) else "off"
        self.graph_sampling = mode  # "on" or "off": where fitting chains sample

    def _check_classifier(self, model: Model, params: ContextParams) -> None:
        """Rank pooling has each decode copy a sequence's ``n_cls_out`` floats (the count of
        the model's labels, else 1) out of the head's outputs at that stride: llama.cpp
        aborts reading past a narrower row and reads other texts' values in a wider one."""
        rows, outputs = model.classifier_rows, model.n_cls_out
        if rows == outputs:
            return
        self.close()
        head = ("no classification head: a pooled row is a hidden state" if rows is None
                else f"a classification head of {rows} outputs")  # fmt: skip
        problem = (
            f"rank pooling reads {outputs} classifier output{'s' * (outputs > 1)} per text "
            f"and {model.path.name} has {head}"
        )
        if params.pooling == "rank":
            raise InvalidParameterError(f'pooling="rank": {problem}; rank pooling needs a '
                                        "reranker or classifier model")  # fmt: skip
        raise InvalidModelError(f"{model.path}: its pooling type is rank, yet {problem}")

    def _warm_up(self) -> None:
        """What llama.cpp's tools do at load: decode BOS and EOS, then empty the memory; and
        find the end-of-generation tokens (~2 ms for 262k). Here a fresh process's first token
        of Gemma 3 270M comes ~27 ms sooner. Not for a model with an encoder (llamacrab runs
        decoders), and a failure only costs the head start."""
        if lib.llama_model_has_encoder(self.model.pointer):
            return
        vocab = self.model.vocab
        tokens = [token for token in (vocab.bos, vocab.eos) if token is not None] or [0]
        tokens = tokens[: self.max_decode]
        with Batch(len(tokens)) as batch:
            batch.set(np.asarray(tokens, dtype=np.int32), 0)
            try:
                self.decode(batch)
            except DecodeError as error:
                logger.warning("warm-up decode failed (the first request pays instead): %s", error)
        with self.exclusive() as ctx:
            call("llama_synchronize", ctx)  # a GPU's queued work is part of the warm-up
        self.clear()
        vocab.eog_tokens  # noqa: B018 - every sampler chain reads them: a scan of the vocabulary

    @contextmanager
    def exclusive(self) -> Iterator[Any]:
        """Hold the context for one thread's native call; yields the raw pointer. ``close()``
        from another thread cancels the call and waits for it before freeing."""
        self.check_own()  # the parent's (fork()): its lock may be held by a thread not here
        here = ("this context is in use by a call on this thread: a callback inside it (a "
                "custom sampler, say) cannot use it")  # fmt: skip
        elsewhere = "this context is in use by another thread"
        with self._busy.hold(here, elsewhere), self.in_flight() as pointer:
            yield pointer

    def held_here(self) -> bool:
        """Whether this thread is inside a call holding the context (a callback of llama.cpp's
        running on it, such as a Python sampler)."""
        return self._busy.holder_thread() == threading.get_ident()

    def cancel(self) -> None:
        """Abort the decode in progress (from any thread); it raises DecodeAbortedError."""
        self._abort_flags.cancel = 1

    def _interrupt(self) -> None:
        self.cancel()

    @property
    def abort_flags(self) -> Any:
        """What this context's calls poll (``llamacrab_abort_flags *``), for native work done
        for one of them elsewhere (libmtmd's encoder) to poll as well; valid while it is open."""
        return self._abort_flags

    def abort_requested(self) -> bool:
        """Whether the flags ask the armed call to stop: a cancel, a close or a Ctrl-C."""
        return bool(lib.llamacrab_abort_on_flags(self._abort_flags))

    def arm_cancel(self) -> None:
        """Clear a cancel left from between calls, before a call that polls the flags (a
        closing context stays cancelled), and let a Ctrl-C abort it (``arm_sigint``). Called
        holding ``exclusive()``."""
        self._abort_flags.cancel = 1 if self._closing else 0
        arm_sigint(self._abort_flags)

    def decode(
        self,
        batch: Batch,
        lora: Mapping[LoraAdapter, float] | None = None,
        stopped: Callable[[], bool] | None = None,
    ) -> None:
        """Decode ``batch`` with the adapters ``lora`` (None: the default set, see
        ``set_lora_adapters``); the caller keeps track of which KV was computed with which.
        ``stopped`` returning True once the call is armed aborts it (DecodeAbortedError): a
        ``cancel()`` meant for it that came before, which arming cleared."""
        if self.encoder_decoder:
            unread = batch.sequences() - self._encoded
            if unread:
                raise ContextError(
                    f"sequence {min(unread)} has no encoder output to attend to: an "
                    "encoder-decoder model's decoder runs after encode() read its input"
                )
        status = self._compute("llama_decode", batch, lora, stopped)
        if status == 0:
            return
        if status == 2:
            raise DecodeAbortedError("decode cancelled", status)
        reason = _DECODE_STATUS.get(status, "llama.cpp error")
        raise DecodeError(f"llama_decode failed with status {status}: {reason}", status)

    def encode(
        self,
        batch: Batch,
        lora: Mapping[LoraAdapter, float] | None = None,
        stopped: Callable[[], bool] | None = None,
    ) -> None:
        """Run an encoder-decoder model's encoder (T5) over ``batch``, all of it at once (at
        most n_ubatch tokens); decodes of the sequences it holds then attend to its output,
        until the next encode, which empties their decoder memory first (it attended to the
        input before). ``lora`` and ``stopped`` as ``decode`` takes them."""
        if not self.encoder_decoder:
            raise InvalidParameterError(
                f"encode() runs the encoder of an encoder-decoder model; {self.model!r} "
                f"({self.model.arch}) is not one: decode() runs it"
            )
        count, limit = batch.struct.n_tokens, self.n_ubatch
        if count > limit:  # llama.cpp asserts it (an abort): the encoder reads all at once
            raise ContextOverflowError(
                f"the encoder reads its whole input at once: {count} tokens exceed this "
                f"context's n_ubatch of {limit} (raise n_ubatch; the server's --n-ubatch)",
                n_prompt_tokens=count, n_ctx=limit,
            )  # fmt: skip
        self._encoded = frozenset()  # what a failed encode leaves is not known
        # A new input starts the decoder over: llama.cpp refuses an encode of a sequence whose
        # decoder memory holds positions (what it held attended to the input before).
        for seq_id in batch.sequences():
            if self.positions(seq_id) is not None:
                self.remove(seq_id, 0, -1)
        status = self._compute("llama_encode", batch, lora, stopped)
        if status == 2:
            raise DecodeAbortedError("encode cancelled", status)
        if status != 0:
            reason = log_lines.take_errors() or "llama.cpp error"
            raise DecodeError(f"llama_encode failed with status {status}: {reason}", status)
        self._encoded = batch.sequences()

    def _compute(
        self,
        function: str,
        batch: Batch,
        lora: Mapping[LoraAdapter, float] | None,
        stopped: Callable[[], bool] | None,
    ) -> int:
        """Call ``function`` (llama_decode or llama_encode) on ``batch`` as ``decode`` says;
        its status."""
        if batch.struct.n_tokens > self.max_decode:
            raise ContextOverflowError(
                f"a batch of {batch.struct.n_tokens} tokens exceeds the {self.max_decode} this "
                "context decodes at once"
            )
        if self._output_all:
            batch.output_all()
        rows = self.model.position_rows
        if rows is not None and (last := batch.last_position()) >= rows:
            raise ContextOverflowError(
                f"position {last} is past this model's learned position table ({rows} "
                "positions, its n_ctx_train): ggml would read outside it and abort",
                n_prompt_tokens=last + 1, n_ctx=rows,
            )  # fmt: skip
        wanted = self._adapters if lora is None else lora
        with self.exclusive() as ctx, ExitStack() as adapters:
            self._apply_lora(ctx, wanted)
            for adapter in self._applied:  # llama.cpp computes with them: none freed meanwhile
                adapters.enter_context(adapter.in_flight())
            self.hold_graph_samplers(ctx, adapters)
            # llama.cpp copies no logits when every output row's sequence samples in the graph.
            outputs = batch.output_sequences() if self._graph_samplers else frozenset()
            if function == "llama_encode":
                self._no_logits = "the last call was an encode, which computes no logits"
            elif outputs and outputs <= self._graph_samplers.keys():
                self._no_logits = (
                    "the last decode sampled its outputs inside the compute graph, where "
                    "llama.cpp copies no logits: create the context with graph_sampling='off' "
                    "to read them"
                )
            else:
                self._no_logits = None
            self.arm_cancel()
            if stopped is not None and stopped():
                self.cancel()
            return int(call(function, ctx, batch.value))

    # -- sampling inside the compute graph -----------------------------------------------------

    def set_graph_sampler(self, seq_id: int, chain: GraphSampler | None) -> bool:
        """Have llama.cpp run the sampler chain ``chain`` inside the compute graph for the
        outputs of sequence ``seq_id`` (None: none, the CPU chain samples from raw logits).
        False when llama.cpp refused it. A chain can be given once in its life: llama.cpp
        initializes it for this context (``SamplerChain.attach`` says whether all of it
        runs there). Outputs of such a sequence have no raw logits."""
        self.check_sequence(seq_id)
        if chain is not None:  # llama.cpp asserts on a chain given twice, or one ggml cannot run
            chain.claim_graph(self)
        if chain is None and seq_id not in self._graph_samplers:
            return True  # nothing to change: llama.cpp would not reserve its graphs again
        with self.exclusive() as ctx:
            if chain is None:
                call("llama_set_sampler", ctx, seq_id, ffi.NULL)
                del self._graph_samplers[seq_id]
                return True
            with chain.in_flight() as pointer:
                accepted = bool(call("llama_set_sampler", ctx, seq_id, pointer))
            if accepted:
                self._graph_samplers[seq_id] = chain
            else:  # llama.cpp dropped the sequence's chain, if it had one
                self._graph_samplers.pop(seq_id, None)
            return accepted

    def clear_graph_samplers(self) -> None:
        """Take every chain out of the compute graph."""
        for seq_id in list(self._graph_samplers):
            self.set_graph_sampler(seq_id, None)

    def graph_sampler(self, seq_id: int) -> GraphSampler | None:
        """The chain ``set_graph_sampler`` gave sequence ``seq_id``, if any."""
        return self._graph_samplers.get(seq_id)

    def hold_graph_samplers(self, ctx: Any, stack: ExitStack) -> None:
        """Called holding ``exclusive()`` before a decode: the chains llama.cpp will run are
        kept from being freed during it, and a chain closed since it was set is taken out of
        llama.cpp first (it would read freed memory)."""
        for seq_id, chain in list(self._graph_samplers.items()):
            try:
                stack.enter_context(chain.in_flight())
            except ClosedHandleError:
                call("llama_set_sampler", ctx, seq_id, ffi.NULL)
                del self._graph_samplers[seq_id]

    def logits(self, index: int = -1) -> np.ndarray:
        """A copy of the logits of output ``index`` of the last decode. Where every output of
        that decode was sampled inside the graph (``set_graph_sampler``), llama.cpp copied no
        logits and the buffer holds an older decode's: InvalidParameterError."""
        with self.exclusive() as ctx:  # the flag and the buffer of the same decode
            if self._no_logits is not None:
                raise InvalidParameterError(self._no_logits)
            check_range("index", index, INT32_MIN, INT32_MAX)
            row = call("llama_get_logits_ith", ctx, index)
            if row == ffi.NULL:
                raise InvalidParameterError(f"no logits for output {index} of the last decode")
            view = np.frombuffer(ffi.buffer(row, 4 * self.n_vocab), np.float32)
            logits: np.ndarray = np.array(view)  # a copy: the next decode overwrites the row
            return logits

    # -- embeddings ----------------------------------------------------------------------------

    @property
    def pooling(self) -> str:
        """The pooling llama.cpp applies: "none", "mean", "cls", "last" or "rank"."""
        value = self.read(lib.llama_pooling_type)
        return next(name for name, known in POOLING.items() if known == value)

    def embeddings(
        self, width: int, *, seq_id: int | None = None, index: int = 0, count: int = 1
    ) -> np.ndarray:
        """A copy of ``count`` rows of ``width`` floats from the last decode: the pooled vector
        of ``seq_id``, or the per-token rows starting at output ``index``. Reads only memory
        the rows hold: a ``width`` wider than a row, or rows past the last output, raise
        InvalidParameterError."""
        model = self.model
        # A pooled row of rank pooling holds the classifier's outputs; any other, the embedding.
        row_width = model.n_cls_out if seq_id is not None and self.pooling == "rank" else None
        row_width = row_width or model.n_embd_out
        check_range("count", count, 1, INT32_MAX)
        check_range("index", index, INT32_MIN, INT32_MAX - count + 1)
        if seq_id is not None:
            self.check_sequence(seq_id)
        if not 0 < width <= row_width or count < 1 or (seq_id is not None and count != 1):
            raise InvalidParameterError(
                f"{count} rows of {width} floats: a row holds {row_width} (one per sequence)"
            )
        with self.exclusive() as ctx:
            if seq_id is not None:
                row = call("llama_get_embeddings_seq", ctx, seq_id)
            else:
                row = call("llama_get_embeddings_ith", ctx, index)
            if row == ffi.NULL:
                where = f"sequence {seq_id}" if seq_id is not None else f"output {index}"
                raise InvalidParameterError(f"llama.cpp returned no embedding for {where}")
            if count > 1:  # the rows must be the outputs that follow, row after row
                last = call("llama_get_embeddings_ith", ctx, index + count - 1)
                stride = int(ffi.cast("uintptr_t", last)) - int(ffi.cast("uintptr_t", row))
                if last == ffi.NULL or width != row_width or stride != 4 * width * (count - 1):
                    raise InvalidParameterError(
                        f"outputs {index}..{index + count - 1} are not consecutive rows of "
                        f"{row_width} floats in the last decode"
                    )
            values = np.frombuffer(ffi.buffer(row, 4 * width * count), np.float32)
            # A copy: the next decode reuses llama.cpp's buffer.
            rows: np.ndarray = values.reshape(count, width).copy()
            return rows

    @property
    def n_ubatch(self) -> int:
        return self.read(lib.llama_n_ubatch)

    # -- LoRA adapters -------------------------------------------------------------------------

    @property
    def lora_adapters(self) -> dict[LoraAdapter, float]:
        return dict(self._adapters)

    def add_weights_guard(self, guard: WeightsGuard) -> None:
        """Have ``guard`` see every change of the adapters (held weakly)."""
        self._guards.add(guard)

    def set_lora_adapters(self, adapters: Mapping[LoraAdapter, float]) -> None:
        """Make these adapters with these scales the default set (an empty mapping: none),
        the one every decode without its own set applies. A guard may refuse first; a change
        bumps ``weights_generation`` and ``kv_fingerprint``, so the KV memory computed with
        the old weights is never reused."""
        self.check_lora(adapters)
        with self._guarded_change():
            with self.exclusive() as ctx:
                self._apply_lora(ctx, adapters)
            for old in self._adapters:
                if old not in self._applied:
                    old._unused_by(self)
            self._adapters = dict(adapters)
            self.weights_generation += 1
            self.kv_fingerprint = self._fingerprint()

    def check_lora(self, adapters: Mapping[LoraAdapter, float]) -> None:
        """Raise unless every adapter is an open adapter of this model, with a finite scale."""
        for adapter, scale in adapters.items():
            if not isinstance(adapter, LoraAdapter):
                raise InvalidParameterError(
                    f"lora keys must be LoraAdapter (Llama.load_lora), not {adapter!r}"
                )
            if adapter.model is not self.model:
                raise InvalidParameterError(f"{adapter!r} was loaded for another model")
            # llama.cpp takes a C float: 1e39 would be inf there.
            if not is_number(scale) or not abs(scale) <= FLOAT32_MAX:
                raise InvalidParameterError(
                    f"the scale of {adapter!r} is {scale!r}, not a number a C float holds"
                )
            adapter.pointer  # noqa: B018 -- raises ClosedHandleError for a closed adapter

    def use_lora(self, lora: Mapping[LoraAdapter, float] | None) -> None:
        """Have llama.cpp apply ``lora`` (None: the default set) from now on, for decodes
        made outside ``decode`` (libmtmd's)."""
        with self.exclusive() as ctx:
            self._apply_lora(ctx, self._adapters if lora is None else lora)

    def _apply_lora(self, ctx: Any, adapters: Mapping[LoraAdapter, float]) -> None:
        """Called holding ``exclusive()``: llama.cpp skips zero scales, so they are left out.
        The order it adds the deltas in follows the order of insertion: one canonical order
        makes a set give the same bits however a caller orders it."""
        ordered = sorted(adapters.items(), key=lambda item: (item[0].identity, id(item[0])))
        wanted = {a: float(s) for a, s in ordered if s != 0}
        self.check_lora(wanted)  # a closed adapter raises, even one llama.cpp still holds
        if wanted == self._applied:
            return
        for adapter in wanted:
            adapter._used_by(self)  # from now on, closing it removes it from this context
        with ExitStack() as stack:  # none of them is freed during the call
            held = [stack.enter_context(a.in_flight()) for a in wanted]
            pointers = ffi.new("struct llama_adapter_lora *[]", held)
            scales = ffi.new("float[]", list(wanted.values()))
            status = call("llama_set_adapters_lora", ctx, pointers, len(wanted), scales)
        if status != 0:
            raise InvalidParameterError(f"llama.cpp refused the adapters (status {status})")
        for old in self._applied:
            if old not in self._adapters:
                old._unused_by(self)
        self._applied = wanted
        for adapter in self._adapters:
            adapter._used_by(self)

    # -- control vectors -----------------------------------------------------------------------

    @property
    def control_vector(self) -> tuple[ControlVector, int, int] | None:
        """The control vector applied and its layer range (inclusive), or None."""
        return self._cvec

    def set_control_vector(
        self, vector: ControlVector | None, layers: tuple[int, int] | None = None
    ) -> None:
        """Add ``vector``'s directions to the hidden state of layers ``layers`` (first and
        last, inclusive; default: every layer it can apply to, 1..n_layer), or remove the
        control vector (None). Checked against the model first; like an adapter change, it
        bumps ``weights_generation`` (refused while parallel slots generate)."""
        model = self.model
        n_layer = model.n_layer
        start, end = layers if layers is not None else (1, n_layer)
        if vector is not None:
            vector.check(model.arch, model.n_embd, n_layer, start, end)
            data = np.ascontiguousarray(vector.directions, dtype=np.float32)
        with self._guarded_change():
            with self.exclusive() as ctx:
                if vector is None:
                    status = call("llama_set_adapter_cvec", ctx, ffi.NULL, 0, 0, -1, -1)
                else:
                    buffer = ffi.from_buffer("float[]", data)
                    status = call("llama_set_adapter_cvec", ctx, buffer, data.size,
                                  vector.n_embd, start, end)  # fmt: skip
            if status != 0:
                reason = log_lines.take_errors() or "see the llamacrab logger"
                raise InvalidParameterError(f"llama.cpp refused the control vector: {reason}")
            self._cvec = None if vector is None else (vector, start, end)
            self.weights_generation += 1
            self.kv_fingerprint = self._fingerprint()

    @contextmanager
    def _guarded_change(self) -> Iterator[None]:
        with ExitStack() as stack:
            if not self.model.closed:  # a closing model ends every generation: nothing to guard
                for guard in list(self._guards):
                    stack.enter_context(guard.weights_change())
            yield

    def _fingerprint(self) -> bytes:
        return self.fingerprint(self._adapters)

    def fingerprint(self, lora: Mapping[LoraAdapter, float], lora_start: int = 0) -> bytes:
        """What, besides the tokens, decides the KV memory computed with the adapters ``lora``
        (from position ``lora_start`` on; before it without adapters). Its parts tell what a
        fingerprint that matches none differs in (``unmatchable``): 4 bytes of the KV
        settings, 4 of the control vector, 8 of the LoRA files (by identity, without scales),
        then 16 of all of it with the model and the scales."""
        settings = "".join(f"{name}={getattr(self.params, name)!r}\n" for name in KV_SETTINGS)
        if self.kv_streams > 1:  # (one stream: what states recorded before they counted)
            settings += f"kv_streams={self.kv_streams}\n"
        cvec = "cvec=none\n"
        if self._cvec is not None:
            vector, start, end = self._cvec
            cvec = f"cvec={vector.identity}@{start}..{end}\n"
        # llama.cpp skips a zero scale; its order of application is its own, not ours.
        adapters = sorted((a.identity, float(s)) for a, s in lora.items() if s != 0)
        scales = "".join(f"lora={identity}@{scale!r}\n" for identity, scale in adapters)
        if adapters and lora_start:
            scales += f"lora_start={lora_start}\n"
        whole = hashlib.sha256(self.model.identity + (settings + cvec + scales).encode())
        return b"".join((
            _digest(settings, 4), _digest(cvec, 4),
            _lora_files(identity for identity, _ in adapters).to_bytes(8, "little"),
            whole.digest()[:16],
        ))  # fmt: skip

    def unmatchable(self, fingerprint: bytes, adapters: Iterable[LoraAdapter]) -> list[str]:
        """What in ``fingerprint`` (a memory's, as ``fingerprint`` makes them) no memory
        computed on this context can match, whatever the scales of ``adapters`` (the LoRA
        files a prompt may use): "KV settings" (rope, KV types, flash attention, swa_full,
        the KV streams: one per sequence without kv_unified, which a state must load into),
        "control vector", "LoRA files" (one it was computed with is not among ``adapters``:
        another file, or the same moved or changed). Empty where some memory can match."""
        mine = self.fingerprint({})
        differs = []
        if fingerprint[:4] != mine[:4]:
            differs.append("KV settings")
        if fingerprint[4:8] != mine[4:8]:
            differs.append("control vector")
        recorded = int.from_bytes(fingerprint[8:16], "little")
        if not _in_xor_span(recorded, [_lora_files([a.identity]) for a in adapters]):
            differs.append("LoRA files")
        return differs

    def remove_lora_adapter(self, adapter: LoraAdapter) -> None:
        if self.closed or (adapter not in self._adapters and adapter not in self._applied):
            return
        if adapter in self._adapters:
            self.set_lora_adapters({a: s for a, s in self._adapters.items() if a is not adapter})
        if adapter in self._applied:  # set for a request: back to the default set
            with self._guarded_change():
                with self.exclusive() as ctx:
                    self._apply_lora(ctx, self._adapters)
                self.weights_generation += 1  # KV computed with it is stale

    # -- KV memory -----------------------------------------------------------------------------

    def memory_generation(self, seq_id: int) -> int:
        """How many times the KV memory of sequence ``seq_id`` was changed other than by a
        decode: KV methods, a loaded state. Not by decoding (what a generation does itself)."""
        return self._memory_changes[seq_id]

    def _memory_changes_now(self, seq_ids: Iterable[int] | None) -> None:
        """Count a change of the memory of ``seq_ids`` (None: every sequence), holding
        ``exclusive()`` right before the call that makes it: counted even if it fails part-way."""
        for seq_id in range(len(self._memory_changes)) if seq_ids is None else seq_ids:
            self._memory_changes[seq_id] += 1

    def clear(self) -> None:
        with self.exclusive() as ctx:
            self._memory_changes_now(None)
            lib.llama_memory_clear(lib.llama_get_memory(ctx), True)  # the data zeroed too
            self._zero_when_removed.clear()

    def note_non_finite(self) -> None:
        """A decode computed a NaN or infinite output. Its cells may hold NaN, and freed cells
        keep their data, which some attention kernels read through the mask (the CPU's flash
        attention tiles, the V product without flash attention): every later output reaching
        them would be NaN too. So each sequence's next removal zeroes the cells it frees."""
        self._zero_when_removed.update(range(self.params.n_seq_max))

    def check_sequence(self, seq_id: int) -> None:
        """Raise InvalidParameterError unless ``seq_id`` is one of this context's sequences."""
        check_range("seq_id", seq_id, INT32_MIN, INT32_MAX)  # what cffi takes
        if not 0 <= seq_id < self.params.n_seq_max:
            raise InvalidParameterError(
                f"sequence {seq_id} outside 0..{self.params.n_seq_max - 1} (n_seq_max)"
            )

    def _check_range(self, seq_id: int, p0: int, p1: int) -> None:
        self.check_sequence(seq_id)
        check_range("p0", p0, INT32_MIN, INT32_MAX)
        check_range("p1", p1, INT32_MIN, INT32_MAX)
        if p0 < 0 or (p1 >= 0 and p1 < p0):
            raise InvalidParameterError(f"invalid position range [{p0}, {p1}) (p1 -1: to the end)")

    def remove(self, seq_id: int, p0: int = 0, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of a sequence (-1: to the end); False if this memory
        cannot remove part of a sequence (recurrent models), or when what is left cannot go on
        at ``p0``: a sliding-window layer's cache no longer holding the window before it (its
        cells are reused once out of the window, unless ``swa_full``). After False, clear the
        sequence before decoding into it again."""
        self._check_range(seq_id, p0, p1)
        with self.exclusive() as ctx:
            memory = lib.llama_get_memory(ctx)
            self._memory_changes_now([seq_id])
            if not self._seq_rm(memory, seq_id, p0, p1):
                return False
            if p1 >= 0 or p0 == 0 or self.n_swa == 0:
                return True
            oldest = int(lib.llama_memory_seq_pos_min(memory, seq_id))  # windowed layers' own
        # The token at p0 attends to positions after p0 - n_swa in windowed layers: every one
        # of them must still be there (one more, as llama-server asks, covers chunked windows).
        return 0 <= oldest <= max(0, p0 - self.n_swa)

    def _seq_rm(self, memory: Any, seq_id: int, p0: int, p1: int) -> bool:
        """llama_memory_seq_rm, under ``exclusive()``: zeroing the cells it frees where
        ``note_non_finite`` marked the sequence (with llamacrab-sys's patch)."""
        zeroing = seq_id in self._zero_when_removed and ZEROES_FREED_CELLS
        removal = "llama_memory_seq_rm_zeroed" if zeroing else "llama_memory_seq_rm"
        if not call(removal, memory, seq_id, p0, p1):
            return False
        self._zero_when_removed.discard(seq_id)
        return True

    def copy(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """Make positions [p0, p1) of sequence ``src`` part of ``dst`` too (shared cells).
        With a memory per sequence (``kv_unified`` False and several sequences) the copy goes
        from one buffer to another: only whole sequences, and it replaces what ``dst`` held."""
        self._check_range(src, p0, p1)
        self.check_sequence(dst)
        separate = not self.params.kv_unified and self.params.n_seq_max > 1
        if separate and src != dst and (p0 != 0 or p1 >= 0):
            # llama.cpp asserts (an abort) on a part of a sequence across buffers.
            raise InvalidParameterError(
                f"positions [{p0}, {p1}) are part of sequence {src}: with a memory per sequence "
                "(kv_unified=False) only whole sequences copy (p0=0, p1=-1)"
            )
        with self.exclusive() as ctx:
            self._memory_changes_now([dst])
            call("llama_memory_seq_cp", lib.llama_get_memory(ctx), src, dst, p0, p1)

    def keep(self, seq_id: int) -> None:
        """Drop every sequence but ``seq_id``."""
        self.check_sequence(seq_id)
        others = [other for other in range(self.params.n_seq_max) if other != seq_id]
        with self.exclusive() as ctx:
            memory = lib.llama_get_memory(ctx)
            self._memory_changes_now(others)
            # llama.cpp's keep frees cells without zeroing them: a marked sequence goes first.
            for other in self._zero_when_removed.intersection(others):
                self._seq_rm(memory, other, -1, -1)
            if self.params.kv_unified or self.params.n_seq_max == 1:
                call("llama_memory_seq_keep", memory, seq_id)
                return
            # With a stream per sequence llama.cpp's keep walks only seq_id's own stream:
            # the others' cells stayed. Each of them is removed instead.
            for other in others:
                self._seq_rm(memory, other, -1, -1)

    def shift(self, seq_id: int, delta: int, p0: int = 0, p1: int = -1) -> None:
        """Add ``delta`` to the positions [p0, p1) of a sequence (context shifting). Cells of a
        KV cache shifted below 0 are dropped; a recurrent state cannot drop its past, so its
        position may not go below 0. No position may go past LAST_POSITION (INT32_MAX - 2^24)."""
        self._check_range(seq_id, p0, p1)
        check_range("delta", delta, INT32_MIN, INT32_MAX)
        with self.exclusive() as ctx:
            memory = self._shiftable_memory(ctx)
            high = int(lib.llama_memory_seq_pos_max(memory, seq_id))  # -1: empty
            top = high if p1 < 0 else min(high, p1 - 1)  # the highest position it may move
            if top >= p0:
                self._check_shift(seq_id, delta, top, recurrent_moves=top == high)
            self._memory_changes_now([seq_id])
            call("llama_memory_seq_add", memory, seq_id, p0, p1, delta)

    def _shiftable_memory(self, ctx: Any) -> Any:
        """The context's memory, where the next decode can rotate its keys to new positions:
        llama.cpp would abort there (after the shift or divide was taken) on keys stored as
        bf16, which ggml's CPU rope does not rotate (ops.cpp), and on a sliding-window model
        whose layers all slide, whose cache for the others has no layer (ggml-backend.cpp)."""
        memory = lib.llama_get_memory(ctx)
        if not lib.llama_memory_can_shift(memory):
            raise InvalidParameterError("this model's memory cannot shift positions")
        if self.params.type_k == "bf16":
            raise InvalidParameterError(
                'keys stored as bf16 cannot be shifted (type_k="bf16"): ggml rotates f32, f16 '
                "or quantized keys"
            )
        attending = [layer.sliding for layer in self.model.kv_layout.layers if layer.key_width]
        if any(attending) and all(attending):
            raise InvalidParameterError(
                f"{self.model.path.name}'s layers all use a sliding window: llama.cpp cannot "
                "shift its positions (its cache for the other layers holds none)"
            )
        return memory

    def _check_shift(self, seq_id: int, delta: int, top: int, recurrent_moves: bool) -> None:
        # llama.cpp adds in int32: past INT32_MAX positions wrapped negative (cells dropped);
        # at INT32_MAX the next decode's next position overflows.
        if top + delta > LAST_POSITION:
            raise InvalidParameterError(
                f"shifting sequence {seq_id} by {delta} takes position {top} past {LAST_POSITION}"
            )
        # A recurrent state (at the sequence's last position) shifted below 0 stayed, unseen.
        if self.recurrent and recurrent_moves and top + delta < 0:
            raise InvalidParameterError(
                f"shifting sequence {seq_id} by {delta} takes its recurrent state's position "
                f"{top} below 0: a recurrent state cannot drop its past (remove the sequence)"
            )

    def divide(self, seq_id: int, divisor: int, p0: int = 0, p1: int = -1) -> None:
        """Integer-divide the positions [p0, p1) of a sequence (self-extend)."""
        self._check_range(seq_id, p0, p1)
        check_range("divisor", divisor, INT32_MIN, INT32_MAX)
        if divisor < 1:
            raise InvalidParameterError(f"divisor must be at least 1, not {divisor}")
        with self.exclusive() as ctx:
            memory = self._shiftable_memory(ctx)
            self._memory_changes_now([seq_id])
            call("llama_memory_seq_div", memory, seq_id, p0, p1, divisor)

    def positions(self, seq_id: int) -> tuple[int, int] | None:
        """The smallest and largest position held for a sequence, or None if it is empty."""
        self.check_sequence(seq_id)
        with self.exclusive() as ctx:
            memory = lib.llama_get_memory(ctx)
            low = int(lib.llama_memory_seq_pos_min(memory, seq_id))
            high = int(lib.llama_memory_seq_pos_max(memory, seq_id))
        return None if low < 0 else (low, high)

    # -- raw state -----------------------------------------------------------------------------

    def state_bytes(self, seq_id: int | None, partial: bool = False) -> bytes:
        """llama.cpp's serialized state: of one sequence, or of the whole context (None: every
        sequence, the logits and embeddings of the last decode). ``partial``: of a sequence's
        sliding-window layers only (what a checkpoint keeps; the other layers can be cut)."""
        return bytes(self.state_view(seq_id, partial))

    def state_view(self, seq_id: int | None, partial: bool = False) -> memoryview:
        """``state_bytes`` as a read-only view of the buffer llama.cpp wrote it into. Copying
        it into bytes costs more than writing it (a 14 MB state: ~8 ms against ~2.5, the copy
        faulting in fresh pages), and the engine snapshots a state after every completion."""
        flags = self._state_flags(seq_id, partial)
        with self.exclusive() as ctx:
            if seq_id is None:
                size = call("llama_state_get_size", ctx)
            else:
                size = call("llama_state_seq_get_size_ext", ctx, seq_id, flags)
            # numpy's memory: it asks for huge pages for large blocks, and faulting in a fresh
            # block page by page cost ~10 ms of a 14 MB state's snapshot (~2 ms this way).
            array = np.empty(size, dtype=np.uint8)
            with ffi.from_buffer("uint8_t[]", array) as buffer:
                if seq_id is None:
                    written = call("llama_state_get_data", ctx, buffer, size)
                else:
                    written = call("llama_state_seq_get_data_ext", ctx, buffer, size, seq_id, flags)
        if written == 0:
            raise StateError(f"llama.cpp could not save the state ({_scope(seq_id)})")
        return array.data[:written].toreadonly()  # the view keeps the array alive

    def load_state_bytes(
        self, data: bytes | memoryview, seq_id: int | None, partial: bool = False
    ) -> None:
        """Replace one sequence (or, for None, the whole context) with a state from
        ``state_bytes`` of the same model; ``partial``: only the sequence's sliding-window
        layers, from ``state_bytes(seq_id, partial=True)``, the other layers left as they are."""
        flags = self._state_flags(seq_id, partial)
        if seq_id is not None:  # a recurrent part of more cells than one aborts llama.cpp
            memory = SequenceMemory.of(self.model, self.params.n_seq_max, self.params.kv_unified)
            check_sequence_state(data, memory, partial)
        # A whole-context state opens with the architecture's name, whose length llama.cpp
        # allocates (zeroed, up to 4 GiB) before it checks that the bytes are there.
        named = int.from_bytes(bytes(data[:4]), "little") if len(data) >= 4 else 0
        if seq_id is None and named > len(data) - 4:
            raise StateError("the state's model name runs past its end (corrupted)")
        # Released on the way out, whatever happens: a view (a state read from disk is one)
        # still exported when a garbage cycle takes it (the frame of an interrupted call,
        # kept by its traceback) makes the collector crash the process (SIGSEGV).
        with self.exclusive() as ctx, ffi.from_buffer("uint8_t[]", data) as buffer:
            self._memory_changes_now(None if seq_id is None else [seq_id])
            if seq_id is None:
                read = call("llama_state_set_data", ctx, buffer, len(buffer))
            else:
                if not partial:  # (llama.cpp's own removal would not zero a marked one's)
                    self._seq_rm(lib.llama_get_memory(ctx), seq_id, 0, -1)
                read = call("llama_state_seq_set_data_ext", ctx, buffer, len(buffer), seq_id, flags)
        if read == 0:
            reason = log_lines.take_errors() or "see the llamacrab logger"
            if "n_stream mismatch" in reason:
                reason += (
                    " (the state comes from a context with another number of KV streams: a "
                    "one-slot Llama has one, parallel slots one each unless kv_unified=True)"
                )
            raise StateError(f"llama.cpp rejected the state ({_scope(seq_id)}): {reason}")
        self._check_loaded_positions(seq_id)

    def _check_loaded_positions(self, seq_id: int | None) -> None:
        """StateError, the memory cleared, where a loaded state put a token past
        LAST_POSITION: the next decode would overflow its next position. (No range of
        positions reaches INT32_MAX, their end being exclusive: only a clear removes it.)"""
        sequences = range(self.params.n_seq_max) if seq_id is None else [seq_id]
        with self.exclusive() as ctx:
            memory = lib.llama_get_memory(ctx)
            past = [s for s in sequences if lib.llama_memory_seq_pos_max(memory, s) > LAST_POSITION]
            if past:
                self._memory_changes_now(None)
                lib.llama_memory_clear(memory, True)
        if past:
            raise StateError(
                f"the state puts a token of sequence {past[0]} past position {LAST_POSITION}, "
                "the highest llama.cpp's int32 arithmetic leaves room for (corrupted or "
                "altered); the context's memory is cleared"
            )

    def _state_flags(self, seq_id: int | None, partial: bool) -> int:
        """llama.cpp's flags for a state of ``seq_id`` (None: the context), checked first."""
        if seq_id is not None:
            self.check_sequence(seq_id)
        elif partial:
            raise InvalidParameterError("a partial state is one sequence's, not the context's")
        return _PARTIAL_ONLY if partial else 0

    def __repr__(self) -> str:
        return f"<Context n_ctx={self.n_ctx}{' closed' if self.closed else ''}>"


def _check_quantized_keys(model: Model, c_params: Any) -> None:
    """Quantized keys need heads a whole number of blocks long: llama.cpp checks that only
    with flash attention, and without it computed every attention score as 0 (the tiny
    model's heads of 16 in q4_0's blocks of 32: the same logits whatever the prompt)."""
    if c_params.flash_attn_type != lib.LLAMA_FLASH_ATTN_TYPE_DISABLED:
        return
    block = int(lib.ggml_blck_size(c_params.type_k))
    heads = {layer.key_head for layer in model.kv_layout.layers if layer.key_width}
    if block > 1 and any(head % block for head in heads):
        raise InvalidParameterError(
            f"keys of type {ffi.string(lib.ggml_type_name(c_params.type_k)).decode()} come in "
            f"blocks of {block}, which {model.path.name}'s key heads ({sorted(heads)}) do not "
            "divide into: use another type_k"
        )


def _check_encoder_decoder(model: Model, params: ContextParams) -> None:
    """An encoder-decoder model (T5) generates (``encode``, then decodes), one sequence at a
    time: llama.cpp keeps one encoder output per context, and its graph for several sequences
    asserts (an abort, at creation). Its embeddings, which llama.cpp would take from the
    decoder, are refused: its encoder alone (t5encoder) embeds."""
    if not model.encoder_decoder:
        return
    if params.embeddings:  # first: an embedding server asks for many sequences too
        raise ContextError(
            f"{model!r} ({model.arch}) is an encoder-decoder model: embeddings from it are not "
            "supported (its encoder alone, a t5encoder GGUF, embeds); it generates text"
        )
    if params.n_seq_max > 1:
        raise ContextError(
            f"{model!r} ({model.arch}) is an encoder-decoder model: llama.cpp keeps one encoder "
            f"output per context, so it runs one sequence (n_seq_max {params.n_seq_max}; "
            "parallel slots: one)"
        )


def _check_host_memory(model: Model, params: ContextParams, c_params: Any) -> None:
    """llama.cpp allocates a context's KV cache, and zero-fills it, before anything can fail
    cleanly: 48 bytes of host bookkeeping per cell (a position, a shift, an M-RoPE position, a
    256-bit set of sequences), then the keys and values of every layer, in host memory for the
    layers it does not offload; only then the compute buffers, whose attention mask (a host
    input, f16 at least) has a column per cell of a stream for each token of a micro-batch, and
    the worst-case micro-batch it reserves them with (UBATCH_TOKEN_BYTES a token, every model).
    n_ctx 2^31 took 8 GB and 15 s here before std::bad_alloc; n_ctx 2^26 of the tiny model
    19 GiB and 60 s of cells and cache before its 64 GiB mask failed (the OOM killer on a
    smaller machine); n_ubatch 2^32 - 256 of a Mamba model 22.7 GB of micro-batch before the OOM
    killer. Refuse a context whose host part exceeds what the machine has available, or what
    the process's cgroup limit leaves where that is less (a container's: its OOM killer
    strikes first), counting what the process holds already (another context, say). Without
    ``kv_unified`` each of the n_seq_max sequences has a stream of its own, of n_ctx / n_seq_max
    cells padded to 256 (n_ctx 256 for 256 sequences: 65,536 cells). A recurrent model's memory
    has a cell per sequence, not per position."""
    n_ctx = pad_cells(c_params.n_ctx or model.n_ctx_train)
    streams, stream_cells = kv_streams(n_ctx, c_params.n_seq_max, params.kv_unified)
    layout = model.kv_layout
    recurrent = lib.llama_model_is_recurrent(model.pointer)
    cells = 0 if recurrent else streams * stream_cells * KV_CELL_BYTES
    # A sliding-window stream keeps a window per sequence it holds (all of them when unified).
    sharing = c_params.n_seq_max if params.kv_unified else 1
    sliding = layout.sliding_cells(stream_cells, sharing, c_params.n_ubatch, params.swa_full)
    host_layers = _host_layers(model, params)
    kv = streams * layout.bytes(
        stream_cells, sliding, c_params.type_k, c_params.type_v, n_layers=host_layers
    )
    # The micro-batch's tokens are split among the streams, each masked against its own cells.
    mask = stream_cells * c_params.n_ubatch * 2 if layout.attends else 0
    # A causal model's (one with KV or recurrent memory) n_ubatch is cut to the asked n_ctx.
    causal = layout.attends or recurrent
    ubatch_tokens = min(c_params.n_ubatch, c_params.n_ctx) if causal else c_params.n_ubatch
    ubatch = ubatch_tokens * UBATCH_TOKEN_BYTES
    needed = cells + kv + mask + ubatch
    left = host_memory_left()
    if needed > left.amount:
        raise ContextError(
            f"n_ctx {streams * stream_cells} needs {needed / 2**30:.1f} GiB of host memory "
            f"before its first token: {cells / 2**30:.1f} GiB for its KV cells' bookkeeping "
            f"({streams} stream(s) of {stream_cells} cells), {kv / 2**30:.1f} GiB for keys and "
            f"values ({params.type_k}/{params.type_v}), {mask / 2**30:.1f} GiB for the attention "
            f"mask and {ubatch / 2**30:.1f} GiB for the reserved micro-batch of "
            f"{ubatch_tokens} tokens; {left.source} {left.amount / 2**30:.1f} GiB"
        )


def _host_layers(model: Model, params: ContextParams) -> int:
    """How many layers, from the first, keep their KV cache in host memory: those llama.cpp
    does not offload (it offloads the last n_gpu_layers, the output layer counting as one, to
    a GPU or an RPC worker when there is one), or all without ``offload_kqv``."""
    n_layer = len(model.kv_layout.layers)
    offloading = accelerator_present() or bool(model.params.rpc_servers)
    if not params.offload_kqv or not offloading:
        return n_layer
    n_gpu_layers = model.params.n_gpu_layers
    if n_gpu_layers is None or n_gpu_layers < 0:
        return 0
    return max(n_layer + 1 - n_gpu_layers, 0)


def _fit_graph(model: Model, params: ContextParams, c_params: Any) -> None:
    """Refuse (or avoid) the contexts an architecture's graph aborts on whatever the file
    (gguf.archs.TARGET_DRAFTERS, EMBEDDINGS_ABORT, NO_FLASH_ATTENTION)."""
    arch = model.arch
    if arch in archs.TARGET_DRAFTERS:
        raise ContextError(
            f"{model!r} ({arch}) drafts for a target model: it reads the target's hidden "
            "states through a second context (llama.cpp's ctx_other), which llamacrab does not "
            "link; it cannot run alone"
        )
    if arch in archs.EMBEDDINGS_ABORT and params.embeddings:
        raise InvalidParameterError(
            f"embeddings=True: {arch} models give no embeddings (llama.cpp reads them "
            "hyper_connection.count times wider than its graph makes them, an abort); they "
            "generate text"
        )
    if arch in archs.NO_FLASH_ATTENTION:
        if params.flash_attn == "on":
            raise InvalidParameterError(
                f'flash_attn="on": {arch} models abort with flash attention on batches of '
                'more than one token in llama.cpp; use "off" or "auto"'
            )
        c_params.flash_attn_type = FLASH_ATTN["off"]


def _check_rope_freq_base(model: Model, params: ContextParams) -> None:
    """deepseek2-ocr's graph asserts (an abort) that the context's rope base, as a float, is
    10000: a user rope_freq_base must be 10000 too (0 keeps the file's value, or its
    kv_overrides value, both of which validate_gguf checked)."""
    arch, base = model.arch, params.rope_freq_base
    if arch != "deepseek2-ocr" or base == 0:
        return
    # As a C float (the assert's operand): only 10000.0f itself is within 1e-4 of 10000.
    if not (abs(base - 10000.0) < 1e-3 and float(np.float32(base)) == 10000.0):
        raise InvalidParameterError(
            f"rope_freq_base = {base}: {arch} models need a rope base of 10000 (llama.cpp "
            "asserts it)"
        )


def _graph_sampling_pays(model: Model) -> bool:
    """What graph_sampling="auto" resolves to: sample inside the graph when llama.cpp computes
    the output layer on a GPU of this machine (it offloads the output layer first, to the last
    device; local GPUs come after any RPC workers), where the vocabulary's logits need not be
    copied to the host. Not on the CPU backend, where the pinned graph's sampling ops run on one
    thread (~1.8 ms a token for Gemma 3's vocabulary, docs/graph-sampling.md), nor on RPC
    workers: a worker still sends 1 MiB a token back with the chain in its graph (measured),
    so nothing is saved, and one computing on its CPU is slower."""
    return model.params.n_gpu_layers != 0 and accelerator_present()


def _scope(seq_id: int | None) -> str:
    return "whole context" if seq_id is None else f"sequence {seq_id}"


def _digest(text: str, size: int) -> bytes:
    return hashlib.sha256(text.encode()).digest()[:size]


def _lora_files(identities: Iterable[str]) -> int:
    """The LoRA files a memory was computed with, as 64 bits: the XOR of each file's (so that
    whether a recorded set is made of some of a context's files can be told, _in_xor_span)."""
    combined = 0
    for identity in identities:
        combined ^= int.from_bytes(_digest(f"lora={identity}", 8), "little")
    return combined


def _in_xor_span(value: int, vectors: Iterable[int]) -> bool:
    """Whether ``value`` is the XOR of some of ``vectors`` (none: 0). Gaussian elimination
    over bits: a basis whose members each lead with a bit of their own, largest first."""
    basis: list[int] = []
    for vector in vectors:
        for member in basis:
            vector = min(vector, vector ^ member)  # clears ``member``'s leading bit if set
        if vector:
            basis = sorted([*basis, vector], reverse=True)
    for member in basis:
        value = min(value, value ^ member)
    return value == 0
