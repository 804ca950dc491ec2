"""What a model's KV cache holds per cell in each layer, read from its GGUF header.

llama.cpp allocates a context's keys and values, and zero-fills them, before anything can fail
cleanly: knowing their size from the header lets a context too large for the machine be refused
before that (``Context``), and a registry estimate a model before loading it (``gguf_memory``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llamacrab._native.call import lib
from llamacrab._native.gguf.attention import head_sizes, swa_layers
from llamacrab._native.gguf_reader import Reader, per_layer, uint

CELL_PAD = 256  # llama.cpp pads a context's cells to a multiple of 256


def pad_cells(n: int) -> int:
    return -(-n // CELL_PAD) * CELL_PAD


def kv_streams(n_ctx: int, n_seq_max: int, kv_unified: bool) -> tuple[int, int]:
    """llama.cpp's KV streams and the cells of each: one for every sequence (without
    ``kv_unified``) of n_ctx / n_seq_max cells padded to CELL_PAD (n_ctx 256 for 256
    sequences: 65,536 cells), else one of n_ctx."""
    streams = 1 if kv_unified else n_seq_max
    return streams, pad_cells(n_ctx // streams)


@dataclass(frozen=True)
class LayerKv:
    """One layer's elements per cell: its KV heads times the key / value head size (0 for a
    recurrent or attention-free layer, which keeps no cells)."""

    key_width: int
    value_width: int
    sliding: bool
    key_head: int  # one key head's elements


@dataclass(frozen=True)
class KvLayout:
    """Every layer's ``LayerKv``, and the sliding window in cells (0: none)."""

    layers: tuple[LayerKv, ...]
    window: int

    @property
    def attends(self) -> bool:
        """Whether any layer keeps keys and values (not a recurrent model, nor an encoder)."""
        return any(layer.key_width for layer in self.layers)

    def sliding_cells(self, n_ctx: int, n_seq_max: int, n_ubatch: int, swa_full: bool) -> int:
        """The cells of a sliding-window layer: a window per sequence and a micro-batch."""
        if swa_full or not self.window:
            return n_ctx
        return min(n_ctx, pad_cells(self.window * n_seq_max + n_ubatch))

    def layer_bytes(self, layer: LayerKv, type_k: int, type_v: int) -> int:
        """Bytes of one cell of ``layer`` with keys of GGML type ``type_k``, values ``type_v``."""
        if layer.key_width == 0:
            return 0
        key = lib.ggml_row_size(type_k, layer.key_width)
        return int(key + lib.ggml_row_size(type_v, layer.value_width))

    def bytes(
        self, n_ctx: int, sliding_cells: int, type_k: int, type_v: int, n_layers: int | None = None
    ) -> int:
        """Keys and values of the first ``n_layers`` layers (None: all), ``n_ctx`` cells each
        but ``sliding_cells`` in a sliding-window layer."""
        return sum(
            self.layer_bytes(layer, type_k, type_v) * (sliding_cells if layer.sliding else n_ctx)
            for layer in self.layers[:n_layers]
        )


def kv_layout(reader: Reader, arch: str, metadata: dict[str, Any]) -> KvLayout:
    """The layout as llama.cpp's load_hparams derives it; no layers for an encoder (BERT),
    which keeps no KV memory."""
    none = KvLayout((), 0)
    causal = metadata.get(f"{arch}.attention.causal", True)
    n_layer = uint(metadata, f"{arch}.block_count") or 0
    n_head = per_layer(reader, metadata, f"{arch}.attention.head_count", n_layer)
    if not causal or not n_layer or not n_head:
        return none
    n_head_kv = per_layer(reader, metadata, f"{arch}.attention.head_count_kv", n_layer) or n_head
    sizes = head_sizes(arch, metadata, max(n_head))
    if sizes is None:
        return none
    swa = swa_layers(reader, arch, metadata, n_layer) or (False, [False] * n_layer)
    layers = []
    for layer in range(n_layer):
        sliding = swa[1][layer] if layer < len(swa[1]) else False
        head = sizes[1] if sliding else sizes[0]
        heads = n_head_kv[layer]
        layers.append(LayerKv(heads * head.key, heads * head.value, sliding, head.key))
    window = uint(metadata, f"{arch}.attention.sliding_window") or 0
    return KvLayout(tuple(layers), window)
