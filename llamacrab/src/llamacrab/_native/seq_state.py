"""llama.cpp's own bytes of one sequence's state, read far enough to refuse what aborts it.

A sequence state (llama_state_seq_get_data_ext) is the io magic (u32) and the source sequence
(i32), then what the context's memory writes (its state_write in llama-kv-cache.cpp,
llama-memory-recurrent.cpp, llama-memory-hybrid*.cpp):

- an attention cache: its stream count (u32); per stream a cell count (u32) and, with cells, per
  cell a position (i32), a sequence count (u32), three i32 of M-RoPE / PLE extension where the
  model has them, and the sequence ids (i32 each); then the V transposition (u32), the layer
  count (u32) and per layer the key type (i32), row size (u64) and a row per cell; the values
  likewise (transposed: type, element size (u32), width (u32), width x cells elements), none
  for MLA;
- a recurrent memory: a cell count (u32), per cell a position and a sequence count, then rows;
- a hybrid one: the attention cache(s), then the recurrent part. A partial state (only the
  sliding-window part) leaves the attention cache out, but a hybrid with a sliding window keeps
  its windowed cache.

llama_memory_recurrent::state_read_meta checks a sequence's cell count only against its cells
(one per sequence), puts them all into the one cell the sequence gets, and then asserts
(GGML_ASSERT: an abort, not an error) that they form a block of cells at their positions: any
count above 1 aborts a context of several sequences. llama.cpp writes at most one: a sequence
owns a single recurrent cell, whose position the read copies into it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from llamacrab._exceptions import StateError
from llamacrab._native.call import lib
from llamacrab._native.model import Model

_HEAD = struct.Struct("<Ii")  # io magic, source sequence
_IO_MAGIC = 0xAF143CD8
_U32 = struct.Struct("<I")
_CELL = struct.Struct("<iI")  # position, sequence count
_CELL_EXT = 12  # llama_kv_cell_ext: x, y, tok
_ENTRY = struct.Struct("<iQ")  # type, row size
_TRANSPOSED_ENTRY = struct.Struct("<iII")  # type, element size, width
_ROWS_HEAD = struct.Struct("<II")  # values transposed, layer count
_MROPE = (lib.LLAMA_ROPE_TYPE_MROPE, lib.LLAMA_ROPE_TYPE_IMROPE)
# Hybrid to llama_model_is_hybrid, but given a memory of their own without a recurrent part.
_OWN_MEMORY = ("deepseek4",)
# The hybrids whose loaders read MLA head sizes (another file's such keys mean nothing) and
# per-layer n-gram embeddings (PLE), by llama.cpp's models/*.cpp.
_MLA_ARCHS = ("bailingmoe3", "glm5-next", "kimi-k3", "kimi-linear")
_PLE_ARCHS = ("qwen4exp",)


@dataclass(frozen=True)
class SequenceMemory:
    """What a context's memory writes into a sequence's state: ``recurrent`` False, no
    recurrent part (nothing to check); an ``attention`` cache before it (a hybrid), two with a
    sliding window (``windowed``: the full layers' and the windowed ones'), of ``n_stream``
    streams each, whose cells carry an extension (``cell_ext``) and value rows (``values``, not
    with MLA)."""

    recurrent: bool
    attention: bool = False
    windowed: bool = False
    n_stream: int = 1
    cell_ext: bool = False
    values: bool = True

    def attention_caches(self, partial: bool) -> int:
        """The attention caches before the recurrent part: a partial state keeps only the
        windowed one."""
        if not self.attention:
            return 0
        return int(self.windowed) if partial else 1 + int(self.windowed)

    @classmethod
    def of(cls, model: Model, n_seq_max: int, kv_unified: bool) -> SequenceMemory:
        """As llama_model::create_memory builds it for ``model`` in a context of ``n_seq_max``
        sequences (a KV stream per sequence unless ``kv_unified``)."""
        pointer, arch = model.pointer, model.arch
        if lib.llama_model_is_recurrent(pointer):
            return cls(recurrent=True)
        if not lib.llama_model_is_hybrid(pointer) or arch in _OWN_MEMORY:
            return cls(recurrent=False)
        metadata = model.metadata

        def number(key: str) -> int:  # as llama.cpp renders it; 0 where absent
            value = metadata.get(f"{arch}.{key}", "")
            return int(value) if value.isdigit() else 0

        # llama_hparams::is_mla (no value rows); has_cell_ext's PLE heads
        mla = arch in _MLA_ARCHS and all(
            number(f"attention.{key}") > 0 for key in ("key_length_mla", "value_length_mla")
        )
        ple = arch in _PLE_ARCHS and f"{arch}.ple.layers" in metadata
        windowed = model.n_swa > 0  # llama_memory_hybrid_iswa
        return cls(
            recurrent=True,
            attention=True,
            windowed=windowed,
            n_stream=1 if kv_unified else n_seq_max,
            cell_ext=lib.llama_model_rope_type(pointer) in _MROPE or ple,
            values=not mla,
        )


def check_sequence_state(data: bytes | memoryview, memory: SequenceMemory, partial: bool) -> None:
    """StateError for a sequence state ``data`` whose recurrent part claims more than one cell,
    found where llama.cpp reads it for ``partial``: such a state aborts the process. Also for
    an attention cache before it that does not fit the context (a partial state loaded as
    full reads as one). A wrong magic is left to llama.cpp, which refuses it."""
    if not memory.recurrent or len(data) < _HEAD.size:
        return
    view = memoryview(data).cast("B")
    if _HEAD.unpack_from(view)[0] != _IO_MAGIC:
        return
    offset = _HEAD.size
    try:
        for _ in range(memory.attention_caches(partial)):
            offset = _skip_attention(view, offset, memory)
    except StateError as error:
        hint = "" if partial else " (a partial state? load it with partial=True)"
        raise StateError(f"{error}{hint}") from None
    (cells,) = _read(view, offset, _U32, "its recurrent cell count")
    if cells > 1:
        hint = ""
        if partial and memory.attention:
            hint = (
                " (a full state loaded with partial=True puts its KV stream count here: "
                "load it as it was saved)"
            )
        raise StateError(
            f"the state's recurrent memory claims {cells} cells where a sequence has one "
            f"(corrupted or altered){hint}"
        )


def _skip_attention(view: memoryview, offset: int, memory: SequenceMemory) -> int:
    """The offset after the attention cache at ``offset``."""
    (n_stream,) = _read(view, offset, _U32, "its KV stream count")
    if n_stream != memory.n_stream:
        raise StateError(
            f"the state has {n_stream} KV streams where this context has {memory.n_stream} (a "
            "one-slot Llama has one, parallel slots one each unless kv_unified=True)"
        )
    offset += _U32.size
    for _ in range(n_stream):
        (cells,) = _read(view, offset, _U32, "a KV stream's cell count")
        offset += _U32.size
        if cells:
            offset = _skip_cells(view, offset, cells, memory)
            offset = _skip_rows(view, offset, cells, memory)
    return offset


def _skip_cells(view: memoryview, offset: int, cells: int, memory: SequenceMemory) -> int:
    """After ``cells`` cells of one sequence each (all llama.cpp writes for one, and all it
    reads): position, sequence count 1, the extension, the sequence id; as an array, since a
    long context has tens of thousands."""
    words = (_CELL.size + (_CELL_EXT if memory.cell_ext else 0) + 4) // 4
    end = offset + 4 * words * cells
    if end > len(view):
        raise StateError("the state ends inside its KV cells (corrupted)")
    n_seqs = np.frombuffer(view, dtype="<u4", count=words * cells, offset=offset)[1::words]
    if (n_seqs != 1).any():
        n_seq = int(n_seqs[(n_seqs != 1).argmax()])
        raise StateError(f"a KV cell of the state belongs to {n_seq} sequences, not one")
    return end


def _skip_rows(view: memoryview, offset: int, cells: int, memory: SequenceMemory) -> int:
    transposed, n_layer = _read(view, offset, _ROWS_HEAD, "its KV layer count")
    offset += _ROWS_HEAD.size
    for _ in range(n_layer):  # keys
        _, row = _read(view, offset, _ENTRY, "its key rows")
        offset += _ENTRY.size + cells * row
    for _ in range(n_layer if memory.values else 0):
        if transposed:
            _, element, width = _read(view, offset, _TRANSPOSED_ENTRY, "its value rows")
            offset += _TRANSPOSED_ENTRY.size + width * cells * element
        else:
            _, row = _read(view, offset, _ENTRY, "its value rows")
            offset += _ENTRY.size + cells * row
    return offset


def _read(view: memoryview, offset: int, shape: struct.Struct, what: str) -> tuple[int, ...]:
    if offset + shape.size > len(view):
        raise StateError(f"the state ends before {what} (corrupted)")
    return shape.unpack_from(view, offset)
