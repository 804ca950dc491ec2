"""Tampered saved states: a model's KV state changed in one place and given a valid checksum,
as a careless or hostile writer of a state file or of a shared DiskCache can make one, then
loaded and used through the public API.

The checksum only proves that a state is whole; what llama.cpp's own reader makes of the bytes
is what this section tries. Three tiny models cover its three kinds of memory: an attention KV
cache (llama), a recurrent state (Mamba) and both (Jamba). Each case takes a pristine state of
one of them (a sequence's, the whole context's, or a sequence's checkpoint, which a rewind
loads as a partial state) and changes it: an interesting 32- or 64-bit value written where the
counts, positions and sequence ids sit (the first bytes) or anywhere, a few random bytes,
a cut, or bytes added. Then the state is loaded, a prompt continuing it completed, the state
saved again and an unrelated prompt completed: the same Llama must go on either way.
"""

from __future__ import annotations

import dataclasses
import random
import struct
from pathlib import Path
from typing import Any

from reliability_kit.repo import made_once, script

MODELS = ("llama", "mamba", "jamba")
SCOPES = ("sequence", "context", "checkpoint")
# Sentences: the recurrent models take a checkpoint where the last one starts.
PROMPT = "the cat sat on the mat. " * 4 + "the dog sat on the mat."
LEAVING = "the cat sat on the mat. " * 4 + "the cat is on the mat."  # rewinds to a checkpoint
HEAD_BYTES = 512  # counts, positions and sequence ids of the first cells lie in here
INT32 = (0, 1, 2, -1, -2, 7, 255, 1 << 15, 1 << 16, 1 << 24, 2**31 - 1, -(2**31), 2**31 - 2)
UINT64 = (0, 1, 8, 2**32, 2**62, 2**63, 2**64 - 1)


def cases(seed: int, count: int) -> list[dict[str, Any]]:
    """``count`` case specs, the same list for the same seed. Offsets and lengths are
    fractions or small numbers that the child fits to the state it has."""
    rng = random.Random(seed)
    specs = []
    for i in range(count):
        kind = rng.choice(("int32-head", "int32-head", "int32", "uint64", "bytes", "cut", "grow"))
        spec: dict[str, Any] = {"id": f"states-{seed}-{i}", "model": rng.choice(MODELS),
                                "scope": rng.choice(SCOPES), "kind": kind}  # fmt: skip
        if kind == "int32-head":
            spec["at"] = 4 * rng.randrange(HEAD_BYTES // 4)
            spec["value"] = rng.choice(INT32)
        elif kind in ("int32", "uint64"):
            spec["at"] = rng.random()
            spec["value"] = rng.choice(INT32 if kind == "int32" else UINT64)
        elif kind == "bytes":
            spec["bytes"] = [(rng.random() ** 3, rng.randrange(256))  # mostly near the start
                             for _ in range(rng.choice((1, 2, 4, 16)))]  # fmt: skip
        elif kind == "cut":
            spec["keep"] = rng.random()
        else:
            spec["extra"] = rng.choice((1, 4, 12, 4096))
        specs.append(spec)
    return specs


def tampered(payload: bytes, spec: dict[str, Any]) -> bytes:
    """``payload`` changed as ``spec`` says."""
    data = bytearray(payload)
    kind = spec["kind"]
    if kind in ("int32-head", "int32", "uint64"):
        fmt = "<Q" if kind == "uint64" else ("<i" if spec["value"] < 0 else "<I")
        room = len(data) - struct.calcsize(fmt)
        if room >= 0:
            at = spec["at"] if kind == "int32-head" else int(spec["at"] * room) & ~3
            struct.pack_into(fmt, data, min(at, room), spec["value"])
    elif kind == "bytes":
        for where, value in spec["bytes"]:
            if data:
                data[min(int(where * len(data)), len(data) - 1)] = value
    elif kind == "cut":
        del data[int(spec["keep"] * len(data)) :]
    else:
        data += bytes(range(256)) * (spec["extra"] // 256) + bytes(spec["extra"] % 256)
    return bytes(data)


# -- the child's side ---------------------------------------------------------------------------


def models(workdir: Path) -> dict[str, str]:
    """The three tiny models (scripts/make_tiny_gguf.py), made once."""
    make_tiny = script("make_tiny_gguf")
    writers = {"llama": make_tiny.write_tiny_llama, "mamba": make_tiny.write_tiny_mamba,
               "jamba": make_tiny.write_tiny_jamba}  # fmt: skip
    return made_once(workdir, "tiny-{}.gguf", writers)


# -- the child's side ---------------------------------------------------------------------------


def setup(config: dict[str, Any], slot: int) -> dict[str, Any]:
    """One Llama per model, kept across the cases (a refusal must leave it usable), and its
    pristine states."""
    from llamacrab import Llama

    state: dict[str, Any] = {}
    for name, path in config["models"].items():
        llm = Llama(path, n_ctx=256, n_batch=64, n_threads=1)
        llm.create_completion(PROMPT, max_tokens=1)
        state[name] = (llm, {"sequence": llm.save_state(), "context": llm.save_state("context")})
    return state


def run_case(case: dict[str, Any], state: dict[str, Any]) -> tuple[str, str]:
    """Load the tampered state and use it. A LlamaError raised out of here is the expected
    refusal; either way the same Llama must answer a fresh prompt afterwards."""
    from llamacrab import LlamaError

    llm, saved = state[case["model"]]
    scope = case["scope"]
    base = saved["context" if scope == "context" else "sequence"]
    if scope == "checkpoint":
        if not base.checkpoints:  # an attention model keeps none: its cells can be cut
            return "ok", "no checkpoint to tamper with"
        # Each one changed alike: the rewind loads whichever is newest before LEAVING departs.
        changed = [dataclasses.replace(c, payload=tampered(c.payload, case))
                   for c in base.checkpoints]  # fmt: skip
        bad = dataclasses.replace(base, checkpoints=tuple(changed))
    else:
        bad = dataclasses.replace(base, payload=tampered(bytes(base.payload), case))
    refusal, detail = None, ""
    try:
        llm.load_state(bad)
        follow = LEAVING if scope == "checkpoint" else PROMPT + " the end"
        answer = llm.create_completion(follow, max_tokens=3, temperature=0)
        llm.save_state(scope if scope == "context" else "sequence")
        detail = f"loaded; reused {answer.usage.cached_tokens} tokens"
    except LlamaError as error:
        refusal = error
    llm.reset()
    try:
        other = llm.create_completion("a fresh prompt", max_tokens=2, temperature=0)
    except LlamaError as error:  # not a refusal of the state: the Llama itself is broken
        raise RuntimeError(f"the Llama failed after the tampered state: {error}") from error
    if other.usage.cached_tokens != 0:
        raise RuntimeError(f"reset() kept {other.usage.cached_tokens} tokens")
    if refusal is not None:
        raise refusal
    return "ok", detail
