"""kv_overrides change what llama.cpp reads at load, not the file: the checks in front of it
read the values it will use. llama_model_meta_val_str shows the file's, so the guards of a
loaded model (pre-tokenizer, architecture) read the overrides over them; an override llama.cpp
ignores is refused, not checked as if it applied; the split keys are not overridden. Cases that
killed the process run in a child."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import pytest

from llamacrab import InvalidParameterError, Llama, Model, ModelParams
from llamacrab._features.footprint import estimate_llama

from support import load_repo_module

REPO = Path(__file__).resolve().parents[1]
SYS_DIR = REPO / "llamacrab-sys"
if str(SYS_DIR) not in sys.path:
    sys.path.insert(0, str(SYS_DIR))  # build_tools: how the build finds the pinned source


def source_dir() -> Path:
    from build_tools.source import resolve_source

    return Path(resolve_source().path)


def run_child(code: str, *args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "GGML_NO_BACKTRACE": "1"},
    )  # fmt: skip


PRE_CHILD = """
    import sys
    from llamacrab import Model, ModelParams
    params = ModelParams(vocab_only=True, kv_overrides={"tokenizer.ggml.pre": "deepseek-llm"})
    with Model.load(sys.argv[1], params) as model:
        print(model.vocab.regex_may_recurse, flush=True)
        print(len(model.vocab.tokenize("a" * 60_000, add_special=False)))
"""


def test_an_overridden_pre_tokenizer_is_guarded() -> None:
    # gpt-2's own splitter is by hand; deepseek-llm's std::regex recursed once per letter, and
    # the guard read the file's "gpt-2": 60,000 letters overflowed the stack (SIGSEGV).
    vocab = source_dir() / "models" / "ggml-vocab-gpt-2.gguf"
    child = run_child(PRE_CHILD, vocab)
    assert child.returncode == 0, f"exit {child.returncode}\n{child.stderr[-3000:]}"
    guarded, n_tokens = child.stdout.split()
    assert guarded == "True" and int(n_tokens) > 0


IGNORED_CHILD = """
    import sys
    from llamacrab import InvalidParameterError, Model, ModelParams
    overrides = {"llama.expert_count": 4, "llama.expert_used_count": 2}
    try:
        Model.load(sys.argv[1], ModelParams(kv_overrides=overrides))
    except InvalidParameterError as error:
        print(error)
"""


def test_an_override_llama_cpp_ignores_is_refused(tiny_model_path: Path) -> None:
    # The file has no expert_used_count, which llama.cpp reads only from the file: the check
    # saw 2 experts used of 4, llama.cpp 0 of 4 (GGML_ASSERT(n_expert_used_max > 0), SIGABRT).
    child = run_child(IGNORED_CHILD, tiny_model_path)
    assert child.returncode == 0, f"exit {child.returncode}\n{child.stderr[-3000:]}"
    assert "has no llama.expert_used_count, and llama.cpp reads that key only" in child.stdout
    # A key the file has is read with its override (the override of a scalar applies).
    with Model.load(tiny_model_path, ModelParams(kv_overrides={"llama.feed_forward_length": 128})):
        pass


ARRAY_CHILD = """
    import sys
    from llamacrab import InvalidModelError, Model, ModelParams
    try:
        Model.load(sys.argv[1], ModelParams(kv_overrides={"llama.expert_count": 4}))
    except InvalidModelError as error:
        print(error)
"""


def test_an_override_of_an_array_read_as_a_key_is_checked(tmp_path: Path) -> None:
    # llama.cpp reads expert_count with get_key, whose override comes before the type check:
    # 4 experts replaced the file's array, none used (SIGABRT); the check kept the array.
    tiny = load_repo_module("scripts/make_tiny_gguf.py")
    path = tmp_path / "array.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    tiny._metadata(writer, tiny.N_LAYER, 1e-5)
    writer.add_array("llama.expert_count", [4, 4])
    tiny.write_gguf(writer, tiny._tensors(0, len(tiny.vocabulary()[0])))
    child = run_child(ARRAY_CHILD, path)
    assert child.returncode == 0, f"exit {child.returncode}\n{child.stderr[-3000:]}"
    assert "expert_count = 4 needs llama.expert_used_count > 0" in child.stdout


def write_two_archs(path: Path) -> Path:
    """The tiny llama, whose header also holds every key a llama-embed model needs."""
    tiny = load_repo_module("scripts/make_tiny_gguf.py")
    writer = gguf.GGUFWriter(str(path), "llama")
    tiny._metadata(writer, tiny.N_LAYER, 1e-5)
    for name, value in [
        ("context_length", tiny.N_CTX_TRAIN), ("embedding_length", tiny.N_EMBD),
        ("block_count", tiny.N_LAYER), ("feed_forward_length", tiny.N_FF),
        ("attention.head_count", tiny.N_HEAD), ("attention.head_count_kv", tiny.N_HEAD_KV),
        ("rope.dimension_count", tiny.N_EMBD // tiny.N_HEAD),
    ]:  # fmt: skip
        writer.add_uint32(f"llama-embed.{name}", value)
    writer.add_float32("llama-embed.attention.layer_norm_rms_epsilon", 1e-5)
    tiny.write_gguf(writer, tiny._tensors(0, len(tiny.vocabulary()[0])))
    return path


def test_an_overridden_architecture_is_the_model_s(tmp_path: Path) -> None:
    # llama.cpp builds llama-embed's graph, which writes no logits: the completion guard read
    # the file's "llama" and sampled from unwritten logits.
    path = write_two_archs(tmp_path / "two-archs.gguf")
    overrides = {"general.architecture": "llama-embed"}
    with Llama(path, n_ctx=64, n_threads=1, kv_overrides=overrides) as llm:
        assert llm.model.arch == "llama-embed"
        assert llm.model.metadata["general.architecture"] == "llama"  # the file's, as shown
        with pytest.raises(InvalidParameterError, match=r"\(llama-embed\) computes no logits"):
            llm.create_completion("the cat", max_tokens=2)
    with Model.load(path) as plain, Model.load(path, ModelParams(kv_overrides=overrides)) as other:
        assert plain.arch == "llama" and plain.identity != other.identity


def test_split_keys_are_not_overridden(tmp_path: Path) -> None:
    # A first part claiming to be whole is checked alone; split.count 2 made llama.cpp load a
    # second part that no check had read.
    tiny = load_repo_module("scripts/make_tiny_gguf.py")
    first = tiny.write_tiny_llama_split(tmp_path, "m")[0]
    data = first.read_bytes()
    key = b"split.count" + struct.pack("<I", gguf.GGUFValueType.UINT16)
    at = data.index(key) + len(key)
    first.write_bytes(data[:at] + struct.pack("<H", 1) + data[at + 2 :])
    with pytest.raises(InvalidParameterError, match=r"split\.count.*never checked"):
        Model.load(first, ModelParams(kv_overrides={"split.count": 2}))


def test_the_memory_estimate_reads_the_overrides(tiny_model_path: Path) -> None:
    # The default context is the trained one up to 4,096 cells: 2,048 in the file, 4,096 with
    # the override, as Llama(...) then allocates.
    plain = estimate_llama(tiny_model_path, {})
    overridden = estimate_llama(tiny_model_path, {"kv_overrides": {"llama.context_length": 4096}})
    assert overridden.kv == 2 * plain.kv > 0


# get_key_or_arr, get_arr and get_arr_n of an LLM_KV key; the vocabulary's and the precision
# policy's lookups of one in the file itself.
_ARRAY_READS = re.compile(r"\b(?:get_key_or_arr|get_arr_n|get_arr)\(\s*(?:llm_kv\()?(LLM_KV_\w+)")
_DIRECT_READS = re.compile(r"gguf_find_key\(\s*\w+,\s*(?:kv|llm_kv)\((LLM_KV_\w+)\)")
_NAMED_READS = re.compile(
    r"(\w+) = ml\.llm_kv\((LLM_KV_\w+)\);\s*const int \w+ = gguf_find_key\(\w+, \1\.c_str\(\)\)"
)


def test_keys_read_only_from_the_file_match_the_source() -> None:
    from llamacrab._native.gguf.archs import READ_ONLY_FROM_FILE

    src = source_dir() / "src"
    arch_cpp = (src / "llama-arch.cpp").read_text(encoding="utf-8")
    names = dict(re.findall(r'\{\s*(LLM_KV_\w+),\s*"([^"]+)"\s*\}', arch_cpp))
    found: set[str] = set()
    for path in [*src.glob("*.cpp"), *src.glob("models/*.cpp")]:
        if path.name != "llama-adapter.cpp":  # adapters are loaded without overrides
            code = path.read_text(encoding="utf-8")
            found |= set(_ARRAY_READS.findall(code)) | set(_DIRECT_READS.findall(code))
            found |= {kid for _, kid in _NAMED_READS.findall(code)}
    derived = {names[kid] for kid in found}
    assert len(derived) > 20  # the patterns still match the source
    assert derived == READ_ONLY_FROM_FILE, (
        f"add {sorted(derived - READ_ONLY_FROM_FILE)}, remove "
        f"{sorted(READ_ONLY_FROM_FILE - derived)} (gguf.archs.READ_ONLY_FROM_FILE)"
    )
