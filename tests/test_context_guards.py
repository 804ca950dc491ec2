"""Context parameters and memory operations llama.cpp would abort on, or get wrong, refused or
done right: encoder-decoder models, an n_ctx that wraps, separate KV streams, huge micro-batches
of recurrent models, keep with a stream per sequence, shifts past int32."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from llamacrab import (
    Batch,
    Context,
    ContextError,
    ContextParams,
    InvalidParameterError,
    Llama,
    Model,
)
from llamacrab._field_types import LAST_POSITION
from llamacrab._native import context as context_module
from llamacrab._native.host_limits import Limit

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")
MAX_N_CTX = 2**32 - 256 * 256  # 256 cells of padding for each of up to 256 streams


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("context-guards")
    return {
        "llama": tiny.write_tiny_llama(folder / "tiny.gguf"),
        "mamba": tiny.write_tiny_mamba(folder / "tiny-mamba.gguf"),
        "jamba": tiny.write_tiny_jamba(folder / "tiny-jamba.gguf"),
        "t5": tiny.write_tiny_t5(folder / "tiny-t5.gguf"),
        "t5encoder": tiny.write_tiny_t5(folder / "tiny-t5encoder.gguf", decoder=False),
    }


@pytest.fixture
def loaded(models: dict[str, Path], request: pytest.FixtureRequest) -> Iterator[Model]:
    with Model.load(models[request.param]) as model:
        yield model


def run_child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


def decode(ctx: Context, tokens: list[int], seq_id: int = 0) -> None:
    with Batch(len(tokens), ctx.params.n_seq_max) as batch:
        batch.set(np.asarray(tokens, dtype=np.int32), 0, seq_id)
        ctx.decode(batch)


def only_memory_left(monkeypatch: pytest.MonkeyPatch, amount: int) -> None:
    limit = Limit(amount, "the test leaves")
    monkeypatch.setattr(context_module, "host_memory_left", lambda: limit)


# -- encoder-decoder models ---------------------------------------------------------------------

ENCODER_DECODER_CHILD = """
    import sys
    import numpy as np
    from llamacrab import Batch, Context, ContextParams, LlamaError, Model
    with Model.load(sys.argv[1]) as model:
        for embeddings in (False, True):
            try:
                params = ContextParams(n_ctx=256, n_threads=1, embeddings=embeddings)
                with Context(model, params) as ctx, Batch(3, 2) as batch:
                    batch.set(np.array([5, 6, 7], dtype=np.int32), 0, seq_id=0)
                    ctx.decode(batch)  # before any encode: llama.cpp would assert
            except LlamaError as error:
                print(type(error).__name__, error)
"""


def test_an_encoder_decoder_model_refuses_what_would_abort(models: dict[str, Path]) -> None:
    child = run_child(ENCODER_DECODER_CHILD, str(models["t5"]))
    assert child.returncode == 0, f"exit {child.returncode}\n{child.stderr[-3000:]}"
    without_input, embeddings = child.stdout.splitlines()
    assert without_input.startswith("ContextError sequence 0 has no encoder output")
    assert embeddings.startswith("ContextError") and "tiny-t5.gguf" in embeddings
    assert "embeddings from it are not supported" in embeddings
    # An encoder alone still embeds.
    with Llama(models["t5encoder"], n_ctx=256, n_threads=1, embeddings=True) as encoder:
        vector = np.asarray(encoder.embed("the cat"))
    assert vector.shape[-1] == 64 and np.isfinite(vector).all()


# -- n_ctx near 2^32 ----------------------------------------------------------------------------


def test_an_n_ctx_that_llama_cpp_s_padding_would_wrap_is_refused(models: dict[str, Path]) -> None:
    for n_ctx in (2**32 - 1, 2**32 - 256, MAX_N_CTX + 1):
        with pytest.raises(InvalidParameterError, match="n_ctx"):
            ContextParams(n_ctx=n_ctx)
    # The largest n_ctx left wraps neither with one stream nor with a stream per sequence.
    with Model.load(models["mamba"]) as mamba:
        for unified, n_seq_max in ((True, 1), (False, 256), (False, 7)):
            params = ContextParams(
                n_ctx=MAX_N_CTX, kv_unified=unified, n_seq_max=n_seq_max, n_threads=1
            )
            with Context(mamba, params) as ctx:
                assert 0 < ctx.n_ctx <= 2**32 - 256
                decode(ctx, [5, 6, 7])
                assert ctx.positions(0) == (2, 2)


# -- host memory --------------------------------------------------------------------------------


@pytest.mark.parametrize("loaded", ["llama"], indirect=True)
def test_separate_streams_count_every_stream_s_cells(
    loaded: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    per_cell = loaded.kv_layout.bytes(1, 1, 1, 1) + context_module.KV_CELL_BYTES  # f16 K and V
    only_memory_left(monkeypatch, per_cell * 256 * 16 + 2**20)  # 16 streams of 256 and a MiB
    with Context(loaded, ContextParams(n_ctx=1024, n_seq_max=4, n_threads=1)) as ctx:
        assert ctx.n_ctx == 1024
    # 64 streams of 256 cells each (llama.cpp pads every stream), not 256 cells in all.
    with pytest.raises(ContextError, match=r"64 stream\(s\) of 256 cells"):
        Context(loaded, ContextParams(n_ctx=256, n_seq_max=64, n_threads=1))
    with Context(loaded, ContextParams(n_ctx=256, n_seq_max=64, kv_unified=True, n_threads=1)):
        pass  # one stream of 256 cells


@pytest.mark.parametrize("loaded", ["mamba"], indirect=True)
def test_a_recurrent_model_s_micro_batch_counts(
    loaded: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    only_memory_left(monkeypatch, 50 * 2**20)
    n = 2**21  # 2^21 tokens of 33 bytes: 66 MiB zero-filled by ubatch_reserve
    with pytest.raises(ContextError, match="reserved micro-batch of 2097152 tokens"):
        Context(loaded, ContextParams(n_ctx=n, n_batch=n, n_ubatch=n, n_threads=1))
    # The micro-batch is cut to n_ctx first, as llama.cpp cuts it.
    with Context(loaded, ContextParams(n_ctx=512, n_batch=n, n_ubatch=n, n_threads=1)):
        pass


# -- keep ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("loaded", ["llama", "jamba"], indirect=True)
def test_keep_drops_every_other_sequence(loaded: Model) -> None:
    for unified in (False, True):  # a stream per sequence (llama.cpp kept the others), one
        _keep_and_start_again(loaded, ContextParams(n_ctx=768, n_seq_max=3, kv_unified=unified))


def _keep_and_start_again(loaded: Model, params: ContextParams) -> None:
    with Context(loaded, params) as ctx:
        for seq_id in range(3):
            decode(ctx, [5, 6, 7], seq_id)
        ctx.keep(2)
        assert ctx.positions(0) is None and ctx.positions(1) is None
        assert ctx.positions(2) == (0 if loaded.arch == "llama" else 2, 2)  # Jamba: its state's
        decode(ctx, [9, 10, 11], 1)  # a dropped sequence starts again at 0
        again = ctx.logits(-1).copy()
    with Context(loaded, params) as fresh:
        decode(fresh, [9, 10, 11], 1)
        np.testing.assert_allclose(again, fresh.logits(-1), atol=1e-4)


# -- shift --------------------------------------------------------------------------------------


@pytest.mark.parametrize("loaded", ["llama", "mamba", "jamba"], indirect=True)
def test_a_shift_past_int32_is_refused(loaded: Model) -> None:
    with Context(loaded, ContextParams(n_ctx=256, n_threads=1)) as ctx:
        decode(ctx, [5, 6, 7, 8, 9])  # positions 0..4
        past = f"past {LAST_POSITION}"
        with pytest.raises(InvalidParameterError, match=past):
            ctx.shift(0, 2**31 - 4)  # 4 to INT32_MAX + 1: wrapped negative
        with pytest.raises(InvalidParameterError, match=past):
            ctx.shift(0, LAST_POSITION - 2, p0=2, p1=4)  # position 3 is the highest it moves
        with pytest.raises(InvalidParameterError, match=past):
            ctx.shift(0, LAST_POSITION - 3, p0=3)  # 4 one past the last
        assert ctx.positions(0) == (0 if loaded.arch == "llama" else 4, 4)
        ctx.shift(0, LAST_POSITION - 4, p0=3)  # 4 lands on LAST_POSITION: allowed
        assert ctx.positions(0) is not None
        assert ctx.positions(0)[1] == LAST_POSITION  # type: ignore[index]
    if loaded.arch == "llama":  # KV cells shifted below 0 are dropped, as llama.cpp does
        with Context(loaded, ContextParams(n_ctx=256, n_threads=1)) as ctx:
            decode(ctx, [5, 6, 7, 8, 9])
            ctx.shift(0, -3)
            assert ctx.positions(0) == (0, 1)


def test_positions_where_the_attention_mask_s_reach_overflows_are_refused() -> None:
    """llama.cpp's attention mask looks back from a token's position + 32 + the sliding window,
    in int32: three tokens at 2^31 - 4 decoded together and one at a time differed by 0.47 in a
    logit (undefined behaviour, no signal)."""
    with Batch(3) as batch:
        with pytest.raises(InvalidParameterError, match="past the highest"):
            batch.set(np.array([5, 6, 7], dtype=np.int32), 2**31 - 4)
        with pytest.raises(InvalidParameterError, match="past the highest"):
            batch.set_one(5, 2**31 - 33)
    assert LAST_POSITION + 32 + 2**23 < 2**31 - 1  # room for windows of 8 million positions


@pytest.mark.parametrize("loaded", ["llama"], indirect=True)
def test_a_negative_position_is_refused(loaded: Model) -> None:
    # llama.cpp took a lone token at -1 (the mark of an empty KV cell): the cache held it
    # unseen, its sequence's range went wrong (positions() said empty after two decodes).
    with Context(loaded, ContextParams(n_ctx=256, n_threads=1)) as ctx, Batch(4) as batch:
        negative = "position -1 is negative: positions start at 0"
        with pytest.raises(InvalidParameterError, match=negative):
            batch.set_one(5, -1)
        with pytest.raises(InvalidParameterError, match=negative):
            batch.set(np.array([5, 6], dtype=np.int32), -1)
        with pytest.raises(InvalidParameterError, match="position -7 is negative"):
            batch.set_rows(np.array([5, 6]), np.array([-7, 0]), np.array([0, 0]), np.array([0, 1]))
        with pytest.raises(InvalidParameterError, match="start_pos must be an integer"):
            batch.set(np.array([5, 6], dtype=np.int32), 1.5)  # type: ignore[arg-type]
        with pytest.raises(InvalidParameterError, match="pos must be an integer"):
            batch.set_one(5, 0.5)  # type: ignore[arg-type]
        decode(ctx, [5, 6])
        assert ctx.positions(0) == (0, 1)


@pytest.mark.parametrize("loaded", ["mamba", "jamba"], indirect=True)
def test_a_recurrent_state_is_not_shifted_below_zero(loaded: Model) -> None:
    with Context(loaded, ContextParams(n_ctx=256, n_threads=1)) as ctx:
        decode(ctx, [5, 6, 7, 8, 9])
        with pytest.raises(InvalidParameterError, match="below 0"):
            ctx.shift(0, -10)
        assert ctx.positions(0) is not None
        ctx.shift(0, -4)  # the state's position 4 to 0: allowed
        assert ctx.positions(0) is not None and ctx.positions(0)[1] == 0  # type: ignore[index]


# -- what a context cannot do with some settings (a call-argument audit, 2026-12-07) -------------


def test_keys_stored_as_bf16_are_not_shifted(models: dict[str, Path]) -> None:
    """ggml's CPU rope rotates f32 and f16 keys in place (quantized ones through f32): the
    decode after a shift of bf16 keys aborted (GGML_ABORT, ggml-cpu/ops.cpp)."""
    with Model.load(models["llama"]) as model:
        params = ContextParams(n_ctx=256, n_threads=1, type_k="bf16")
        with Context(model, params) as ctx:
            decode(ctx, [5, 6, 7, 8, 9])
            with pytest.raises(InvalidParameterError, match='type_k="bf16"'):
                ctx.shift(0, 2, p0=2)
            with pytest.raises(InvalidParameterError, match='type_k="bf16"'):
                ctx.divide(0, 2, p0=2)
            assert ctx.positions(0) == (0, 4)
            with Batch(1) as batch:  # the context works on
                batch.set_one(10, 5)
                ctx.decode(batch)
        for type_k in ("f16", "f32"):
            with Context(model, ContextParams(n_ctx=256, n_threads=1, type_k=type_k)) as ctx:
                decode(ctx, [5, 6, 7, 8, 9])
                ctx.shift(0, 2, p0=2)
                assert ctx.positions(0) == (0, 6)


def test_a_divide_turns_keys_to_their_new_positions(models: dict[str, Path]) -> None:
    """llama.cpp recorded a division's rotation with the sign of the old position minus the
    new one (a shift records the new minus the old): the keys were turned away from where they
    went, and the next token attended with wrong positions."""
    with Model.load(models["llama"]) as model, Context(model, ContextParams(n_ctx=256)) as ctx:

        def next_logits(move: Callable[[], None]) -> np.ndarray:
            ctx.clear()
            decode(ctx, [5, 6, 7, 8])
            move()  # positions 0, 1, 2, 3 to 0, 0, 1, 1
            with Batch(1) as batch:
                batch.set_one(9, 2)
                ctx.decode(batch)
            return ctx.logits(-1).copy()

        divided = next_logits(lambda: ctx.divide(0, 2))

        def shifted() -> None:
            ctx.shift(0, -1, p0=1, p1=3)
            ctx.shift(0, -2, p0=3)

        assert np.allclose(divided, next_logits(shifted), atol=1e-4)


def test_an_encoder_decoder_model_takes_no_pooling(models: dict[str, Path]) -> None:
    """The decoder reads the encoder's output from a buffer only pooling "none" fills: with
    another, every prompt generated the same tokens."""
    with Model.load(models["t5"]) as model:
        for pooling in ("mean", "cls", "last"):
            params = ContextParams(n_ctx=256, n_threads=1, pooling=pooling)
            with pytest.raises(ContextError, match=f"with pooling '{pooling}'"):
                Context(model, params)
        Context(model, ContextParams(n_ctx=256, n_threads=1, pooling="none")).close()


@pytest.mark.parametrize(
    "setting",
    [{"rope_freq_base": -1.0}, {"rope_freq_base": 1e39}, {"rope_freq_scale": -0.5},
     {"rope_freq_scale": 1e39}, {"yarn_orig_ctx": 2**31}],
)  # fmt: skip
def test_rope_settings_that_make_every_position_nan_are_refused(setting: dict[str, float]) -> None:
    with pytest.raises(InvalidParameterError, match=next(iter(setting))):
        ContextParams(**setting)  # type: ignore[arg-type]


def test_quantized_keys_need_heads_of_whole_blocks_without_flash_attention(
    models: dict[str, Path],
) -> None:
    """llama.cpp checks a quantized key cache's block against the heads with flash attention
    only; without it the tiny model's heads of 16 in blocks of 32 gave every attention score 0
    (the same logits whatever came before)."""
    with Model.load(models["llama"]) as model:
        for type_k in ("q4_0", "q8_0", "q5_1"):
            params = ContextParams(n_ctx=256, n_threads=1, type_k=type_k, flash_attn="off")
            with pytest.raises(InvalidParameterError, match="blocks of 32"):
                Context(model, params)
        Context(model, ContextParams(n_ctx=256, n_threads=1, type_k="f16", flash_attn="off"))
