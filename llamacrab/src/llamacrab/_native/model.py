"""Model: wraps ``struct llama_model`` (load, metadata, free); parent of contexts and samplers."""

from __future__ import annotations

import hashlib
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llamacrab._exceptions import InvalidModelError, InvalidParameterError, ModelLoadError
from llamacrab._field_types import (
    FLOAT32_MAX,
    INT32_MAX,
    INT32_MIN,
    check_field_types,
    check_range,
    file_path,
    is_number,
)
from llamacrab._native import backend as _backend
from llamacrab._native.call import c_path, c_string, call, ffi, lib, read_string
from llamacrab._native.devices import accelerator_present, warn_if_no_gpu
from llamacrab._native.fork import cached_property
from llamacrab._native.gguf import archs
from llamacrab._native.gguf.check import validate_gguf
from llamacrab._native.gguf.overrides import applied_overrides
from llamacrab._native.gguf_reader import split_parts
from llamacrab._native.handle import NativeHandle
from llamacrab._native.host_limits import host_memory_left
from llamacrab._native.kv_layout import KvLayout, kv_layout
from llamacrab._native.logging import log_lines
from llamacrab._native.rpc import offload_devices, parse_endpoints
from llamacrab._native.signals import Hold, held_signals
from llamacrab._native.vocab import Vocab, VocabFacts
from llamacrab._native.weights_sample import weights_sample
from llamacrab_sys import progress_callback

SPLIT_MODES = {
    "none": lib.LLAMA_SPLIT_MODE_NONE,
    "layer": lib.LLAMA_SPLIT_MODE_LAYER,
    "row": lib.LLAMA_SPLIT_MODE_ROW,
}

KvOverrideValue = int | float | bool | str


@dataclass(frozen=True, kw_only=True)
class ModelParams:
    """How to load a model. ``None`` keeps llama.cpp's default."""

    n_gpu_layers: int | None = None
    split_mode: str | None = None
    main_gpu: int | None = None
    tensor_split: tuple[float, ...] | None = None
    use_mmap: bool = True
    use_mlock: bool = False
    vocab_only: bool = False
    check_tensors: bool = False
    use_extra_bufts: bool = True  # CPU weight repacking (faster kernels) where available
    kv_overrides: Mapping[str, KvOverrideValue] | None = None
    # ggml RPC workers ("host:port") to offload layers to, probed before llama.cpp sees them.
    # A list, or "host:port,host:port" as llama.cpp's --rpc (a tuple once checked).
    rpc_servers: Sequence[str] | str | None = None
    rpc_timeout: float = 5.0  # seconds each worker has to answer the probe

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.rpc_servers is not None:
            servers = self.rpc_servers
            items = servers.split(",") if isinstance(servers, str) else servers
            object.__setattr__(self, "rpc_servers", tuple(s.strip() for s in items if s.strip()))
            parse_endpoints(self.rpc_servers)
        if not self.rpc_timeout > 0:
            raise InvalidParameterError(f"rpc_timeout must be > 0, not {self.rpc_timeout}")
        if self.split_mode is not None and self.split_mode not in SPLIT_MODES:
            raise InvalidParameterError(
                f"split_mode must be one of {sorted(SPLIT_MODES)}, not {self.split_mode!r}"
            )
        if self.tensor_split is not None and len(self.tensor_split) > lib.llama_max_devices():
            raise InvalidParameterError(
                f"tensor_split has {len(self.tensor_split)} entries; this build supports "
                f"{lib.llama_max_devices()} devices"
            )
        for share in self.tensor_split or ():
            if not is_number(share) or not 0 <= share <= FLOAT32_MAX:
                raise InvalidParameterError(
                    f"tensor_split holds shares (finite numbers >= 0), not {share!r}"
                )
        for name in ("n_gpu_layers", "main_gpu"):
            check_range(name, getattr(self, name), INT32_MIN, INT32_MAX)


def _load_mode(params: ModelParams) -> int:
    if params.use_mmap and params.use_mlock:
        return int(lib.LLAMA_LOAD_MODE_MMAP_MLOCK)
    if params.use_mmap:
        return int(lib.LLAMA_LOAD_MODE_MMAP)
    return int(lib.LLAMA_LOAD_MODE_MLOCK if params.use_mlock else lib.LLAMA_LOAD_MODE_NONE)


def _parts(file: Path, metadata: Mapping[str, Any]) -> list[Path]:
    """The files of the model: ``file``, or every part of a split one."""
    count = metadata.get("split.count", 1)
    return split_parts(file, count) if isinstance(count, int) and count > 1 else [file]


def _check_weights_fit(file: Path, params: ModelParams, metadata: Mapping[str, Any]) -> None:
    """Without mmap, llama.cpp reads every weight into memory it allocates (for a model that
    stays on the CPU: no accelerator, no RPC worker); past a container's memory limit that is
    the OOM killer, not an error. Refuse weights larger than the memory this process may still
    take (another model in it counts).
    (Mapped weights are page cache, which the kernel can drop: no limit for them.)"""
    if params.use_mmap or params.rpc_servers or accelerator_present():
        return
    weights = sum(part.stat().st_size for part in _parts(file, metadata))
    left = host_memory_left()
    if weights > left.amount:
        raise ModelLoadError(
            f"{file}: its {weights / 2**30:.1f} GiB of weights do not fit in memory without "
            f"mmap ({left.source} {left.amount / 2**30:.1f} GiB): load it with use_mmap=True"
        )


def kv_override_array(overrides: Mapping[str, KvOverrideValue]) -> Any:
    """A C array of overrides, terminated by an entry with an empty key."""
    array = ffi.new("struct llama_model_kv_override[]", len(overrides) + 1)
    for entry, (key, value) in zip(array, overrides.items(), strict=False):
        raw_key = c_string(key, "kv_overrides key")
        if not 0 < len(raw_key) < 128:
            raise InvalidParameterError(f"kv_overrides key must be 1-127 bytes: {key!r}")
        entry.key = raw_key
        if isinstance(value, bool):
            entry.tag, entry.val_bool = lib.LLAMA_KV_OVERRIDE_TYPE_BOOL, value
        elif isinstance(value, int):
            check_range(f"kv_overrides[{key!r}]", value, -(2**63), 2**63 - 1)
            entry.tag, entry.val_i64 = lib.LLAMA_KV_OVERRIDE_TYPE_INT, value
        elif isinstance(value, float):
            entry.tag, entry.val_f64 = lib.LLAMA_KV_OVERRIDE_TYPE_FLOAT, value
        elif isinstance(value, str) and len(c_string(value, "kv_overrides value")) < 128:
            entry.tag, entry.val_str = lib.LLAMA_KV_OVERRIDE_TYPE_STR, value.encode()
        else:
            raise InvalidParameterError(f"kv_overrides[{key!r}] has unsupported value {value!r}")
    return array


# Live models offloaded to RPC workers: their connections are ggml's, shared by address.
_rpc_models: weakref.WeakSet[Model] = weakref.WeakSet()


class _Progress:
    """A load's progress callback: the caller's, after the handlers of any signal held
    meanwhile. An exception from either cancels the load; ``error`` keeps it for the caller."""

    def __init__(self, user: Callable[[float], object] | None, hold: Hold | None) -> None:
        self.user = user
        self.hold = hold
        self.error: BaseException | None = None

    def __call__(self, fraction: float) -> bool:
        try:
            if self.hold is not None:
                self.hold.run_caught()  # a Ctrl-C stops the load here, not at its end
            return self.user is None or self.user(fraction) is not False
        except BaseException as error:  # it cannot cross llama.cpp's frames
            self.error = error
            return False


def _load_weights(file: Path, c_params: Any, progress: _Progress) -> Any:
    """``llama_model_load_from_file``: the new model's pointer, or the reason it has none."""
    callback = progress_callback(progress)  # held here for the whole call
    c_params.progress_callback = callback.function
    c_params.progress_callback_user_data = callback.user_data
    pointer = call("llama_model_load_from_file", c_path(file, "model path"), c_params)
    if pointer == ffi.NULL:
        if progress.error is not None:
            raise progress.error
        reason = log_lines.take_errors() or "see the llamacrab logger for details"
        raise ModelLoadError(f"llama.cpp could not load {file}: {reason}")
    return pointer


class Model(NativeHandle):
    """A loaded GGUF model. Closing it closes its contexts and samplers first."""

    kind = "model"

    def __init__(self, pointer: Any, path: Path, params: ModelParams, kv_layout: KvLayout,
                 weights: bytes = b"", position_rows: int | None = None,
                 overridden: Mapping[str, str] | None = None,
                 classifier_rows: int | None = None) -> None:  # fmt: skip
        super().__init__(pointer, lib.llama_model_free, None)
        self.path = path
        self.params = params
        # The kv_overrides llama.cpp applied, rendered as it renders metadata: its getters
        # (``metadata``) show the file's values, which the checks of this model must not trust.
        self._overridden = dict(overridden or {})
        self._weights_sample = weights  # weights_sample.py: part of the identity
        # A learned position table's rows (BERT, GPT-2): the positions a sequence may take.
        self.position_rows = position_rows
        # The classification head's outputs (None: no head), which rank pooling reads.
        self.classifier_rows = classifier_rows
        # What each layer's KV cache holds per cell (contexts are checked against the memory).
        self.kv_layout = kv_layout
        # The Vocab holds its model, so the model holds it weakly: a reference cycle would
        # keep a dropped model (its whole memory) until the cyclic collector next ran.
        self._vocab_facts = VocabFacts()
        self._vocab: weakref.ref[Vocab] | None = None
        _backend.register_root(self)
        # The addresses as handed to ggml-rpc, which keys its connections by them.
        self.rpc_endpoints: tuple[str, ...] = ()
        if params.rpc_servers and not params.vocab_only:
            self.rpc_endpoints = tuple(str(e) for e in parse_endpoints(params.rpc_servers))
            _rpc_models.add(self)

    @property
    def vocab(self) -> Vocab:
        """The model's tokenizer (the same object while anything holds it)."""
        vocab = None if self._vocab is None else self._vocab()
        if vocab is None:
            pre = self._loaded_metadata.get("tokenizer.ggml.pre", "")
            vocab = Vocab(self, self._vocab_facts, pre)
            self._vocab = weakref.ref(vocab)
        return vocab

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        params: ModelParams | None = None,
        progress: Callable[[float], object] | None = None,
    ) -> Model:
        """Load ``path``. ``progress(fraction)`` may return False to cancel loading."""
        _backend.ensure_initialised()
        params = params or ModelParams()
        file = file_path("the model path", path)
        # Their types checked first: the header is checked again with them.
        overrides = kv_override_array(params.kv_overrides) if params.kv_overrides else None
        reader, metadata = validate_gguf(file, overrides=params.kv_overrides)
        layout = kv_layout(reader, str(metadata.get("general.architecture", "")), metadata)
        weights = weights_sample(_parts(file, metadata))  # the bytes llama.cpp is about to read
        if not params.vocab_only:  # (no weights: nothing to offload)
            warn_if_no_gpu(params.n_gpu_layers, remote=bool(params.rpc_servers))
            _check_weights_fit(file, params, metadata)
        c_params = lib.llama_model_default_params()
        for field in ("n_gpu_layers", "main_gpu"):
            if getattr(params, field) is not None:
                setattr(c_params, field, getattr(params, field))
        if params.split_mode is not None:
            c_params.split_mode = SPLIT_MODES[params.split_mode]
        c_params.load_mode = _load_mode(params)
        c_params.vocab_only = params.vocab_only
        c_params.check_tensors = params.check_tensors
        c_params.use_extra_bufts = params.use_extra_bufts
        keepalive: list[Any] = []
        if params.tensor_split is not None:
            split = ffi.new("float[]", lib.llama_max_devices())
            split[0 : len(params.tensor_split)] = list(params.tensor_split)
            c_params.tensor_split = split
            keepalive.append(split)
        if params.rpc_servers and not params.vocab_only:  # (no weights: no worker needed)
            connected = {e for m in list(_rpc_models) if not m.closed for e in m.rpc_endpoints}
            devices = offload_devices(params.rpc_servers, params.rpc_timeout, connected)
            c_params.devices = devices
            keepalive.append(devices)
        if overrides is not None:
            c_params.kv_overrides = overrides
            keepalive.append(overrides)
        log_lines.take_errors()
        model: Model | None = None
        try:
            with held_signals() as hold:  # nothing lands between the load and the handle
                pointer = _load_weights(file, c_params, _Progress(progress, hold))
                overridden = applied_overrides(metadata, params.kv_overrides or {})
                model = cls(pointer, file, params, layout, weights, reader.position_rows,
                            overridden, reader.classifier_rows)  # fmt: skip
            model.vocab.check_usable()
        except BaseException as error:
            if model is None:
                raise
            model.close()  # not returned to anyone (a Ctrl-C during the load comes here too)
            if isinstance(error, InvalidModelError):
                raise InvalidModelError(f"{file}: {error}") from None
            raise
        # Overrides and split arrays are read during load only; nothing C keeps points into them.
        return model

    # -- information -------------------------------------------------------------------------

    @property
    def description(self) -> str:
        with self.in_flight() as model:
            return read_string(lambda buf, size: lib.llama_model_desc(model, buf, size))

    @property
    def n_params(self) -> int:
        return self.read(lib.llama_model_n_params)

    @property
    def size(self) -> int:
        """Total size of the weights in bytes."""
        return self.read(lib.llama_model_size)

    @property
    def n_ctx_train(self) -> int:
        return self.read(lib.llama_model_n_ctx_train)

    @property
    def ftype(self) -> str:
        """The weights' type as llama.cpp names it ("Q4_K - Medium", "F16", ...)."""
        name = lib.llama_ftype_name(self.read(lib.llama_model_ftype))
        return str(ffi.string(name).decode("utf-8", "replace"))

    @property
    def n_swa(self) -> int:
        """The sliding-window size of its windowed attention layers (0: none)."""
        return self.read(lib.llama_model_n_swa)

    @property
    def recurrent(self) -> bool:
        """Whether its memory keeps a recurrent state (Mamba, RWKV; hybrids such as Jamba or
        Granite 4 beside their attention): one state per sequence, which cannot be cut back
        to an earlier position."""
        with self.in_flight() as model:
            return bool(lib.llama_model_is_recurrent(model) or lib.llama_model_is_hybrid(model))

    @property
    def encoder_decoder(self) -> bool:
        """Whether it is an encoder-decoder model (T5): its encoder reads the prompt, and its
        decoder generates from a start token, attending to what the encoder computed."""
        with self.in_flight() as model:
            return bool(lib.llama_model_has_encoder(model) and lib.llama_model_has_decoder(model))

    @property
    def decoder_start_token(self) -> int:
        """The token an encoder-decoder model's decoder starts from: the model's own, else BOS
        (as llama.cpp's tools choose); InvalidParameterError for a model with neither."""
        token = self.read(lib.llama_model_decoder_start_token)
        if token < 0:
            bos = self.vocab.bos
            if bos is None:
                raise InvalidParameterError(
                    f"{self!r} names no decoder start token and has no BOS token to start from"
                )
            token = bos
        if token >= self.vocab.n_tokens:  # a kv_override of it, say
            raise InvalidParameterError(
                f"{self!r}'s decoder start token ({self.arch}.decoder_start_token_id) is "
                f"{token}, outside its vocabulary of {self.vocab.n_tokens}"
            )
        return token

    @property
    def needs_checkpoints(self) -> bool:
        """Whether a memory cut back within what it holds goes on only from a checkpoint:
        sliding-window layers have dropped the window before it, a recurrent state all of it."""
        return self.n_swa > 0 or self.recurrent

    @property
    def n_embd(self) -> int:
        return self.read(lib.llama_model_n_embd)

    @property
    def n_embd_out(self) -> int:
        """The width of the embeddings the model outputs."""
        return self.read(lib.llama_model_n_embd_out)

    @property
    def n_cls_out(self) -> int:
        """The classifier head's outputs (one score for a reranker)."""
        return self.read(lib.llama_model_n_cls_out)

    @property
    def classifier_labels(self) -> tuple[str, ...]:
        """The name of each classifier output (GGUF ``<arch>.classifier.output_labels``, a
        Hugging Face config's ``id2label``); an unnamed (or empty) one is its index as text, as
        llama.cpp's embedding tool prints it."""
        with self.in_flight() as model:
            labels = [lib.llama_model_cls_label(model, i)
                      for i in range(lib.llama_model_n_cls_out(model))]  # fmt: skip
            names = [b"" if label == ffi.NULL else ffi.string(label) for label in labels]
        return tuple(name.decode(errors="replace") or str(i) for i, name in enumerate(names))

    @property
    def n_layer(self) -> int:
        return self.read(lib.llama_model_n_layer)

    @cached_property
    def causal(self) -> bool:
        """False for encoder-style models (BERT): they attend both ways within a sequence."""
        return self._loaded_metadata.get(f"{self.arch}.attention.causal", "true") != "false"

    @property
    def arch(self) -> str:
        """The architecture's name (``general.architecture``: "llama", "gemma3", "bert", ...),
        as llama.cpp read it (a kv_override of it included)."""
        self.pointer  # noqa: B018 - raises ClosedHandleError once the model is closed
        return self._loaded_metadata.get("general.architecture", "")

    def computes_logits(self, embeddings: bool) -> bool:
        """Whether a decode in a context with ``embeddings`` on or off writes logits to generate
        from: never for an embedding model whose graph ends without a language-model head (BERT,
        gemma-embedding, ...: gguf.archs.NO_LOGITS), and not with embeddings on for the graphs
        that skip their head there (LFM2: gguf.archs.NO_LOGITS_WITH_EMBEDDINGS)."""
        if embeddings and self.arch in archs.NO_LOGITS_WITH_EMBEDDINGS:
            return False
        return self.arch not in archs.NO_LOGITS

    @cached_property
    def identity(self) -> bytes:
        """A digest of the metadata (its kv_overrides applied), the weights' layout and a
        sample of the files' bytes (read at load): saved states carry it, so one is never
        loaded into a different model, a fine-tune of the same base included."""
        self.pointer  # noqa: B018 - raises ClosedHandleError once the model is closed
        digest = hashlib.sha256()
        for key, value in sorted(self._loaded_metadata.items()):
            digest.update(f"{key}={value}\n".encode())
        digest.update(f"{self.n_params}:{self.size}:{self.vocab.n_tokens}".encode())
        digest.update(self._weights_sample)
        return digest.digest()

    @property
    def metadata(self) -> dict[str, str]:
        """Every GGUF metadata key with its value as llama.cpp renders it (a copy)."""
        self.pointer  # noqa: B018 - raises ClosedHandleError once the model is closed
        return dict(self._metadata)

    @cached_property
    def _loaded_metadata(self) -> dict[str, str]:
        """``metadata`` as llama.cpp read it at load: with the kv_overrides it applied."""
        return self._metadata | self._overridden

    @cached_property
    def _metadata(self) -> dict[str, str]:
        # Read from C once: it never changes, and chat templates consult it on every call.
        result = {}
        with self.in_flight() as model:  # closing from another thread waits for the reads
            for i in range(lib.llama_model_meta_count(model)):
                key = read_string(
                    lambda b, n, i=i: lib.llama_model_meta_key_by_index(model, i, b, n)
                )
                value = read_string(
                    lambda b, n, i=i: lib.llama_model_meta_val_str_by_index(model, i, b, n)
                )
                result[key] = value
        return result

    def chat_template(self, name: str | None = None) -> str | None:
        """The GGUF chat template (``tokenizer.chat_template[.name]``), or None if absent."""
        raw_name = ffi.NULL if name is None else c_string(name, "template name")
        with self.in_flight() as model:  # the text is the model's memory
            template = lib.llama_model_chat_template(model, raw_name)
            return None if template == ffi.NULL else ffi.string(template).decode("utf-8", "replace")

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.description
        return f"<Model {self.path.name} ({state})>"
