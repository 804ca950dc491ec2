"""Parameters fuzzing: extreme and ill-typed values of every ``Llama`` and completion keyword.

Each case sets one to three keywords to values drawn from pools per kind: integers at and past
the C types' edges (±2^31, 2^32, 2^63, 10^30), floats that are NaN, infinite, past a C float
or tiny, strings that name no choice (empty, a NUL, 10,000 characters), and values of another
type (None, a list, a dict, a bool, a number as text); mixed with ordinary values so that a
case also reaches what follows the first check. Load-time keywords build a new ``Llama`` of the
tiny model per case (kv_overrides over the model's own keys, its LoRA adapter and a control
vector at drawn scales, a prompt cache); completion keywords go to ``create_completion`` on a
``Llama`` kept across the cases, which must answer a plain prompt after each. A LlamaError is
the expected refusal; anything else escaping is unclean; a signal death is what this looks
for: a value that reaches C and aborts.
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path
from typing import Any

from reliability_kit.usable import then_still_answers

INTS = [-(2**63), -(2**31) - 1, -(2**31), -2, -1, 0, 1, 2, 3, 7, 64, 513, 4097, 2**31 - 1, 2**31,
        2**32 - 1, 2**32, 2**63, 10**30]  # fmt: skip
FLOATS = [math.nan, math.inf, -math.inf, -1e39, -1.0, -0.0, 0.0, 1e-45, 0.5, 1.0, 2.0, 1e39,
          1e308]  # fmt: skip
STRINGS = ["", "bogus", "\0", "x" * 10_000, "auto", "on", "f16"]
WRONG = [None, "1", [1], {"a": 1}, True]

# Each keyword: its kind ("int", "float", "str", or a list of its own ordinary values) and a
# few ordinary values, drawn half the time.
LOAD: dict[str, tuple[str, list[Any]]] = {
    "n_ctx": ("int", [64, 128, 2048]),
    "n_batch": ("int", [1, 32, 512]),
    "n_ubatch": ("int", [1, 32, 512]),
    "n_seq_max": ("int", [1, 2, 4]),
    "n_threads": ("int", [1, 2]),
    "n_threads_batch": ("int", [1, 2]),
    "flash_attn": ("str", ["on", "off", "auto"]),
    "type_k": ("str", ["f16", "q8_0", "q4_0", "f32"]),
    "type_v": ("str", ["f16", "q8_0", "q4_0"]),
    "rope_scaling": ("str", ["none", "linear", "yarn"]),
    "rope_freq_base": ("float", [0.0, 10000.0]),
    "rope_freq_scale": ("float", [0.0, 0.5]),
    "yarn_ext_factor": ("float", [-1.0, 1.0]),
    "yarn_orig_ctx": ("int", [0, 2048]),
    "pooling": ("str", ["none", "mean", "last"]),
    "embeddings": ("bool", [False, True]),
    "ctx_checkpoints": ("int", [0, 3]),
    "graph_sampling": ("str", ["auto", "on", "off"]),
    "n_gpu_layers": ("int", [0, -1, 99]),
    "main_gpu": ("int", [0]),
    "split_mode": ("str", ["none", "layer", "row"]),
    "tensor_split": ("floats", [[1.0], [0.5, 0.5]]),
    "use_mmap": ("bool", [True, False]),
    "check_tensors": ("bool", [True]),
    "swa_full": ("bool", [True]),
    "kv_unified": ("bool", [True]),
    "offload_kqv": ("bool", [False]),
    "warmup": ("bool", [True]),
    "parallel": ("int", [1, 2]),
    "max_queue": ("int", [1, 64]),
    "seed": ("int", [0, 1]),
    "kv_overrides": ("overrides", []),
    "lora": ("scaled:lora", []),
    "control_vectors": ("scaled:cvec", []),
    "control_vector_layers": ("pair", [[1, 2], [1, 1]]),
    "prompt_lookup": ("int", [1, 3]),
    "draft_max": ("int", [1, 16]),
    "prompt_cache": ("cache", ["ram"]),
    "prompt_cache_bytes": ("int", [1, 1 << 20]),
}
COMPLETION: dict[str, tuple[str, list[Any]]] = {
    "max_tokens": ("int", [0, 1, 4]),
    "min_tokens": ("int", [0, 2]),
    "temperature": ("float", [0.0, 0.8]),
    "dynatemp_range": ("float", [0.5]),
    "dynatemp_exponent": ("float", [1.0]),
    "top_k": ("int", [1, 40]),
    "top_p": ("float", [0.5, 1.0]),
    "min_p": ("float", [0.05]),
    "typical_p": ("float", [0.9]),
    "top_n_sigma": ("float", [1.5]),
    "xtc_probability": ("float", [0.5]),
    "xtc_threshold": ("float", [0.1]),
    "repeat_penalty": ("float", [1.3]),
    "frequency_penalty": ("float", [0.5]),
    "presence_penalty": ("float", [0.5]),
    "penalty_last_n": ("int", [-1, 0, 64]),
    "repeat_last_n": ("int", [64]),
    "dry_multiplier": ("float", [0.8]),
    "dry_base": ("float", [1.75]),
    "dry_allowed_length": ("int", [2]),
    "dry_penalty_last_n": ("int", [-1, 64]),
    "dry_sequence_breakers": ("strings", [["\n"], []]),
    "mirostat": ("int", [0, 1, 2]),
    "mirostat_tau": ("float", [5.0]),
    "mirostat_eta": ("float", [0.1]),
    "adaptive_p_target": ("float", [0.5]),
    "adaptive_p_decay": ("float", [0.9]),
    "seed": ("int", [1]),
    "logit_bias": ("bias", []),
    "logprobs": ("int", [0, 2]),
    "top_logprobs": ("int", [2]),
    "n_probs": ("int", [2]),
    "stop": ("strings", [["."], "the"]),
    "echo": ("bool", [True]),
    "n": ("int", [1, 2]),
    "best_of": ("int", [2]),
}


def drawn_value(kind: str, ordinary: list[Any], rng: random.Random) -> Any:
    """A value of a keyword of ``kind``: an ordinary one half the time, else an extreme one."""
    if ordinary and rng.random() < 0.5:
        return rng.choice(ordinary)
    if kind == "cache":  # never a directory name ("1"): the child would make it where it runs
        return rng.choice(["ram", "\0", 5, [1], None, "ram\0"])
    if rng.random() < 0.15:
        return rng.choice(WRONG)
    if kind in ("int", "float", "bool"):
        return rng.choice({"int": INTS, "float": FLOATS + INTS[:4], "bool": [0, 2, "yes"]}[kind])
    if kind == "str":
        return rng.choice(STRINGS)
    if kind in ("floats", "pair"):
        pool = FLOATS if kind == "floats" else INTS
        return [rng.choice(pool) for _ in range(rng.choice((0, 1, 2, 3, 300)))]
    if kind == "strings":
        return [rng.choice(STRINGS) for _ in range(rng.choice((1, 2, 5000)))]
    if kind == "bias":  # pairs: JSON would turn integer keys into text on the way
        return {"pairs": [[rng.choice([*INTS, "5", 5]), rng.choice(FLOATS + WRONG)]
                          for _ in range(rng.choice((1, 2, 3)))]}  # fmt: skip
    if kind == "overrides":
        key = rng.choice(["llama.block_count", "llama.context_length", "llama.embedding_length",
                          "llama.attention.head_count", "llama.attention.head_count_kv",
                          "llama.rope.dimension_count", "llama.feed_forward_length",
                          "llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base",
                          "llama.vocab_size", "llama.expert_count", "llama.expert_used_count",
                          "tokenizer.ggml.model", "tokenizer.ggml.bos_token_id",
                          "general.architecture", "", "x" * 200])  # fmt: skip
        return {key: rng.choice(INTS + FLOATS + STRINGS[:4] + [True])}
    file = kind.split(":")[1]  # "scaled:lora", "scaled:cvec": the file, alone or scaled
    scale = rng.choice(FLOATS + INTS[:3] + WRONG)
    return rng.choice([[file], [[file, scale]], [[file, scale, 1]], [[file]], file, [file, file]])


def generate(count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` cases: a load or a completion, each with 1-3 keywords drawn."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        where = "load" if rng.random() < 0.4 else "completion"
        table = LOAD if where == "load" else COMPLETION
        names = rng.sample(sorted(table), rng.choice((1, 1, 2, 3)))
        options = {name: drawn_value(*table[name], rng) for name in names}
        cases.append({"id": f"parameters-{seed}-{i}", "where": where, "options": options})
    return cases


# -- the child's side ----------------------------------------------------------------------------


def setup(config: dict[str, Any], slot: int) -> dict[str, Any]:
    """The Llama kept for completion cases (a refusal must leave it usable), and the files.
    The child works in the section's folder: a path a case makes lands there."""
    from llamacrab import Llama

    Path(config["workdir"]).mkdir(parents=True, exist_ok=True)
    os.chdir(config["workdir"])
    files = config["files"]
    llm = Llama(files["llama"], n_ctx=256, n_threads=1, seed=0)
    return {"llm": llm, "files": files}


def run_case(case: dict[str, Any], state: dict[str, Any]) -> tuple[str, str]:
    from llamacrab import Llama

    options = with_files(case["options"], state["files"])
    if case["where"] == "load":
        keywords = {"n_ctx": 128, "n_threads": 1, **options}
        with Llama(state["files"]["llama"], **keywords) as llm:
            result = llm.create_completion("the cat", max_tokens=2, temperature=0)
        return "ok", f"loaded; {result.usage.completion_tokens} tokens"
    llm = state["llm"]

    def complete() -> str:
        result = llm.create_completion("the cat", **{"max_tokens": 3, **options})
        return f"{result.usage.completion_tokens} tokens"

    return then_still_answers(llm, complete, "values")


def with_files(options: dict[str, Any], files: dict[str, str]) -> dict[str, Any]:
    """The keywords as the API takes them: the tiny LoRA adapter and control vector for their
    names ("lora", "cvec"), a logit_bias dict from its pairs."""

    def real(value: Any) -> Any:
        if isinstance(value, str) and value in ("lora", "cvec"):
            return files[value]
        if isinstance(value, list):
            return [real(v) for v in value]
        return value

    decoded = {}
    for name, value in options.items():
        if name in ("lora", "control_vectors", "lora_path"):
            value = real(value)
        elif name == "logit_bias" and isinstance(value, dict) and "pairs" in value:
            value = dict((key, bias) for key, bias in value["pairs"])
        decoded[name] = value
    return decoded
