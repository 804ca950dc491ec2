"""Files of single architectures that llama.cpp loads and then dies on, each made by the
reliability kit's synthesizer (tests/reliability_kit/synthesized.py) with llamacrab's checks
off: the checks refuse each one by name, and without them a child process dies where the
pinned llama.cpp does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llamacrab import Batch, Context, ContextParams, InvalidParameterError, Model

from reliability_kit.children import HEAP_BYTE, OTHER_HEAP_BYTE, poisoned_heap

TESTS = Path(__file__).resolve().parent
ENV = {**os.environ, "GGML_NO_BACKTRACE": "1",
       "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}  # fmt: skip

USE_CHILD = textwrap.dedent("""
    import sys
    from reliability_kit import synthesized
    from llamacrab import InvalidParameterError, Llama, LlamaError
    from llamacrab._native import gguf_reader
    if sys.argv[2] == "unchecked":
        synthesized.without_checks()
        gguf_reader._check_tensors = lambda *args: None
    try:
        try:
            with Llama(sys.argv[1], n_ctx=64, n_batch=64, n_threads=1) as llm:
                llm.create_completion("the cat", max_tokens=2, temperature=0)
        except InvalidParameterError as error:
            if "computes no logits" not in str(error):
                raise
        with Llama(sys.argv[1], n_ctx=64, n_batch=64, n_threads=1, embeddings=True) as llm:
            llm.embed(["the cat", "a crab"])
        print("ran")
    except LlamaError as error:
        print(type(error).__name__, error)
""")


def synthesized(tmp_path: Path, arch: str, **options: Any) -> Path:
    """A tiny ``arch`` model grown from bad starting ``keys`` (named as synthesized.STARTING_KEYS
    names them) with llamacrab's checks off, or a good one without the tensors in ``drop`` or
    with those in ``f16`` stored as F16."""
    path = tmp_path / f"{arch}.gguf"
    options["unchecked"] = "keys" in options
    command = [sys.executable, "-m", "reliability_kit.synthesized", arch, str(path),
               json.dumps(options)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0 and done.stdout.startswith("loaded"), done.stdout + done.stderr
    return path


def use(path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", USE_CHILD, str(path), mode]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=ENV)


DEATHS = {"SIGSEGV": -signal.SIGSEGV, "SIGFPE": -signal.SIGFPE}
ONE_KIND = {"attention.head_count_kv": ("arr", [2, 2])}
NO_KV_GROUPS = {"attention.head_count_kv": ("UINT32", 2)}
SPLIT_QKV = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"]


@pytest.mark.parametrize(
    ("arch", "options", "message", "death"),
    [
        ("lfm2", {"keys": ONE_KIND}, "needs a recurrent layer", "GGML_ASSERT(buffer)"),
        ("plamo2", {"keys": ONE_KIND}, "needs a recurrent layer", "GGML_ASSERT(buffer)"),
        ("phi3", {"drop": SPLIT_QKV}, "blk.0.attn_qkv.weight is missing", "SIGSEGV"),
        ("pockettts", {"drop": SPLIT_QKV[1:2]}, "blk.0.attn_k.weight is missing", "SIGSEGV"),
        ("granitehybrid", {"drop": ["blk.1.ssm_conv1d.bias"]},
         "blk.1.ssm_conv1d.bias is missing", "SIGSEGV"),
        ("qwen3next", {"drop": ["blk.0.attn_gate.weight"]}, "blk.0.attn_gate.weight is missing",
         "SIGSEGV"),
        ("afmoe", {"keys": {"attention.sliding_window": ("UINT32", 0)}},
         "attention.sliding_window > 0", "SIGSEGV"),
        ("minicpm3", {"keys": NO_KV_GROUPS}, "head_count_kv == head_count",
         "a->ne[0] == b->ne[0]"),
        ("t5encoder", {"keys": NO_KV_GROUPS}, "head_count_kv == head_count",
         "ggml_nelements(a) == ne0*ne1*ne2"),
        ("t5encoder", {"keys": {"attention.relative_buckets_count": ("UINT32", 2)}},
         "relative_buckets_count in 4..511", "i01 >= 0 && i01 < ne01"),
        ("t5encoder", {"drop": ["enc.blk.0.attn_rel_b.weight"]}, "enc.blk.0.attn_rel_b.weight",
         "SIGSEGV"),
        ("deepseek2-ocr", {"keys": NO_KV_GROUPS}, "head_count_kv == head_count",
         "a->ne[0] == b->ne[0]"),
        ("dots1", {"keys": {**NO_KV_GROUPS, "expert_gating_func": ("UINT32", 2)}},
         "head_count_kv == head_count",
         "ggml_nelements(a) == ne0*ne1*ne2"),
        ("olmoe", {"keys": NO_KV_GROUPS}, "head_count_kv == head_count",
         "ggml_can_repeat(b, a)"),
        ("kimi-linear", {"keys": {"attention.head_count_kv": ("arr", [2, 0])}},
         "head_count_kv == 1 on attention layers", "a->ne[0] == b->ne[0]"),
        ("deepseek32", {"keys": {"attention.indexer.key_length": ("UINT32", 32)}},
         "indexer.key_length a power of two", "ggml_can_mul_mat(a, b)"),
        ("deepseek2", {"keys": {"attention.temperature_scale": ("FLOAT32", 0.1)}},
         "temperature_length > 0", "n_attn_temp_floor_scale != 0"),
        ("minimax-m2", {"keys": {}}, "needs expert_gating_func", "fatal error"),
        ("llama4", {"keys": {"block_count": ("UINT32", 2)}}, "at least 4 layers",
         "tensor buffer not set"),
        ("cohere2moe", {"keys": {"attention.key_length_swa": ("UINT32", 1000)}},
         "key_length_swa and value_length_swa (1000, 16) must equal", "a->ne[0] == b->ne[0]"),
        ("chameleon", {"keys": {}, "n_vocab": 8000}, "vocabulary of at least 8196",
         "ggml_nelements(a) >= ggml_nelements(b)"),
        ("gpt-oss", {"keys": {"attention.value_length_swa": ("UINT32", 1)}},
         "their _swa values equal to rope.dimension_count", "a->ne[0] == b->ne[0]"),
        ("qwen3vl", {"keys": {"n_deepstack_layers": ("UINT32", 7)}},
         "n_deepstack_layers < block_count", "ggml_can_repeat(b, a)"),
        ("bailingmoe3", {"keys": {"attention.head_count_kv": ("arr", [2, 0])}},
         "head_count_kv == 1 on attention layers", "a->ne[0] == b->ne[0]"),
        ("rwkv6", {"keys": NO_KV_GROUPS}, "head_count_kv 0 or embedding_length",
         "ggml_nelements(a) == ne0*ne1*ne2*ne3"),
        ("falcon-h1", {"f16": ["blk.1.ssm_d"]}, "'blk.1.ssm_d' is a vector of type 1",
         "unsupported types"),
        ("qwen", {"keys": {"attention.head_count_kv": ("arr", [1, 2])}},
         "differs between layers", "a->ne[0] == b->ne[0]"),
        ("mistral4", {"keys": {"expert_count": ("UINT32", 4),
                               "expert_used_count": ("arr", [1, 2])}},
         "expert_used_count the same on every layer", "data_size + view_offs <= ggml_nbytes"),
        ("granitemoe", {"keys": {"rope.dimension_count": ("UINT32", 8)}},
         "rope.dimension_count == attention.key_length", "n_embd_head == n_rot"),
        ("step35", {"keys": {"rope.dimension_count": ("UINT32", 6)}}, "a multiple of 4",
         "n_dims % 2 == 0"),
        ("granite_swa", {"keys": {"attention.rope_pattern": ("arr", [0, 0])}},
         "a layer with rope in attention.rope_pattern", "tensor buffer not set"),
        ("deepseek4", {"keys": {"attention.compress_ratios": ("arr", [0, 0])}},
         "a layer of attention.compress_ratios 4", "SIGFPE"),
        ("deepseek4", {"keys": {"attention.head_count_kv": ("UINT32", 2)}},
         "attention.head_count_kv == 1", "a->ne[0] == b->ne[0]"),
        ("bailingmoe", {"keys": {"attention.value_length": ("UINT32", 1000)}},
         "equal to rope.dimension_count", "a->ne[0] == b->ne[0]"),
        ("kimi-k3", {"keys": {"leading_dense_block_count": ("UINT32", 2**32 - 1)}},
         "leading_dense_block_count <= block_count", "SIGSEGV"),
    ],
    ids=["lfm2-attention-only", "plamo2-attention-only", "phi3-no-attention",
         "pockettts-no-key", "granitehybrid-no-conv-bias", "qwen3next-no-gate", "afmoe-no-window",
         "minicpm3-kv-groups", "t5encoder-kv-groups", "t5encoder-buckets", "t5encoder-no-bias",
         "ocr-kv-groups", "dots1-kv-groups", "olmoe-kv-groups", "kimi-latent-heads",
         "indexer-rotation", "temperature-length", "gating-function", "llama4-layers",
         "cohere2moe-swa-keys", "chameleon-vocabulary", "gpt-oss-swa-values", "qwen3vl-deepstack",
         "bailingmoe3-latent-heads", "rwkv6-kv-groups", "mamba2-f16-ssm-d", "kv-heads-array",
         "experts-used-array", "granitemoe-rope", "step35-rope", "granite-swa-no-rope",
         "deepseek4-no-indexer-layer", "deepseek4-kv-heads", "bailingmoe-value-length",
         "kimi-k3-dense-lead"],
)  # fmt: skip
def test_a_file_llama_cpp_dies_on_is_refused_by_name(
    tmp_path: Path, arch: str, options: dict[str, Any], message: str, death: str
) -> None:
    path = synthesized(tmp_path, arch, **options)
    checked = use(path, "checked")
    assert checked.returncode == 0, checked.stderr[-2000:]
    assert checked.stdout.startswith("InvalidModelError") and message in checked.stdout, (
        checked.stdout
    )
    unchecked = use(path, "unchecked")
    assert unchecked.returncode == DEATHS.get(death, -signal.SIGABRT), (
        f"llama.cpp no longer dies on {path.name} (exit {unchecked.returncode}): re-audit "
        f"docs/native-aborts.md\n{unchecked.stdout}{unchecked.stderr[-2000:]}"
    )
    assert death in DEATHS or death in unchecked.stderr, unchecked.stderr[-2000:]


CONTEXT_CHILD = textwrap.dedent("""
    import json, sys
    from llamacrab import Llama, LlamaError
    from llamacrab._native import batch, context
    if sys.argv[2] == "unchecked":
        context._fit_graph = lambda *args: None
        batch.Batch.output_all = lambda self: None
    options = json.loads(sys.argv[3])
    prompt = options.pop("prompt", "the cat")
    try:
        with Llama(sys.argv[1], n_ctx=512, n_threads=1, **options) as llm:
            if options.get("embeddings"):
                llm.embed(["the cat", "a crab"])
            else:
                llm.create_completion(prompt, max_tokens=2, temperature=0)
        print("ran")
    except LlamaError as error:
        print(type(error).__name__, error)
""")


@pytest.mark.parametrize(
    ("arch", "options", "checked", "death"),
    [
        ("qwen4exp", {"embeddings": True}, "InvalidParameterError embeddings=True",
         "tensor read out of bounds"),
        ("deepseek4", {"embeddings": True}, "InvalidParameterError embeddings=True",
         "tensor read out of bounds"),
        ("plm", {"flash_attn": "on"}, 'InvalidParameterError flash_attn="on"',
         "a->ne[0] == b->ne[0]"),
        ("plm", {"flash_attn": "auto"}, "ran", "a->ne[0] == b->ne[0]"),
        ("chameleon", {"n_batch": 64, "n_ubatch": 32, "prompt": "the cat sat on the mat " * 20},
         "ran", "ggml_nelements(a) >= ggml_nelements(b)"),
        ("dflash", {}, "ContextError", "SIGSEGV"),  # (a drafter: its encoder wants features)
    ],
    ids=["qwen4exp-embeddings", "deepseek4-embeddings", "plm-flash-attention", "plm-auto",
         "chameleon-long-prompt", "dflash-alone"],
)  # fmt: skip
def test_a_context_llama_cpp_dies_on_is_refused_or_avoided(
    tmp_path: Path, arch: str, options: dict[str, Any], checked: str, death: str
) -> None:
    path = synthesized(tmp_path, arch)
    runs = {mode: subprocess.run([sys.executable, "-c", CONTEXT_CHILD, str(path), mode,
                                  json.dumps(options)],
                                 capture_output=True, text=True, timeout=300, env=ENV)
            for mode in ("checked", "unchecked")}  # fmt: skip
    assert runs["checked"].returncode == 0, runs["checked"].stderr[-2000:]
    assert runs["checked"].stdout.startswith(checked), runs["checked"].stdout
    assert runs["unchecked"].returncode == DEATHS.get(death, -signal.SIGABRT), runs["unchecked"]
    assert death in DEATHS or death in runs["unchecked"].stderr, runs["unchecked"].stderr[-2000:]


@pytest.mark.parametrize("arch", ["gemma", "phi3"])
def test_a_rope_of_no_dimensions_is_refused_not_a_hang(tmp_path: Path, arch: str) -> None:
    # ggml's CPU rope kernel loops for ever over 0 dimensions of a whole head.
    path = synthesized(tmp_path, arch, keys={"rope.dimension_count": ("UINT32", 0)})
    checked = use(path, "checked")
    assert "ropes whole heads" in checked.stdout, checked.stdout + checked.stderr[-2000:]
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", USE_CHILD, str(path), "unchecked"],
                       capture_output=True, timeout=20, env=ENV)  # fmt: skip


FINGERPRINT_CHILD = textwrap.dedent("""
    import sys
    from reliability_kit import synthesized
    synthesized.without_checks()
    print(synthesized.fingerprint(sys.argv[1]))
""")


@pytest.mark.parametrize("arch", ["rwkv7", "arwkv7"])
def test_an_rwkv7_head_off_the_kernel_step_is_refused_not_computed_on_garbage(
    tmp_path: Path, arch: str
) -> None:
    # ggml's CPU wkv7 kernel walks a head 32 floats at a time here (64 with AVX-512) with no
    # tail: a head of 16 reads the next head's rows and, at the last, memory past the tensors.
    path = synthesized(tmp_path, arch, keys={"wkv.head_size": ("UINT32", 16)})
    checked = use(path, "checked")
    assert "wkv.head_size a multiple of 64" in checked.stdout, checked.stdout
    heaps = [poisoned_heap(byte) for byte in (OTHER_HEAP_BYTE, HEAP_BYTE)]
    prints = [subprocess.run([sys.executable, "-c", FINGERPRINT_CHILD, str(path)],
                             capture_output=True, text=True, timeout=300, env={**ENV, **heap})
              for heap in heaps]  # fmt: skip
    assert all(done.returncode == 0 for done in prints), prints[0].stderr[-2000:]
    assert prints[0].stdout != prints[1].stdout, (
        f"{arch} with a head of 16 no longer reads memory nothing wrote: re-audit "
        f"docs/native-aborts.md\n{prints[0].stdout}"
    )


def test_a_model_whose_layers_all_slide_is_not_shifted(tmp_path: Path) -> None:
    """The synthesized cohere2 of two sliding-window layers: llama.cpp keeps a cache for the
    other layers with none in it, and the decode after a shift or a divide aborted
    (GGML_ASSERT(buffer), ggml-backend.cpp: an input no layer uses)."""
    path = synthesized(tmp_path, "cohere2")
    with Model.load(path) as model:
        params = ContextParams(n_ctx=256, n_threads=1, swa_full=True)  # a cache that can shift
        with Context(model, params) as ctx, Batch(6) as batch:
            batch.set(np.array([1, 5, 6, 7, 8, 9], np.int32), 0)
            ctx.decode(batch)
            with pytest.raises(InvalidParameterError, match="layers all use a sliding window"):
                ctx.shift(0, -1, p0=2)
            with pytest.raises(InvalidParameterError, match="layers all use a sliding window"):
                ctx.divide(0, 2, p0=2)
            assert ctx.positions(0) == (0, 5)
