"""Tiny models of every architecture the pinned llama.cpp knows, grown from its own refusals.

A synthesis starts from the tiny llama's keys and tensors written under another
architecture's name (with a few keys that give it the layer kinds it is made of) and loads it;
each refusal names what to change: a missing key (added with a plausible value), a key of the
wrong type, a missing tensor (added), a tensor of the wrong shape (given the shape llama.cpp
expects) or tensors the architecture does not use (each dropped if the count of tensors it
creates stays the same). A synthesis that stalls (a refusal it cannot read, or one of
llamacrab's own) leaves that architecture out. The ``archs`` section (archs.py) tampers with
the models it makes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from reliability_kit import tampered
from reliability_kit.children import OTHER_HEAP_BYTE, poisoned_heap
from reliability_kit.repo import REPO, script

# Values for keys llama.cpp asks for, by how their names end (floats: epsilons and scales).
STARTING_VALUES: dict[str, tuple[str, Any]] = {
    "expert_count": ("UINT32", 4),
    "expert_used_count": ("UINT32", 2),
    "expert_shared_count": ("UINT32", 1),
    "expert_group_count": ("UINT32", 2),
    "expert_group_used_count": ("UINT32", 1),
    "expert_feed_forward_length": ("UINT32", 32),
    "expert_shared_feed_forward_length": ("UINT32", 32),
    "ssm.conv_kernel": ("UINT32", 4),
    "ssm.inner_size": ("UINT32", 128),
    "ssm.state_size": ("UINT32", 16),
    "ssm.time_step_rank": ("UINT32", 8),
    "ssm.group_count": ("UINT32", 1),
    "shortconv.l_cache": ("UINT32", 3),
    "wkv.head_size": ("UINT32", 16),
    "attention.kv_lora_rank": ("UINT32", 16),
    "attention.q_lora_rank": ("UINT32", 32),
    "attention.key_length_mla": ("UINT32", 32),
    "attention.value_length_mla": ("UINT32", 16),
    "attention.relative_buckets_count": ("UINT32", 32),
    "attention.sliding_window": ("UINT32", 8),
    "time_mix_extra_dim": ("UINT32", 8),
    "time_decay_extra_dim": ("UINT32", 8),
    "attention.decay_lora_rank": ("UINT32", 8),
    "attention.iclr_lora_rank": ("UINT32", 8),
    "attention.value_residual_mix_lora_rank": ("UINT32", 8),
    "attention.gate_lora_rank": ("UINT32", 8),
    "vocab_size": ("UINT32", 271),
    "attention.key_length": ("UINT32", 16),
    "attention.value_length": ("UINT32", 16),
    "attention.key_length_swa": ("UINT32", 16),
    "attention.value_length_swa": ("UINT32", 16),
    "rope.dimension_sections": ("arr", [4, 2, 2, 0]),
    "attention.sliding_window_pattern": ("arr", [True, False]),
    "attention.indexer.kpool": ("UINT32", 2),
    "attention.indexer.top_k": ("UINT32", 4),
    "attention.indexer.block_size": ("UINT32", 4),
    "attention.indexer.head_count": ("UINT32", 2),
    "attention.indexer.key_length": ("UINT32", 64),
    "expert_gating_func": ("UINT32", 2),
    "hyper_connection.count": ("UINT32", 4),
    "attention.output_group_count": ("UINT32", 2),
    "hrm.layers_per_stack": ("UINT32", 1),
    "hrm.h_cycles": ("UINT32", 1),
    "hrm.l_cycles": ("UINT32", 1),
}
FLOAT_HINTS = ("epsilon", "eps", "scale", "softcap", "factor", "temperature", "multiplier")

# Keys each architecture starts with: the layer kinds a hybrid is made of (layer 0 attention,
# layer 1 recurrent), and values the loader needs before it asks.
Keys = dict[str, tuple[str, Any]]
_HYBRID: Keys = {"attention.head_count_kv": ("arr", [2, 0])}
# Compressed MLA as the converters write it: one KV head of kv_lora_rank + rope dimensions.
_MLA: Keys = {"attention.kv_lora_rank": ("UINT32", 16), "attention.key_length": ("UINT32", 32),
              "attention.value_length": ("UINT32", 16), "attention.head_count_kv": ("UINT32", 1),
              "attention.key_length_mla": ("UINT32", 32),
              "attention.value_length_mla": ("UINT32", 16)}  # fmt: skip
_GROUPS: list[tuple[tuple[str, ...], Keys]] = [
    (("granitehybrid", "jamba", "lfm2", "lfm2moe"), _HYBRID),
    (("bailingmoe3",), {**_MLA, "attention.head_count_kv": ("arr", [1, 0]),
                        "kda.gate_lower_bound": ("FLOAT32", -5.0)}),
    (("wavtokenizer-dec",), {"posnet.embedding_length": ("UINT32", 64),
                             "convnext.embedding_length": ("UINT32", 64)}),
    (("kimi-k3", "kimi-linear"), {**_MLA, "attention.head_count_kv": ("arr", [1, 0])}),
    (("nemotron_h", "nemotron_h_moe"), {**_HYBRID, "feed_forward_length": ("arr", [0, 0])}),
    (("minimax-01", "qwen35", "qwen35moe", "qwen3next", "qwen4exp"),
     {"full_attention_interval": ("UINT32", 2)}),
    (("bert", "jina-bert-v2", "jina-bert-v3", "nomic-bert", "nomic-bert-moe"),
     {"tokenizer.ggml.token_type_count": ("UINT32", 2)}),
    (("deepseek2", "deepseek32", "dots3note", "glm-dsa", "hy_v4", "mistral4"), _MLA),
    (("deepseek2-ocr", "dots1", "minicpm3", "olmoe", "plm", "t5", "t5encoder"),
     {"attention.head_count_kv": ("UINT32", 4)}),
    (("llama4",), {"block_count": ("UINT32", 4)}),
    (("smallthinker",), {"expert_feed_forward_length": ("UINT32", 32)}),
    (("graniteswitch",), {"adapters.count": ("UINT32", 2)}),  # (one per activating token)
    (("gemma4-assistant",), {"embedding_length_out": ("UINT32", 128)}),  # (its target's width)
    (("dflash",), {"target_layers": ("arr", [0, 1])}),
    (("plamo2",), {**_HYBRID, "ssm.group_count": ("UINT32", 0)}),
    (("glm5-next",), {"attention.head_count_kv": ("arr", [1, 0]),
                      "rope.dimension_count": ("UINT32", 0)}),
    (("rwkv6qwen2",), {"token_shift_count": ("UINT32", 1)}),
    (("arwkv7",), {"token_shift_count": ("UINT32", 1), "wkv.head_size": ("UINT32", 64)}),
    (("rwkv7",), {"wkv.head_size": ("UINT32", 64), "attention.gate_lora_rank": ("UINT32", 8)}),
    (("rwkv6",), {"attention.head_count_kv": ("UINT32", 0)}),
    (("deepseek4",), {"expert_gating_func": ("UINT32", 4), "hash_layer_count": ("UINT32", 0),
                      "attention.compress_ratios": ("arr", [4, 128]),
                      "attention.head_count_kv": ("UINT32", 1)}),
]  # fmt: skip
STARTING_KEYS: dict[str, Keys] = {arch: keys for archs, keys in _GROUPS for arch in archs}
# Tensors each architecture starts with: ones its loader reads as optional but a real file has.
_T5_BIAS = [4, 32]  # head_count x relative_buckets_count
STARTING_TENSORS: dict[str, dict[str, list[int]]] = {
    "t5": {"enc.blk.0.attn_rel_b.weight": _T5_BIAS, "dec.blk.0.attn_rel_b.weight": _T5_BIAS},
    "t5encoder": {"enc.blk.0.attn_rel_b.weight": _T5_BIAS},
    "rwkv6": {f"blk.{il}.time_mix_lerp_fused.weight": [64] for il in range(2)},
    "laguna": {f"blk.{il}.attn_gate.weight": [64, 4] for il in range(2)},
}
# Vocabularies larger than the tiny model's 271 tokens (chameleon hides tokens 4..8195).
STARTING_VOCAB = {"chameleon": 8200}
MAX_STEPS = 200


def architectures(source: Path) -> list[str]:
    """Every architecture name of the pinned src/llama-arch.cpp (LLM_ARCH_NAMES)."""
    text = (source / "src" / "llama-arch.cpp").read_text()
    table = text[text.index("LLM_ARCH_NAMES") :]
    table = table[: table.index("};")]
    return re.findall(r'\{\s*LLM_ARCH_\w+,\s*"([^"]+)"\s*\}', table)


# -- growing a model ----------------------------------------------------------------------------


def _full_key(arch: str, key: str) -> str:
    return key if key.startswith(("tokenizer.", "general.")) else f"{arch}.{key}"


def starting_spec(arch: str, n_vocab: int | None = None) -> dict[str, Any]:
    tiny = script("make_tiny_gguf")
    n_vocab = max(n_vocab or STARTING_VOCAB.get(arch, 0), len(tiny.vocabulary()[0]))
    tensors = tiny._tensors(0, n_vocab)
    return {
        "arch": arch,
        "extra_tokens": n_vocab - len(tiny.vocabulary()[0]),
        "keys": {_full_key(arch, k): v for k, v in STARTING_KEYS.get(arch, {}).items()},
        "tensors": {name: list(reversed(data.shape)) for name, data in tensors.items()}
        | STARTING_TENSORS.get(arch, {}),
    }


def write(spec: dict[str, Any], path: Path) -> None:
    import gguf
    import numpy as np

    tiny = script("make_tiny_gguf")
    writer = gguf.GGUFWriter(str(path), spec["arch"])
    extra = [(f"<extra {i}>", gguf.TokenType.NORMAL) for i in range(spec.get("extra_tokens", 0))]
    tiny._metadata(writer, tiny.N_LAYER, 1e-5, extra_tokens=extra)
    for key, (vtype, value) in spec["keys"].items():
        if vtype == "arr":
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, gguf.GGUFValueType[vtype])
    rng = np.random.default_rng(0)
    half = set(spec.get("f16", ()))
    for name, dims in spec["tensors"].items():
        shape = tuple(reversed(dims))
        data = np.ones(shape) if "norm" in name else rng.standard_normal(shape) * 0.02
        writer.add_tensor(name, data.astype(np.float16 if name in half else np.float32))
    tiny.write_gguf(writer, {})


def _refusal(path: Path) -> str | None:
    """Why llama.cpp (or llamacrab's checks) refuses to load the file; None if it loads."""
    from llamacrab import LlamaError, Model

    try:
        Model.load(path).close()
    except LlamaError as error:
        return str(error)
    return None


def _starting_value(key: str) -> tuple[str, Any]:
    for ending, value in STARTING_VALUES.items():
        if key.endswith(ending):
            return value
    if any(hint in key for hint in FLOAT_HINTS):
        return ("FLOAT32", 1e-5 if "eps" in key else 1.0)
    return ("UINT32", 1)


_TYPES = {"f32": ("FLOAT32", 1.0), "u32": ("UINT32", 1), "i32": ("INT32", 1),
          "bool": ("BOOL", False), "str": ("STRING", "x"), "u64": ("UINT64", 1),
          "u16": ("UINT16", 1), "u8": ("UINT8", 1), "arr": ("arr", [1, 1])}  # fmt: skip


def _mend(spec: dict[str, Any], refusal: str, path: Path) -> bool:
    """Change spec as the refusal asks; False when it asks for nothing this can give."""
    keys, tensors = spec["keys"], spec["tensors"]
    if m := re.search(r"array key not found in model: (\S+)", refusal):
        vtype, value = _starting_value(m.group(1))
        keys[m.group(1)] = (vtype, value) if vtype == "arr" else ("arr", [value] * 2)
        return True
    if m := re.search(r"(\S+) has wrong array length; expected (\d+)", refusal):
        keys[m.group(1)] = ("arr", [1] * int(m.group(2)))
        return True
    if m := re.search(r"key not found in model: (\S+)", refusal):
        keys[m.group(1)] = _starting_value(m.group(1))
        return True
    if m := re.search(r"key (\S+) has wrong type \S+ but expected type (\S+)", refusal):
        if m.group(2) not in _TYPES or keys.get(m.group(1), ("",))[0] == _TYPES[m.group(2)][0]:
            return False
        keys[m.group(1)] = _TYPES[m.group(2)]
        return True
    if m := re.search(r"tensor '([^']+)' has wrong shape; expected ([\d, ]+), got", refusal):
        expected = [int(d) for d in m.group(2).split(",")]
        if tensors.get(m.group(1)) == expected:
            return False
        tensors[m.group(1)] = expected
        return True
    if m := re.search(r"tensor '([^']+)' not found|missing tensor '([^']+)'", refusal):
        name = m.group(1) or m.group(2)
        if name in tensors:
            return False
        tensors[name] = [64]  # the shape error that follows gives the right one
        return True
    if m := re.search(r"tensor '([^']+)' has dimensions \[[^\]]*\b0\b", refusal):
        changed = _named_keys(spec, refusal) or tensors[m.group(1)] != [64]
        tensors[m.group(1)] = [64]  # asked again once the keys that size it are there
        return changed
    if m := re.search(r"block_count = (\d+) but the tensors describe (\d+) blocks", refusal):
        wanted, present = int(m.group(1)), int(m.group(2))
        if not 0 < present < wanted <= 8:
            return False
        for name, dims in list(tensors.items()):  # the new blocks as copies of the last ones
            if (block := re.match(r"blk\.(\d+)\.(.*)", name)) and int(block[1]) < present:
                for il in range(present + int(block[1]), wanted, present):
                    tensors[f"blk.{il}.{block[2]}"] = dims
        return True
    if "wrong number of tensors" in refusal:
        return _drop_unused(spec, path)
    if m := re.search(r"(\S+\.(?:weight|bias)) is missing", refusal):
        tensors.setdefault(m.group(1), [64])
        return True
    return _named_keys(spec, refusal)


def _named_keys(spec: dict[str, Any], refusal: str) -> bool:
    """Give the keys a refusal names (by their last part; experts by any mention) their
    starting values."""
    changed = False
    own = STARTING_KEYS.get(spec["arch"], {})
    experts = re.search(r"expert|gate_inp|_exps", refusal, re.IGNORECASE) is not None
    for suffix, value in STARTING_VALUES.items():
        named = re.search(rf"\b{re.escape(suffix.split('.')[-1])}\b", refusal) is not None
        if suffix in own:
            continue
        if named or (experts and suffix in ("expert_count", "expert_used_count")):
            key = _full_key(spec["arch"], suffix)
            if spec["keys"].get(key) != value:
                spec["keys"][key] = value
                changed = True
    return changed


def _created(refusal: str | None) -> int | None:
    m = re.search(r"wrong number of tensors; expected \d+, got (\d+)", refusal or "")
    return int(m.group(1)) if m else None


def _drop_unused(spec: dict[str, Any], scratch: Path) -> bool:
    """Drop each tensor whose absence leaves the count llama.cpp creates the same."""
    created = _created(_refusal(scratch))
    dropped = False
    for name in list(spec["tensors"]):
        dims = spec["tensors"].pop(name)
        write(spec, scratch)
        refusal = _refusal(scratch)
        if refusal is None:
            return True
        if _created(refusal) == created:
            dropped = True
        else:
            spec["tensors"][name] = dims
    write(spec, scratch)
    return dropped


def synthesize(arch: str, path: Path, keys: Keys | None = None, n_vocab: int | None = None) -> str:
    """Grow ``path`` into a loadable tiny ``arch`` model, starting with ``keys`` too (named
    as in STARTING_KEYS) and a vocabulary of ``n_vocab`` (else STARTING_VOCAB's or the tiny
    model's); how it went ("loaded after N steps" or why it stalled). The spec is left beside
    it (``.json``)."""
    spec = starting_spec(arch, n_vocab)
    spec["keys"].update((_full_key(arch, k), v) for k, v in (keys or {}).items())
    status = ""
    for step in range(MAX_STEPS):
        write(spec, path)
        refusal = _refusal(path)
        if refusal is None:
            status = f"loaded after {step} steps"
            break
        if not _mend(spec, refusal, path):
            status = "stalled: " + re.sub(r"\S*/", "", refusal)[:300]
            break
    else:
        status = f"stalled after {MAX_STEPS} steps"
    path.with_suffix(".json").write_text(json.dumps({"status": status, "spec": spec}))
    return status


def fingerprint(path: Path) -> str:
    """What the model computes (tampered.completion_case and embeddings_case: digests of its
    log-probabilities, embeddings and scores), or the kind of error each part raised. Bit for
    bit the same in every process on this machine, unless the graph reads memory nothing
    wrote."""
    from llamacrab import Llama, LlamaError

    parts = []
    try:
        with Llama(path, n_ctx=64, n_batch=64, n_threads=1) as llm:
            parts.append(tampered.completion_case(llm, "the cat"))
    except LlamaError as error:
        parts.append(type(error).__name__)
    try:
        parts.append(tampered.embeddings_case(path, {"prompt": "the cat"})[1])
    except LlamaError as error:
        parts.append(type(error).__name__)
    return "; ".join(parts)


def without_checks() -> None:
    """Load models as llama.cpp alone would (for files that show what a check prevents)."""
    import llamacrab._native.model
    from llamacrab._native.gguf_reader import read_file

    llamacrab._native.model.validate_gguf = lambda path, **kwargs: read_file(path)[:2]


def synthesize_all(source: Path, directory: Path, workers: int = 2) -> dict[str, str]:
    """Each architecture synthesized in a process of its own (a load may abort), once per
    directory; {arch: status}, a death's status naming its signal."""
    from llamacrab._exit_status import describe

    directory.mkdir(parents=True, exist_ok=True)

    def one(arch: str) -> tuple[str, str]:
        path = directory / f"{arch}.gguf"
        record = path.with_suffix(".json")
        if not record.exists():
            command = [sys.executable, "-m", "reliability_kit.synthesized", arch, str(path)]
            env = {**os.environ, **poisoned_heap(OTHER_HEAP_BYTE), "PYTHONPATH": os.pathsep.join(
                [str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
            done = subprocess.run(command, env=env, capture_output=True, timeout=600)
            if done.returncode != 0:
                status = f"died: {describe(done.returncode)}"
                record.write_text(json.dumps({"status": status, "spec": None}))
        return arch, json.loads(record.read_text())["status"]

    with ThreadPoolExecutor(workers) as pool:
        return dict(pool.map(one, architectures(source)))


def main(argv: list[str]) -> None:
    """``ARCH PATH [JSON]``: synthesize (JSON: {"keys": {...}, "n_vocab": N, "drop": [tensor
    names], "f16": [tensor names], "unchecked": true}: starting keys and vocabulary size,
    tensors to drop or store as F16 once it loads, no llamacrab checks). Without JSON, the
    fingerprint of what it computes goes into its record too."""
    options = json.loads(argv[2]) if len(argv) > 2 else {}
    if options.get("unchecked"):
        without_checks()
    path = Path(argv[1])
    keys = {k: tuple(v) for k, v in options.get("keys", {}).items()}
    status = synthesize(argv[0], path, keys, options.get("n_vocab"))
    if not options and status.startswith("loaded"):  # (a model as the archs section uses it)
        record = json.loads(path.with_suffix(".json").read_text())
        record["fingerprint"] = fingerprint(path)
        path.with_suffix(".json").write_text(json.dumps(record))
    if options.get("drop") or options.get("f16"):
        spec = json.loads(path.with_suffix(".json").read_text())["spec"]
        for name in options.get("drop", ()):
            del spec["tensors"][name]
        spec["f16"] = options.get("f16", [])
        write(spec, path)
    print(status)


if __name__ == "__main__":
    main(sys.argv[1:])
