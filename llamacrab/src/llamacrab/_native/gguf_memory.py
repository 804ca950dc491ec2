"""Estimate the memory a model and one context will take, from the GGUF header alone.

Read before loading (a registry keeps to its memory budget with it): the weights are the sum of
the tensors' sizes; the KV memory is what llama.cpp allocates for the context's cells in each
attention layer (sliding-window layers get fewer cells unless ``swa_full``); the compute buffer
is dominated by the logits of one micro-batch (``n_ubatch`` x vocabulary floats) plus the
activations, and without flash attention the attention scores; checkpoints are the windowed
layers' cells of one window, ``ctx_checkpoints`` per sequence, which a sliding-window model
takes while prompts are decoded. Recurrent state (and a recurrent model's checkpoints of it)
and backend repacking are not counted.
tests/test_registry.py compares the estimate with the buffer sizes llama.cpp logs after loading
and with a checkpoint's size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llamacrab._native.call import lib
from llamacrab._native.context import KV_TYPES, ContextParams
from llamacrab._native.gguf.overrides import overridden
from llamacrab._native.gguf_reader import GgufArray, read_file, split_parts, uint
from llamacrab._native.kv_layout import kv_layout, kv_streams, pad_cells

_FLOAT = 4


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a model will take: ``weights`` (plus a projector), ``kv`` (the context's KV
    memory) and ``compute`` (compute and output buffers), allocated when it loads; and at most
    ``checkpoints`` more in host memory once prompts come (sliding-window models only)."""

    weights: int
    kv: int
    compute: int
    checkpoints: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.checkpoints


def _tensor_bytes(tensors: list[Any]) -> int:
    return sum(lib.ggml_row_size(t, dims[0]) * math.prod(dims[1:]) for _, dims, t, _ in tensors)


def _file_header(path: Path) -> tuple[Any, dict[str, Any], list[Any]]:
    reader, metadata, tensors = read_file(path)
    count = metadata.get("split.count", 1)
    if isinstance(count, int) and count > 1:
        for part in split_parts(path, count)[1:]:
            tensors = tensors + read_file(part)[2]
    return reader, metadata, tensors


def _kv_bytes(
    reader: Any, arch: str, metadata: dict[str, Any], params: ContextParams, n_ctx: int
) -> tuple[int, int]:
    """The KV memory, and the most its checkpoints take: a stream per sequence without
    ``kv_unified``, each with its own sliding window (as Context's host-memory check counts)."""
    layout = kv_layout(reader, arch, metadata)
    n_ubatch = min(params.n_ubatch, params.n_batch)
    streams, stream_cells = kv_streams(n_ctx, params.n_seq_max, params.kv_unified)
    sharing = params.n_seq_max if params.kv_unified else 1  # sequences a stream's window holds
    sliding = layout.sliding_cells(stream_cells, sharing, n_ubatch, params.swa_full)
    type_k, type_v = KV_TYPES[params.type_k], KV_TYPES[params.type_v]
    total = streams * layout.bytes(stream_cells, sliding, type_k, type_v)
    # A checkpoint holds one window of cells; none are taken where the window spans n_ctx.
    if not layout.window or layout.window >= n_ctx:
        return total, 0
    windowed_cell = sum(
        layout.layer_bytes(layer, type_k, type_v) for layer in layout.layers if layer.sliding
    )
    return total, windowed_cell * layout.window * params.n_seq_max * params.ctx_checkpoints


def _compute_bytes(
    arch: str, metadata: dict[str, Any], params: ContextParams, n_ctx: int, logits: bool
) -> int:
    n_embd = uint(metadata, f"{arch}.embedding_length") or 0
    tokens = metadata.get("tokenizer.ggml.tokens")
    n_vocab = tokens.count if isinstance(tokens, GgufArray) else 0
    n_ubatch = max(min(params.n_ubatch, params.n_batch, n_ctx), params.n_seq_max)
    n_ff = uint(metadata, f"{arch}.feed_forward_length") or 0
    per_token = 2 * n_embd + (n_vocab if logits else n_ff)
    if params.flash_attn == "off":
        head_count = metadata.get(f"{arch}.attention.head_count")
        n_head = head_count if isinstance(head_count, int) else 1
        per_token += n_ctx * n_head  # the attention scores of one layer
    output = params.n_seq_max * (n_vocab + (n_embd if params.embeddings else 0))
    return int((n_ubatch * per_token + output) * _FLOAT)


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata of a GGUF file (large arrays keep only their length), validated as a
    header; raises what validation raises."""
    return read_file(Path(path))[1]


def estimate_memory(
    path: str | Path,
    params: ContextParams | None = None,
    projector: str | Path | None = None,
    overrides: Mapping[str, int | float | str] | None = None,
) -> MemoryEstimate:
    """The memory ``path`` (the first part of a split model) and a context with ``params``
    will take, in bytes; ``projector`` (a multimodal projector) adds its weights; ``overrides``
    (``kv_overrides``) change the header as they change what llama.cpp reads. Raises what
    validation raises for a file llama.cpp could not load."""
    params = params or ContextParams()
    reader, metadata, tensors = _file_header(Path(path))
    if overrides:
        reader, metadata = overridden(reader, metadata, overrides)
    arch = str(metadata.get("general.architecture", ""))
    weights = _tensor_bytes(tensors)
    if projector is not None:
        weights += _tensor_bytes(_file_header(Path(projector))[2])
    n_ctx_train = uint(metadata, f"{arch}.context_length") or 4096
    n_ctx = params.n_ctx if params.n_ctx is not None else min(n_ctx_train, 4096)
    n_ctx = pad_cells(max(n_ctx, params.n_seq_max))
    causal = metadata.get(f"{arch}.attention.causal", True) is not False
    kv, checkpoints = _kv_bytes(reader, arch, metadata, params, n_ctx)
    return MemoryEstimate(
        weights=weights,
        kv=kv,
        compute=_compute_bytes(arch, metadata, params, n_ctx, logits=causal),
        checkpoints=checkpoints,
    )
