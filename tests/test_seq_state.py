"""A sequence state's recurrent part, read before llama.cpp reads it (seq_state.py).

llama.cpp reads a recurrent cell count above 1 into the one cell a sequence has and then
asserts (SIGABRT) that the cells form a block: with n_seq_max >= 2 a state of 2 cells killed
the process, from a state file, a DiskCache or a slot file, and so did an untouched full state
of a hybrid loaded with partial=True (its KV stream count read as the recurrent cell count)."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from llamacrab import Batch, Context, ContextParams, Model, StateError
from llamacrab._native.seq_state import SequenceMemory, check_sequence_state

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")

HEAD = 8  # io magic, source sequence
TOKENS = np.array([5, 6, 7, 8], dtype=np.int32)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Model]]:
    """A recurrent model (Mamba) and a hybrid one (Jamba: a Mamba layer, an attention one)."""
    folder = tmp_path_factory.mktemp("seq-state")
    loaded = {
        "mamba": Model.load(str(tiny.write_tiny_mamba(folder / "mamba.gguf"))),
        "jamba": Model.load(str(tiny.write_tiny_jamba(folder / "jamba.gguf"))),
    }
    yield loaded
    for model in loaded.values():
        model.close()


def _context(model: Model, **settings: object) -> Context:
    """A context whose sequence 1 holds TOKENS, sequence 0 nothing."""
    params = ContextParams(n_ctx=256, n_threads=1, **{"n_seq_max": 2, **settings})  # type: ignore[arg-type]
    context = Context(model, params)
    batch = Batch(8, 2)
    batch.set(TOKENS, 0, 1 if params.n_seq_max > 1 else 0)
    context.decode(batch)
    return context


def _memory(context: Context) -> SequenceMemory:
    return SequenceMemory.of(context.model, context.params.n_seq_max, context.params.kv_unified)


def _recurrent_at(state: bytes, memory: SequenceMemory, partial: bool) -> int:
    """Where the recurrent cell count is: found by making it 2 at each candidate offset."""
    for offset in range(HEAD, len(state) - 3, 4):
        forged = state[:offset] + struct.pack("<I", 2) + state[offset + 4 :]
        try:
            check_sequence_state(forged, memory, partial)
        except StateError as error:
            if "claims 2 cells" in str(error):
                return offset
    raise AssertionError("no offset is checked")


SETTINGS = [
    {},
    {"flash_attn": "on"},
    {"flash_attn": "off"},  # values transposed
    {"kv_unified": True},
    {"n_seq_max": 1},
    {"n_seq_max": 3},
]


@pytest.mark.parametrize("arch", ["mamba", "jamba"])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(map(str, s.items())))
def test_states_llama_cpp_writes_pass_and_a_second_recurrent_cell_is_refused(
    models: dict[str, Model], arch: str, settings: dict[str, object]
) -> None:
    """Every sequence state the context writes (empty or not, full or partial) passes and
    loads back; the same state with its recurrent cell count made 2 is refused, found after the
    hybrid's attention cache, however its cells and values are laid out."""
    with _context(models[arch], **settings) as context:
        memory = _memory(context)
        for seq in range(context.params.n_seq_max):
            for partial in (False, True):
                state = context.state_bytes(seq, partial=partial)
                check_sequence_state(state, memory, partial)
                context.load_state_bytes(state, seq, partial=partial)
                offset = _recurrent_at(state, memory, partial)
                (cells,) = struct.unpack_from("<I", state, offset)
                holds = context.params.n_seq_max == 1 or seq == 1
                assert cells == int(holds)
                after_attention = arch == "jamba" and not partial
                assert (offset > HEAD) == after_attention, (seq, partial, offset)


def test_a_hybrid_state_loaded_with_the_other_flag_is_refused_by_name(
    models: dict[str, Model],
) -> None:
    """A partial read of a hybrid starts at the recurrent part, where a full state has its KV
    stream count (2 here): llama.cpp took it for 2 recurrent cells and aborted. A partial
    state read as full does not fit the attention cache, with one stream or two."""
    for settings in ({}, {"kv_unified": True}, {"n_seq_max": 1}):
        with _context(models["jamba"], **settings) as context:
            memory = _memory(context)
            for seq in range(context.params.n_seq_max):
                full, partial = context.state_bytes(seq), context.state_bytes(seq, partial=True)
                if memory.n_stream > 1:
                    with pytest.raises(StateError, match=r"claims 2 cells.*partial=True"):
                        check_sequence_state(full, memory, partial=True)
                with pytest.raises(StateError, match=r"a partial state\? load it with partial"):
                    check_sequence_state(partial, memory, partial=False)


def test_memories_are_read_from_the_model(models: dict[str, Model], tiny_model_path: Path) -> None:
    assert SequenceMemory.of(models["mamba"], 4, False) == SequenceMemory(recurrent=True)
    assert SequenceMemory.of(models["jamba"], 4, False) == SequenceMemory(
        recurrent=True, attention=True, n_stream=4
    )
    assert SequenceMemory.of(models["jamba"], 4, True).n_stream == 1
    with Model.load(str(tiny_model_path)) as attention_only:
        memory = SequenceMemory.of(attention_only, 4, False)
    assert not memory.recurrent
    check_sequence_state(b"\xd8\x3c\x14\xaf" + bytes(4) + struct.pack("<I", 9), memory, False)


@pytest.mark.parametrize(
    ("memory", "partial", "caches"),
    [
        (SequenceMemory(recurrent=True), False, 0),
        (SequenceMemory(recurrent=True, attention=True), False, 1),
        (SequenceMemory(recurrent=True, attention=True), True, 0),
        (SequenceMemory(recurrent=True, attention=True, windowed=True), False, 2),
        (SequenceMemory(recurrent=True, attention=True, windowed=True), True, 1),
    ],
)
def test_a_partial_state_leaves_out_the_full_layers_cache(
    memory: SequenceMemory, partial: bool, caches: int
) -> None:
    assert memory.attention_caches(partial) == caches


def _stream(cells: int, ext: bool, values: bool) -> bytes:
    """One attention stream of ``cells`` cells, a layer of 2-byte rows (an empty stream:
    its count alone)."""
    if not cells:
        return struct.pack("<I", 0)
    meta = b"".join(struct.pack("<iI", p, 1) + bytes(12 * ext) + struct.pack("<i", 0)
                    for p in range(cells))  # fmt: skip
    layer = struct.pack("<iQ", 1, 2) + bytes(2 * cells)
    return struct.pack("<I", cells) + meta + struct.pack("<II", 0, 1) + layer * (1 + values)


@pytest.mark.parametrize(("ext", "values"), [(False, True), (True, True), (False, False)])
def test_cell_extensions_and_value_less_caches_are_skipped(ext: bool, values: bool) -> None:
    """M-RoPE / PLE cells carry 12 bytes more, an MLA cache writes no value rows: the
    recurrent count is found after them, and only there."""
    memory = SequenceMemory(recurrent=True, attention=True, n_stream=2, cell_ext=ext, values=values)
    head = struct.pack("<Ii", 0xAF143CD8, 0) + struct.pack("<I", 2)
    attention = head + _stream(0, ext, values) + _stream(3, ext, values)
    check_sequence_state(attention + struct.pack("<I", 1) + bytes(64), memory, False)
    with pytest.raises(StateError, match="claims 2 cells"):
        check_sequence_state(attention + struct.pack("<I", 2) + bytes(64), memory, False)
    with pytest.raises(StateError, match="ends before"):
        check_sequence_state(attention[:-1], memory, False)


def test_a_kv_cell_of_several_sequences_is_refused() -> None:
    """llama.cpp writes one sequence per cell of a sequence's state and reads no other: the
    cells are skipped as a table of that stride."""
    memory = SequenceMemory(recurrent=True, attention=True, n_stream=1)
    cells = struct.pack("<iIi", 0, 1, 0) + struct.pack("<iIi", 1, 2, 0) + bytes(64)
    blob = struct.pack("<IiII", 0xAF143CD8, 0, 1, 2) + cells
    with pytest.raises(StateError, match="belongs to 2 sequences"):
        check_sequence_state(blob, memory, False)
