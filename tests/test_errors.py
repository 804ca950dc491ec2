"""Bad input raises a clear LlamaError; the process and every other object stay usable."""

from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llamacrab import (
    Context,
    ContextError,
    ContextOverflowError,
    ContextParams,
    DecodeAbortedError,
    DecodeError,
    InvalidModelError,
    InvalidParameterError,
    Llama,
    LlamaError,
    Model,
    ModelLoadError,
    NativeError,
    RamCache,
    RpcError,
    SavedState,
    StateError,
    TokenizeError,
)

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        Llama(tmp_path / "nope.gguf")
    # A directory or a device was "not found" too.
    for odd in (tmp_path, Path("/dev/null")):
        with pytest.raises(ModelLoadError, match=f"model file is not a regular file: {odd}$"):
            Llama(odd)


def test_paths_that_are_no_file_names_are_refused_by_name(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    # Found by the compat reliability section: a number for a path was a TypeError from
    # pathlib, a name too long an OSError from stat() (is_file() lets ENAMETOOLONG through).
    with pytest.raises(InvalidParameterError, match="the model must be a file path"):
        Llama(5)  # type: ignore[arg-type]
    nul = r"model path must be a file path \(text .* not 'a\\x00b'"
    with pytest.raises(InvalidParameterError, match=nul):
        Model.load("a\0b")
    too_long = str(tmp_path / ("y" * 5000))
    unreadable = f"cannot read {re.escape(too_long)}: File name too long"
    with pytest.raises(ModelLoadError, match=unreadable):
        Llama(too_long)
    for keywords, error, refusal in [
        ({"mmproj": 5}, InvalidParameterError, "the projector path must be a file path"),
        ({"mmproj": too_long}, ModelLoadError, unreadable),
        ({"lora": [too_long]}, ModelLoadError, unreadable),
        ({"draft_model": too_long}, ModelLoadError, unreadable),
        ({"control_vectors": [too_long]}, InvalidParameterError,
         f"control vector {re.escape(too_long)}: File name too long"),
    ]:  # fmt: skip
        with pytest.raises(error, match=refusal):
            Llama(tiny_model_path, n_ctx=64, n_threads=1, **keywords)  # type: ignore[arg-type]


def test_chat_tools_of_another_shape_are_refused(tiny_llama: Llama) -> None:
    # Found by the compat reliability section: a dict for tools was an AttributeError.
    hi = [{"role": "user", "content": "hi"}]
    for tools in ({"a": 1}, ["look"], [5], "look"):
        with pytest.raises(InvalidParameterError, match="tool"):
            tiny_llama.create_chat_completion(hi, tools=tools, max_tokens=1)  # type: ignore[arg-type]
    assert tiny_llama.create_chat_completion(hi, max_tokens=1, chat_format="chatml").choices


def test_arguments_of_another_type_are_refused_by_name(tiny_llama: Llama) -> None:
    # Found probing the facade after the compat section: these failed deep inside with a
    # TypeError, ValueError or AttributeError; a bad seed was kept and refused every later
    # completion. The public methods check their arguments against their annotations.
    hi = [{"role": "user", "content": "hi"}]
    llm: Any = tiny_llama  # the calls below are wrong on purpose
    refused = [
        ("text must be a string", lambda: llm.tokenize(5)),
        ("tokens must be a list of items each an integer", lambda: llm.detokenize(["a"])),
        ("prompt must be", lambda: llm.create_completion(None, max_tokens=1)),
        ("prompt must be", lambda: llm.create_completion(["a"], max_tokens=1)),
        ("messages must be a list", lambda: llm.create_chat_completion("hi", max_tokens=1)),
        ("messages must be a list", lambda: llm.create_chat_completion([5], max_tokens=1)),
        ("chat_format must be", lambda: llm.create_chat_completion(hi, chat_format=5)),
        ("state must be", lambda: llm.load_state(b"x")),
        ("adapters must be a mapping", lambda: llm.set_lora_adapters(5)),
        ("lora must be", lambda: llm.create_completion("x", lora=5, max_tokens=1)),
    ]
    for message, call in refused:
        with pytest.raises(InvalidParameterError, match=message):
            call()
    for seed in ("x", -1, 2**32):
        with pytest.raises(InvalidParameterError, match="seed must be an integer in"):
            llm.seed = seed
    assert llm.seed is None
    tokens = np.asarray(llm.tokenize("the cat"), dtype=np.int32)  # arrays count as lists
    assert llm.detokenize(tokens) == llm.detokenize(tokens.tolist())
    done = llm.create_completion(tokens, max_tokens=2, min_tokens=2, temperature=0)
    assert done.usage.completion_tokens == 2


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "text.gguf"
    path.write_text("hello, I am not a model" * 10)
    with pytest.raises(InvalidModelError, match="GGUF magic"):
        Llama(path)


def test_truncated_gguf(tmp_path: Path, tiny_model_path: Path) -> None:
    data = tiny_model_path.read_bytes()
    for cut in (30, len(data) // 3, len(data) - 100):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(InvalidModelError):
            Llama(path)


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        ({"block_count": 7}, "block_count = 7"),  # llama.cpp: GGML_ASSERT abort at load
        ({"block_count": 0}, "block_count = 0"),
        ({"rms_eps": -1e-5}, "epsilon"),  # llama.cpp: GGML_ASSERT abort at the first decode
        ({"rms_eps": 0.0}, "epsilon"),
    ],
)
def test_tampered_files_that_would_abort_llama_cpp_are_rejected(
    tmp_path: Path, tamper: dict, message: str
) -> None:
    path = tiny.write_tiny_llama(tmp_path / "tampered.gguf", **tamper)
    with pytest.raises(InvalidModelError, match=message):
        Llama(path)


def test_context_parameters_out_of_range(tiny_model_path: Path) -> None:
    for bad in ({"n_ctx": 0}, {"n_batch": 0}, {"flash_attn": "maybe"}):
        with pytest.raises(InvalidParameterError):
            Llama(tiny_model_path, **bad)
    # Past the training length (2048) llama.cpp warns and goes on; so does llamacrab (the
    # warning reaches the llamacrab logger; tests/test_server_compat.py checks it).
    with Llama(tiny_model_path, n_ctx=4096) as llm:
        assert llm.context.n_ctx_seq == 4096
    with pytest.raises(InvalidParameterError, match="unknown Llama parameters"):
        Llama(tiny_model_path, n_ctxx=5)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        # Before: OverflowError or TypeError from cffi filling the C structs
        ({"n_ctx": 2**32}, r"n_ctx must be an integer in 1\.\.4294901760, not 4294967296"),
        ({"n_batch": 10**30}, "n_batch must be an integer"),
        ({"n_threads": 2**31}, r"n_threads must be an integer in 1\.\.512"),
        # libgomp exited the process (status 1) when 4097 threads could not be created
        ({"n_threads_batch": 4097}, r"n_threads_batch must be an integer in 1\.\.512"),
        ({"yarn_orig_ctx": -1}, "yarn_orig_ctx must be an integer in 0"),
        ({"n_gpu_layers": 2**31}, "n_gpu_layers must be an integer"),
        ({"main_gpu": 2**63}, "main_gpu must be an integer"),
        ({"n_ctx": 64.5}, "n_ctx must be an integer"),
        ({"tensor_split": ("x",)}, "tensor_split must be a list of items each a number or None"),
        ({"tensor_split": (float("nan"),)}, "tensor_split holds shares"),
        ({"lora": [5]}, r"lora holds files or \(file, scale\) pairs, not 5"),
        ({"lora": [("a.gguf",)]}, r"lora holds files .*, not \('a.gguf',\)"),
        ({"control_vectors": [("a.gguf", 1.0, 2)]}, "control_vectors holds files or"),
        # Another type: TypeError from a comparison, or OverflowError from cffi, before
        ({"max_queue": "1", "parallel": 2}, "max_queue must be an integer"),
        ({"check_tensors": 2}, "check_tensors must be a bool, not 2"),
        ({"lora": True}, "lora must be a list"),
        ({"n_batch": None}, "n_batch must be an integer, not None"),
        ({"prompt_cache": [1]}, "prompt_cache must be a string or PathLike or None"),
        ({"prompt_cache": "cache\0"}, "cannot hold a prompt cache"),
        ({"kv_overrides": {"general.name": 10**30}}, r"kv_overrides\['general.name'\] must be"),
        # Accepted before, then NaN positions: every logit NaN
        ({"rope_freq_base": float("nan")}, "rope_freq_base must be finite"),
        ({"yarn_ext_factor": float("inf")}, "yarn_ext_factor must be finite"),
    ],
)
def test_parameters_c_cannot_hold_are_refused_before_they_reach_it(
    tiny_model_path: Path, options: dict, match: str
) -> None:
    with pytest.raises(InvalidParameterError, match=match):
        Llama(tiny_model_path, **{"n_ctx": 64, **options})


def test_a_context_whose_cells_outgrow_the_machine_is_refused_at_once(
    tiny_model_path: Path,
) -> None:
    # llama.cpp zero-filled 48 bytes per cell first: 8 GB and 15 s here, then std::bad_alloc
    started = time.monotonic()
    with pytest.raises(ContextError, match=r"n_ctx 2147483648 needs .* 96\.0 GiB for its KV cells"):
        Llama(tiny_model_path, n_ctx=2**31 - 1, n_threads=1)
    assert time.monotonic() - started < 5


def _past_memory(bytes_per_cell: int) -> int:
    """The first power of two of cells whose ``bytes_per_cell`` exceed this machine's memory."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 1 << math.ceil(math.log2(physical / bytes_per_cell + 1))


@pytest.mark.parametrize(
    ("options", "bytes_per_cell"),
    [
        # The tiny model's 2 layers x (32 keys + 32 values) at f16; a 1-token micro-batch's mask.
        ({"n_ubatch": 1}, 48 + 256 + 2),
        # The mask of a 512-token micro-batch, f16: 1 KiB per cell.
        ({"n_ubatch": 512}, 48 + 1024),
    ],
)
def test_a_context_whose_cache_or_mask_outgrows_the_machine_is_refused_at_once(
    tiny_model_path: Path, options: dict, bytes_per_cell: int
) -> None:
    # Below the cells' own limit, llama.cpp zero-filled the cells and the KV cache, then failed
    # on the mask: n_ctx 2^26 took 19 GiB and 60 s here (the OOM killer on a smaller machine).
    n_ctx = _past_memory(bytes_per_cell)
    assert n_ctx * 48 < os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    started = time.monotonic()
    message = rf"n_ctx {n_ctx} needs .* GiB of host memory .* keys and values .* attention mask"
    with Model.load(tiny_model_path) as model:
        with pytest.raises(ContextError, match=message):
            Context(model, ContextParams(n_ctx=n_ctx, n_threads=1, flash_attn="on", **options))
        assert time.monotonic() - started < 5
        with Context(model, ContextParams(n_ctx=256, n_threads=1, **options)) as context:
            assert context.n_ctx == 256  # the model is still usable


def test_bad_prompts_leave_the_llama_usable(tiny_llama: Llama) -> None:
    with pytest.raises(InvalidParameterError, match="empty"):
        tiny_llama.create_completion("")
    with pytest.raises(ContextOverflowError, match="the context holds"):
        tiny_llama.create_completion(" cat" * 200)
    with pytest.raises(TokenizeError, match="outside the vocabulary"):
        tiny_llama.create_completion([1, 5000])
    with pytest.raises(InvalidParameterError, match="NUL"):
        tiny_llama.model.chat_template("a\0b")
    result = tiny_llama.create_completion("the cat sat", max_tokens=3, temperature=0)
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 3


def test_every_error_is_a_llama_error() -> None:
    for error in (ContextOverflowError, InvalidModelError, ModelLoadError, TokenizeError):
        assert issubclass(error, LlamaError)


def test_arguments_a_hunt_found_unchecked_are_refused_by_name(tmp_path: Path) -> None:
    # Each was an AttributeError, ValueError, a silent acceptance or (a FIFO) a hang.
    path = tiny.write_tiny_llama(tmp_path / "fim.gguf", fim=True)
    fifo = tmp_path / "state.fifo"
    os.mkfifo(fifo)
    with Llama(path, n_ctx=128, n_threads=1) as llm:
        refused: list[tuple[type[Exception], str, Any]] = [
            (InvalidParameterError, "lora keys must be LoraAdapter",
             lambda: llm.create_completion("x", lora={"x": 1.0}, max_tokens=1)),
            (InvalidParameterError, r"files must be \(name, text\) pairs of strings",
             lambda: llm.create_infill("a", "b", files=[("x", None)], max_tokens=1)),
            (InvalidParameterError, r"files must be a list of items each a tuple of 2",
             lambda: llm.create_infill("a", "b", files=[("x", "y", "z")], max_tokens=1)),
            (InvalidParameterError, "timeout must be > 0 seconds, not nan",
             lambda: llm.create_completion("x", timeout=math.nan, max_tokens=1)),
            (InvalidParameterError, "capacity_bytes must be positive, not nan",
             lambda: RamCache(capacity_bytes=math.nan)),  # type: ignore[arg-type]
            (InvalidParameterError, "the state path must be a file path",
             lambda: SavedState.load("state\0")),
            (StateError, "is not a regular file", lambda: SavedState.load(tmp_path)),
            (StateError, "is not a regular file", lambda: SavedState.load(fifo)),
        ]  # fmt: skip
        for error, message, call in refused:
            with pytest.raises(error, match=message):
                call()
        done = llm.create_infill("a", "b", files=[("x", "y")], max_tokens=1, temperature=0)
        assert done.choices[0].finish_reason


def _raise_decode_error() -> None:
    raise DecodeError("llama_decode failed: invalid batch", 1)


def test_errors_cross_process_boundaries() -> None:
    # A multiprocessing worker's exception is pickled back; NativeError and DecodeError could
    # not be made again from their text alone: Pool.map hung for ever (a hostile-input hunt).
    import multiprocessing
    import pickle

    errors = [NativeError("llama_tokenize", 3, "bad"), DecodeError("failed", 1),
              DecodeAbortedError("cancelled", 2), ContextOverflowError("big", n_ctx=3),
              RpcError("gone", "host:1"), InvalidParameterError("p"), StateError("s")]  # fmt: skip
    for error in errors:
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error)
        assert vars(again) == vars(error)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        waiting = pool.apply_async(_raise_decode_error)
        with pytest.raises(DecodeError, match="invalid batch") as caught:
            waiting.get(timeout=120)
    assert caught.value.status == 1
