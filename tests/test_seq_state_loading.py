"""Loading a recurrent sequence state llama.cpp would abort on, end to end, in a child process:
before Context.load_state_bytes checked it (seq_state.py) each of these ended the process
(SIGABRT in llama_memory_recurrent::state_read_meta)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("seq-state-loading")
    return {"mamba": tiny.write_tiny_mamba(folder / "mamba.gguf"),
            "jamba": tiny.write_tiny_jamba(folder / "jamba.gguf")}  # fmt: skip


def _run(code: str, *args: str) -> list[str]:
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
        timeout=300, env={**os.environ, "GGML_NO_BACKTRACE": "1"},
    )  # fmt: skip
    assert child.returncode == 0, f"exit {child.returncode}\n{child.stderr[-3000:]}"
    return child.stdout.splitlines()


MAMBA_TWO_CELLS = """
import dataclasses, struct, sys
from llamacrab import Llama, SavedState, StateError
with Llama(sys.argv[1], n_ctx=256, parallel=2, n_threads=1) as llm:
    llm.create_completion("the cat", max_tokens=2, temperature=0)
    slot = next(s.id for s in llm.slots() if s.n_tokens)
    state = llm.save_state(slot=slot)
    p = bytes(state.payload)
    cells, pos, n_seq = struct.unpack_from("<IiI", p, 8)
    assert cells == 1, cells
    two = p[:8] + struct.pack("<IiI", 2, pos, 0) + struct.pack("<iI", pos + 1, 0) + p[20:]
    blob = dataclasses.replace(state, payload=two).to_bytes()  # a valid checksum
    for into in (0, 1):
        try:
            llm.load_state(SavedState.from_bytes(blob), slot=into)
        except StateError as error:
            print("refused:", error)
    print("answered", llm.create_completion("the cat", max_tokens=2).usage.completion_tokens)
"""


def test_a_state_file_of_two_recurrent_cells_is_refused(paths: dict[str, Path]) -> None:
    """A state file with a valid checksum whose Mamba state claims 2 cells, loaded into either
    slot of a parallel Llama (a shared DiskCache, a server slot file reach the same load)."""
    lines = _run(MAMBA_TWO_CELLS, str(paths["mamba"]))
    assert lines.count("refused: the state's recurrent memory claims 2 cells where a sequence "
                       "has one (corrupted or altered)") == 2, lines  # fmt: skip
    assert lines[-1] == "answered 2"


HYBRID = """
import struct, sys
import numpy as np
from llamacrab import Batch, Context, ContextParams, Model, StateError
with Context(Model.load(sys.argv[1]), ContextParams(n_ctx=256, n_seq_max=2, n_threads=1)) as ctx:
    batch = Batch(8, 2)
    batch.set(np.array([5, 6, 7], dtype=np.int32), 0, 1)
    ctx.decode(batch)  # sequence 1 holds 3 tokens, sequence 0 none
    for seq in (0, 1):
        full = ctx.state_bytes(seq)
        try:  # untouched, with the wrong flag: the KV stream count read as 2 recurrent cells
            ctx.load_state_bytes(full, seq, partial=True)
        except StateError as error:
            print("refused:", error)
    # the recurrent part ends a full state; a partial state holds it alone after the head
    full, partial = ctx.state_bytes(1), ctx.state_bytes(1, partial=True)
    at = len(full) - len(partial) + 8
    assert struct.unpack_from("<I", full, at) == (1,)
    two = full[:at] + struct.pack("<I", 2) + full[at + 4 : at + 12] + bytes(8) + full[at + 12 :]
    try:
        ctx.load_state_bytes(two, 0)
    except StateError as error:
        print("refused:", error)
    ctx.load_state_bytes(full, 0)
    print("loaded", ctx.state_bytes(0, partial=True)[8:] == partial[8:])  # the same recurrent state
"""


def test_hybrid_states_of_two_recurrent_cells_are_refused(paths: dict[str, Path]) -> None:
    """Jamba: the untouched full state of a sequence (empty or not) loaded with partial=True,
    and a full state whose recurrent part, after the attention cache, claims 2 cells."""
    lines = _run(HYBRID, str(paths["jamba"]))
    assert [line.startswith("refused:") for line in lines] == [True, True, True, False], lines
    assert all("partial=True" in line for line in lines[:2]), lines
    assert "claims 2 cells" in lines[2]
    assert lines[-1] == "loaded True"
