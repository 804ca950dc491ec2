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

import pytest

TESTS = Path(__file__).resolve().parent
ENV = {**os.environ, "GGML_NO_BACKTRACE": "1",
       "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}  # fmt: skip

USE_CHILD = textwrap.dedent("""
    import sys
    from reliability_kit import synthesized
    from llamacrab import InvalidParameterError, Llama, LlamaError
    if sys.argv[2] == "unchecked":
        synthesized.without_checks()
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
    names them) with llamacrab's checks off, or a good one without the tensors in ``drop``."""
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
    ],
    ids=["lfm2-attention-only", "plamo2-attention-only", "phi3-no-attention",
         "pockettts-no-key", "granitehybrid-no-conv-bias", "qwen3next-no-gate", "afmoe-no-window",
         "minicpm3-kv-groups", "t5encoder-kv-groups", "t5encoder-buckets", "t5encoder-no-bias"],
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
