"""The ``archs`` section: the synthesized tiny model of every architecture (synthesized.py),
as it is, without each of its tensors in turn, and a sample of its tampered variants
(tampered.variants) and of the keys of its architecture it lacks (tampered.added_keys); each
loaded, decoded (unless its graph computes no logits) and embedded. A synthesis that died is a
case of its own, done again in the child. The children's heap is poisoned with another byte
than the syntheses' (children.poisoned_heap): a model as it is must compute here what it
computed when it was made, and each case that works must compute the same (the digests in its
details) when it runs again on the syntheses' heap (sections.run_again), or its graph reads
memory nothing wrote."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

from reliability_kit import synthesized, tampered

# The kinds of the first cases: the models as they are, and the syntheses that died.
AS_IT_IS = ("none", "synthesize")


def cases(directory: Path, statuses: dict[str, str], keys: list[str], seed: int,
          count: int | None) -> list[dict[str, Any]]:  # fmt: skip
    """Each loaded model as it is (and each synthesis that died, done again in the child),
    then each without one of its tensors, then its tampered and added-key variants: a sample
    of these (``count`` cases in all, if given) in that order of priority."""
    tiers: list[list[dict[str, Any]]] = [[], [], []]
    arch_keys = [key for key in keys if key.startswith("%s.")]
    for arch, status in statuses.items():
        if status.startswith("died"):
            tiers[0].append({"arch": arch, "spec": {"kind": "synthesize"}})
        if not status.startswith("loaded"):
            continue
        path = directory / f"{arch}.gguf"
        header = tampered.parse(path)
        tiers[0].append({"arch": arch, "spec": {"kind": "none"}})
        tiers[1] += [{"arch": arch, "spec": {"kind": "tensor_remove", "index": index}}
                     for index in range(len(header.tensors))]  # fmt: skip
        variants = tampered.variants(header, path.stat().st_size, seed, n_random=10)
        variants += tampered.added_keys(header, arch_keys)
        tiers[2] += [{"arch": arch, "spec": spec} for spec in variants]
    chosen: list[dict[str, Any]] = []
    for tier in tiers:
        room = len(tier) if count is None else max(0, count - len(chosen))
        chosen += random.Random(seed).sample(tier, min(room, len(tier)))
    return [{"id": f"archs-{i}", **case} for i, case in enumerate(chosen)]


def setup(config: dict[str, Any], slot: int) -> dict[str, Any]:
    return {"directory": Path(config["directory"]), "slot": slot, "work": {},
            "scratch": Path(config["directory"]) / f"scratch-{os.getpid()}.gguf"}  # fmt: skip


def run_case(case: dict[str, Any], state: dict[str, Any]) -> tuple[str, str]:
    """Load the variant, decode with it (unless its graph computes no logits), embed."""
    from llamacrab import InvalidParameterError, Llama

    arch, directory = case["arch"], state["directory"]
    if case["spec"]["kind"] == "synthesize":
        return "ok", synthesized.synthesize(arch, state["scratch"])
    if arch not in state["work"]:
        (directory / "work").mkdir(exist_ok=True)
        state["work"][arch] = tampered.WorkFile.create(
            directory / f"{arch}.gguf", directory / "work", state["slot"]
        )
    work: tampered.WorkFile = state["work"][arch]
    path, undo = work.prepare(case["spec"], state["scratch"])
    details = []
    try:
        here = synthesized.fingerprint(path) if case["spec"]["kind"] == "none" else None
        if here is not None:
            made = json.loads((directory / f"{arch}.json").read_text())["fingerprint"]
            if here != made:
                what = f"{arch} computes differently on another heap (its graph reads memory "
                return "unclean", f"{what}nothing wrote): {made} when made; {here} here"
        try:
            with Llama(path, n_ctx=64, n_batch=64, n_threads=1) as llm:
                details.append(tampered.completion_case(llm, "the cat"))
        except InvalidParameterError as error:
            if "computes no logits" not in str(error):
                raise
        state["use"], state["prompt"] = "embeddings", "the cat"
        details.append(tampered.embeddings_case(path, state)[1])
        return "ok", "; ".join(details)
    finally:
        work.restore(undo)
