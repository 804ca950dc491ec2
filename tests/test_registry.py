"""ModelRegistry, presets and the memory estimate, through the Python API (the server's
multi-model form is tested in test_server_models.py)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llamacrab import (
    PRESETS,
    ClosedHandleError,
    ConcurrentUseError,
    InvalidParameterError,
    Llama,
    ModelBudgetError,
    ModelEntry,
    ModelLoadError,
    ModelRegistry,
    UnknownModelError,
    estimate_memory,
)

from support import load_repo_module

TINY = {"n_ctx": 128, "n_batch": 32, "n_threads": 1}
# The estimate is within this fraction of what llama.cpp reports after loading.
TOLERANCE = 0.10


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with two tiny models, a split one, a projector named after one, a broken file."""
    folder = tmp_path_factory.mktemp("registry")
    tiny = load_repo_module("scripts/make_tiny_gguf.py")
    tiny.write_tiny_llama(folder / "alpha.gguf", seed=1)
    tiny.write_tiny_llama(folder / "beta.gguf", seed=2)
    tiny.write_tiny_llama_split(folder, "gamma", n_parts=2)
    shutil.copy(folder / "alpha.gguf", folder / "mmproj-beta.gguf")
    (folder / "broken.gguf").write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    return folder


@pytest.fixture
def registry(models: Path) -> Iterator[ModelRegistry]:
    with ModelRegistry() as reg:
        for name in ("alpha", "beta"):
            reg.add(name, models / f"{name}.gguf", **TINY)
        reg.add("gamma", models / "gamma-00001-of-00002.gguf", **TINY)
        reg.add("broken", models / "broken.gguf", **TINY)
        yield reg


def statuses(registry: ModelRegistry) -> dict[str, str]:
    return {e.name: e.status for e in registry.entries()}


# -- presets ---------------------------------------------------------------------------------


@pytest.mark.real_model
def test_preset_sets_options_and_explicit_keywords_override_it(gemma_path: Path) -> None:
    with Llama(gemma_path, preset="low-ram", n_ctx=256, n_threads=2) as llm:
        params = llm.context.params
        assert (params.type_k, params.type_v, params.n_ubatch) == ("q8_0", "q8_0", 128)
        assert params.ctx_checkpoints == 1
        assert params.n_ctx == 256  # explicit, over the preset's 2048
        assert llm.model.params.use_extra_bufts is False
        assert llm.create_completion("Paris is the capital of", max_tokens=2,
                                     temperature=0).usage.completion_tokens == 2  # fmt: skip


def test_every_preset_names_known_options_and_an_unknown_one_fails(tiny_model_path: Path) -> None:
    assert {"low-ram", "balanced", "max-gpu"} <= set(PRESETS)
    f16 = {"type_k": "f16", "type_v": "f16"}  # the tiny model's 16-wide heads cannot be q8_0
    for name in PRESETS:
        with Llama(tiny_model_path, preset=name, n_ctx=128, n_threads=1, **f16) as llm:
            assert llm.context.params.n_ctx == 128
    with pytest.raises(InvalidParameterError, match=r"unknown preset 'huge'.*low-ram"):
        Llama(tiny_model_path, preset="huge")
    with pytest.raises(InvalidParameterError, match="unknown preset"):
        ModelEntry("x", str(tiny_model_path), {"preset": "huge"})


def test_run_takes_a_preset(tiny_model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from llamacrab.cli import main

    argv = ["run", str(tiny_model_path), "-p", "the cat", "-n", "2", "--preset", "balanced",
            "--n-ctx", "128", "--n-threads", "1", "--seed", "7"]  # fmt: skip
    assert main(argv) == 0
    # The random tiny model's text may be whitespace alone: only the final newline is ours.
    assert capsys.readouterr().out.removesuffix("\n")
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        main(["run", str(tiny_model_path), "-p", "the", "--preset", "huge"])


# -- the memory estimate ---------------------------------------------------------------------


def _reported(lines: list[str], llm: Llama) -> int:
    """What llama.cpp reports: the weights, plus the KV, output and compute buffers it logs."""
    return llm.model.size + _logged(lines, "KV|compute|output")


def _logged(lines: list[str], buffers: str) -> int:
    """The bytes of the ``buffers`` (a regex alternation) llama.cpp logs, to the 0.01 MiB."""
    pattern = re.compile(rf"(?:{buffers}) buffer size =\s+([\d.]+) MiB")
    mib = sum(float(m.group(1)) for line in lines for m in [pattern.search(line)] if m)
    return round(mib * 2**20)


@pytest.fixture
def llama_log() -> Iterator[list[str]]:
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger, handler = logging.getLogger("llamacrab"), Keep()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.mark.real_model
@pytest.mark.parametrize(
    "options",
    [
        {"n_ctx": 1024},
        {"n_ctx": 4096, "n_ubatch": 256, "parallel": 4},
        # A KV stream per slot: each its own sliding window, cells padded to 256 per slot.
        {"n_ctx": 8192, "parallel": 4},
        {"n_ctx": 512, "parallel": 8},
        {"preset": "low-ram"},
        {"n_ctx": 2048, "flash_attn": "off"},
        {"n_ctx": 512, "embeddings": True, "pooling": "mean"},
    ],
)
def test_estimate_matches_what_llama_cpp_reports_for_gemma(
    gemma_path: Path, options: dict[str, object], llama_log: list[str]
) -> None:
    estimate = estimate_memory(gemma_path, **options)  # type: ignore[arg-type]
    llama_log.clear()
    with Llama(gemma_path, n_threads=2, **options) as llm:  # type: ignore[arg-type]
        reported = _reported(llama_log, llm)
        assert estimate.weights == llm.model.size
        kv = _logged(llama_log, "KV")
        assert abs(estimate.kv - kv) <= 0.01 * kv, (estimate.kv, kv)
        if estimate.checkpoints:  # taken later, while prompts are decoded: one measured here
            prompt = [2] + [1000 + i for i in range(600)]
            llm.create_completion(prompt, max_tokens=0)
            one = len(
                llm.save_state(slot=0 if options.get("parallel") else None).checkpoints[-1].payload
            )
            count = llm.context.params.ctx_checkpoints * llm.context.params.n_seq_max
            assert abs(estimate.checkpoints - one * count) <= 0.01 * one * count
    loaded = estimate.total - estimate.checkpoints
    assert abs(loaded - reported) <= TOLERANCE * reported, (estimate, reported)


@pytest.mark.real_model
def test_estimate_matches_for_minilm_and_a_tiny_model(
    tiny_model_path: Path, llama_log: list[str]
) -> None:
    minilm = load_repo_module("scripts/convert_bert.py").minilm()
    for path, options in ((minilm, {"embeddings": True, "n_ctx": 512}), (tiny_model_path, TINY)):
        estimate = estimate_memory(path, **options)  # type: ignore[arg-type]
        llama_log.clear()
        with Llama(path, **options) as llm:  # type: ignore[arg-type]
            reported = _reported(llama_log, llm)
        assert abs(estimate.total - reported) <= TOLERANCE * reported, (path, estimate, reported)


# -- the registry ----------------------------------------------------------------------------


def test_get_loads_on_first_use_and_shares_the_llama(registry: ModelRegistry) -> None:
    assert statuses(registry)["alpha"] == "unloaded"
    first = registry.get("alpha")
    assert registry.get("alpha") is first
    status = registry.status("alpha")
    assert status.status == "loaded" and status.estimate is not None and status.kind == "generation"
    assert (
        first.create_completion("the cat", max_tokens=2, min_tokens=2).usage.completion_tokens == 2
    )
    registry.get("gamma")  # a split model
    assert statuses(registry) == {"alpha": "loaded", "beta": "unloaded", "gamma": "loaded",
                                  "broken": "unloaded"}  # fmt: skip
    with pytest.raises(UnknownModelError, match=r"no model named 'nope'.*alpha"):
        registry.get("nope")


def test_a_broken_entry_fails_with_its_reason_and_the_others_keep_working(
    registry: ModelRegistry,
) -> None:
    alpha = registry.get("alpha")
    failed = r"model 'broken' failed to load: .*broken\.gguf"
    with pytest.raises(ModelLoadError, match=failed) as first:
        registry.get("broken")
    status = registry.status("broken")
    assert status.status == "failed" and status.error and "broken.gguf" in status.error
    with pytest.raises(ModelLoadError) as again:
        registry.get("broken")  # reported again, not retried, in the same words
    assert str(again.value) == str(first.value)
    assert (
        alpha.create_completion("the cat", max_tokens=1, min_tokens=1).usage.completion_tokens == 1
    )
    assert registry.unload("broken") is False and registry.status("broken").status == "unloaded"


def test_concurrent_gets_load_once(registry: ModelRegistry) -> None:
    got: list[Llama] = []
    threads = [threading.Thread(target=lambda: got.append(registry.get("beta")))
               for _ in range(4)]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(got) == 4 and all(llm is got[0] for llm in got)


def test_unload_closes_and_refuses_a_model_in_use(registry: ModelRegistry) -> None:
    with registry.use("alpha") as alpha:
        assert registry.status("alpha").in_use == 1
        with pytest.raises(ConcurrentUseError, match="in use"):
            registry.unload("alpha")
    assert registry.unload("alpha") is True
    assert alpha.closed and registry.status("alpha").status == "unloaded"
    with pytest.raises(ClosedHandleError):
        alpha.tokenize("the cat")
    assert registry.get("alpha") is not alpha  # loads again


def test_max_loaded_evicts_the_least_recently_used_never_one_in_use(models: Path) -> None:
    with ModelRegistry(max_loaded=2) as registry:
        for name in ("alpha", "beta", "gamma"):
            path = models / (f"{name}.gguf" if name != "gamma" else "gamma-00001-of-00002.gguf")
            registry.add(name, path, **TINY)
        alpha = registry.acquire("alpha")  # in use from here
        beta = registry.get("beta")
        registry.get("gamma")  # beta is the least recently used idle one
        assert beta.closed and not alpha.closed
        assert statuses(registry) == {"alpha": "loaded", "beta": "unloaded", "gamma": "loaded"}
        registry.get("beta")  # now gamma goes: alpha is still in use
        assert statuses(registry)["gamma"] == "unloaded"
        with registry.use("beta"), pytest.raises(ModelBudgetError, match="in use") as busy:
            registry.get("gamma")  # both loaded ones in use: no room
        assert not busy.value.alone and not busy.value.permanent  # room may come
        assert statuses(registry)["gamma"] == "unloaded"  # not failed: room may come later
        registry.release("alpha")  # idle now; its last use is now, after beta's
        registry.get("gamma")
        assert statuses(registry) == {"alpha": "loaded", "beta": "unloaded", "gamma": "loaded"}


def test_pinned_entries_are_never_evicted(models: Path) -> None:
    with ModelRegistry(max_loaded=1) as registry:
        registry.add("alpha", models / "alpha.gguf", pinned=True, **TINY)
        registry.add("beta", models / "beta.gguf", **TINY)
        registry.get("alpha")
        with pytest.raises(ModelBudgetError, match="pinned"):
            registry.get("beta")
        assert registry.unload("alpha")  # on request it goes
        registry.get("beta")


def test_memory_budget_evicts_by_estimate(models: Path) -> None:
    one = estimate_memory(models / "alpha.gguf", **TINY).total
    with ModelRegistry(memory_budget=int(one * 2.5)) as registry:
        for name in ("alpha", "beta"):
            registry.add(name, models / f"{name}.gguf", **TINY)
        registry.add("gamma", models / "gamma-00001-of-00002.gguf", **TINY)
        registry.add("big", models / "alpha.gguf", **{**TINY, "n_ctx": 4096})
        registry.get("alpha")
        registry.get("beta")
        registry.get("gamma")  # a third does not fit: alpha, least recently used, goes
        assert statuses(registry)["alpha"] == "unloaded"
        assert sum(e.estimate.total for e in registry.entries()
                   if e.status == "loaded" and e.estimate) <= one * 2.5  # fmt: skip
        with pytest.raises(ModelBudgetError, match="more than the whole memory budget") as big:
            registry.get("big")
        assert big.value.alone  # no room will ever come: the server says so (model_too_large)


def test_keep_alive_unloads_an_idle_model_but_not_one_in_use(models: Path) -> None:
    with ModelRegistry(keep_alive=0.3) as registry:
        registry.add("alpha", models / "alpha.gguf", **TINY)
        registry.add("beta", models / "beta.gguf", keep_alive=60, **TINY)
        alpha, beta = registry.get("alpha"), registry.get("beta")
        deadline = time.monotonic() + 10
        while not alpha.closed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alpha.closed and not beta.closed
        with registry.use("alpha") as again:
            time.sleep(0.8)
            assert not again.closed  # in use: never expires
        deadline = time.monotonic() + 10
        while not again.closed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert again.closed and registry.status("alpha").status == "unloaded"


def test_a_generation_from_get_keeps_its_model_loaded_until_it_ends(models: Path) -> None:
    # Found by the registry reliability section: with a short keep_alive, a one-slot model
    # reached through get() was closed under its own generation (ClosedHandleError mid-stream).
    with ModelRegistry(keep_alive=0.0) as registry:
        registry.add("alpha", models / "alpha.gguf", **TINY)
        stream = registry.get("alpha").stream_completion("the cat", max_tokens=8, min_tokens=8)
        next(stream)
        time.sleep(0.5)  # the keep-alive timer looked several times meanwhile
        assert registry.status("alpha").status == "loaded"
        with pytest.raises(ConcurrentUseError, match=r"0 leases, generating"):
            registry.unload("alpha")
        rest = list(stream)  # the generation went on to its end
        assert sum(len(c.tokens) for c in rest) == 7 and rest[-1].finish_reason == "length"
        deadline = time.monotonic() + 10
        while registry.status("alpha").status == "loaded" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert registry.status("alpha").status == "unloaded"  # idle once it ended


def test_an_entry_whose_context_cannot_be_made_fails_to_load(models: Path) -> None:
    # Any refusal while loading is the entry's failure to load, the first time as every later
    # one (a ContextError escaped the first get, and the server's routes, before).
    with ModelRegistry() as registry:
        registry.add("huge", models / "alpha.gguf", **{**TINY, "n_ctx": 2**31 - 1})
        for _ in range(2):
            with pytest.raises(ModelLoadError, match="failed to load: ContextError: n_ctx"):
                registry.get("huge")
        assert registry.status("huge").status == "failed"


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: ModelRegistry(max_loaded="2"), "max_loaded must be an integer"),
        (lambda: ModelRegistry(max_loaded=0), "max_loaded must be an integer in 1"),
        (lambda: ModelRegistry(keep_alive=math.nan), "keep_alive must be a number"),
        (lambda: ModelRegistry(keep_alive="1"), "keep_alive must be a number"),
        (lambda: ModelRegistry(memory_budget=0), "memory_budget must be positive"),
        (lambda: ModelRegistry(memory_budget="-1GiB"), "not a size"),
        (lambda: ModelEntry("a", "a.gguf", keep_alive=-1), "keep_alive must be a number"),
        (lambda: ModelEntry("a", "a.gguf", pinned="yes"), "pinned"),  # type: ignore[arg-type]
        (lambda: ModelEntry("a", "a.gguf", options=[1]), "options"),  # type: ignore[arg-type]
        (
            lambda: ModelRegistry(
                [ModelEntry("a", "a.gguf", pinned=True), ModelEntry("b", "b.gguf", pinned=True)],
                max_loaded=1,
            ),
            r"2 models are pinned \('a', 'b'\), more than max_loaded 1",
        ),
        (
            lambda: ModelRegistry([ModelEntry("a", "a.gguf", pinned=True)], max_loaded=1).add(
                "b", "b.gguf", pinned=True
            ),
            r"pinned \('a', 'b'\)",
        ),
    ],
)
def test_limits_and_entries_of_another_type_or_range_are_refused(make: Any, match: str) -> None:
    # Found by the registry reliability section: TypeErrors from a comparison before.
    with pytest.raises(InvalidParameterError, match=match):
        make()


def test_from_toml_reads_entries_limits_and_relative_paths(models: Path, tmp_path: Path) -> None:
    config = tmp_path / "models.toml"
    shutil.copy(models / "alpha.gguf", tmp_path / "alpha.gguf")
    config.write_text(
        'max_loaded = 1\nmemory_budget = "2 GiB"\nkeep_alive = 300\n'
        '[models.chat]\nmodel = "alpha.gguf"\npreset = "low-ram"\nn_ctx = 128\nn_threads = 1\n'
        'type_k = "f16"\ntype_v = "f16"\n'
        f'pinned = true\n[models.other]\nmodel = "{models / "beta.gguf"}"\nkeep_alive = 5\n'
    )
    with ModelRegistry.from_toml(config) as registry:
        assert (registry.max_loaded, registry.memory_budget) == (1, 2 * 2**30)
        chat = registry.entry("chat")
        assert chat.model == str(tmp_path / "alpha.gguf") and chat.pinned
        options = chat.llama_options()  # the preset's, then the entry's own
        assert (options["n_ubatch"], options["type_k"], options["n_ctx"]) == (128, "f16", 128)
        assert registry.status("other").keep_alive == 5
        assert registry.status("chat").keep_alive == 300
        assert registry.get("chat").context.params.n_ctx == 128
    config.write_text('[models.x]\nmodel = "alpha.gguf"\nn_ctxx = 1\n')
    with pytest.raises(InvalidParameterError, match=r"unknown options.*n_ctxx"):
        ModelRegistry.from_toml(config)
    # Found by an audit: the string "false" pinned the entry (bool() of it), and a file
    # that is not UTF-8 was a UnicodeDecodeError traceback.
    config.write_text('[models.x]\nmodel = "alpha.gguf"\npinned = "false"\n')
    with pytest.raises(InvalidParameterError, match="pinned"):
        ModelRegistry.from_toml(config)
    config.write_bytes(b'[models.x]\nmodel = "\xff.gguf"\n')
    with pytest.raises(InvalidParameterError, match="cannot read the model registry"):
        ModelRegistry.from_toml(config)


def test_a_folder_skips_files_whose_names_are_not_utf8(
    models: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Such a name cannot be a model's in JSON: /v1/models, /health and /metrics answered 500.
    shutil.copy(models / "alpha.gguf", tmp_path / "alpha.gguf")
    shutil.copy(models / "alpha.gguf", tmp_path / os.fsdecode(b"\xff\xfe.gguf"))
    (tmp_path / os.fsdecode(b"sub\xff")).mkdir()
    with (
        caplog.at_level(logging.WARNING, "llamacrab"),
        ModelRegistry.from_directory(tmp_path) as registry,
    ):
        assert registry.names() == ["alpha"]
    assert sum("is not UTF-8" in record.message for record in caplog.records) == 2


def test_from_directory_groups_split_files_and_pairs_projectors(models: Path) -> None:
    with ModelRegistry.from_directory(models) as registry:
        assert registry.names() == ["alpha", "beta", "broken", "gamma"]
        assert registry.entry("gamma").model.endswith("gamma-00001-of-00002.gguf")
        assert registry.entry("beta").options["mmproj"].endswith("mmproj-beta.gguf")
        assert "mmproj" not in registry.entry("alpha").options


@pytest.mark.real_model
def test_from_directory_recognises_an_embedding_model(tmp_path: Path) -> None:
    minilm = load_repo_module("scripts/convert_bert.py").minilm()
    (tmp_path / "minilm.gguf").symlink_to(minilm)
    with ModelRegistry.from_directory(tmp_path) as registry:
        assert registry.status("minilm").kind == "embeddings"
        assert registry.get("minilm").embed("a crab").shape[-1] == 384


def test_a_busy_parallel_slot_counts_as_in_use_and_force_unload_cancels_it(models: Path) -> None:
    from support import Gate

    with ModelRegistry(max_loaded=1) as registry:
        registry.add("alpha", models / "alpha.gguf", parallel=1, **TINY)
        registry.add("beta", models / "beta.gguf", **TINY)
        alpha, gate = registry.get("alpha"), Gate()  # no lease: the busy slot alone counts
        scheduler = alpha.scheduler
        assert scheduler is not None
        stream = alpha.stream_completion("the cat", max_tokens=None, min_tokens=9,
                                         custom_samplers=(gate,))  # fmt: skip
        deadline = time.monotonic() + 10
        while scheduler.busy_slots == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(ModelBudgetError, match="in use"):
            registry.get("beta")
        with pytest.raises(ConcurrentUseError):
            registry.unload("alpha")
        closer = threading.Thread(target=registry.unload, args=("alpha",), kwargs={"force": True})
        closer.start()
        gate.open.set()
        closer.join(timeout=30)
        assert not closer.is_alive() and alpha.closed
        try:
            reasons = [chunk.finish_reason for chunk in stream]
            assert reasons[-1] == "cancelled"
        except ClosedHandleError:
            pass  # closed before the stream saw its end: an error, never a crash
        assert registry.get("beta").create_completion("the", max_tokens=1).usage


def test_threads_using_models_under_max_loaded(models: Path) -> None:
    """Many threads use three models with room for two: each use either runs or is refused
    with ModelBudgetError, never more than two are loaded, and nothing else goes wrong."""
    errors: list[BaseException] = []
    most = 0
    with ModelRegistry(max_loaded=2) as registry:
        for name in ("alpha", "beta"):
            registry.add(name, models / f"{name}.gguf", **TINY)
        registry.add("gamma", models / "gamma-00001-of-00002.gguf", **TINY)

        def work(seed: int) -> None:
            nonlocal most
            for i in range(12):
                name = ("alpha", "beta", "gamma")[(seed + i) % 3]
                try:
                    with registry.use(name) as llm:
                        loaded = sum(e.status == "loaded" for e in registry.entries())
                        most = max(most, loaded)
                        assert llm.create_completion("the cat", max_tokens=2).usage
                except ModelBudgetError:
                    pass
                except BaseException as error:  # collected for the assertion below
                    errors.append(error)

        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not errors and 1 <= most <= 2
        assert all(e.in_use == 0 for e in registry.entries())


def test_an_entry_may_name_a_hub_repository(models: Path, tmp_path: Path) -> None:
    from hub_server import HubServer, Repo

    files = {"alpha-Q4_K_M.gguf": (models / "alpha.gguf").read_bytes()}
    hub = HubServer({"crab/alpha": Repo({"main": files})})
    try:
        config = tmp_path / "hub.toml"
        cache = tmp_path / "cache"
        config.write_text(
            f'[models.remote]\nmodel = "crab/alpha"\nendpoint = "{hub.endpoint}"\n'
            f'cache_dir = "{cache}"\nn_ctx = 128\nn_threads = 1\n'
        )
        with ModelRegistry.from_toml(config) as registry:
            llm = registry.get("remote")  # fetched, estimated, loaded
            assert (
                llm.create_completion("the cat", max_tokens=1, min_tokens=1).usage.completion_tokens
                == 1
            )
            status = registry.status("remote")
            assert status.model == "crab/alpha" and status.estimate is not None
            assert status.estimate.weights == llm.model.size
    finally:
        hub.close()


def test_a_folder_pairs_a_real_projector_with_its_model(tmp_path: Path) -> None:
    tiny = load_repo_module("scripts/make_tiny_gguf.py")
    mmproj = load_repo_module("scripts/make_tiny_mmproj.py")
    tiny.write_tiny_llama(tmp_path / "seer-Q8_0.gguf")
    mmproj.write_tiny_vision_mmproj(tmp_path / "mmproj-seer-f16.gguf")
    tiny.write_tiny_llama(tmp_path / "other.gguf", seed=3)
    with ModelRegistry.from_directory(tmp_path, options=TINY) as registry:
        assert registry.names() == ["other", "seer-Q8_0"]
        seer = registry.get("seer-Q8_0")
        assert seer.projector is not None and registry.get("other").projector is None
        estimate = registry.status("seer-Q8_0").estimate
        assert estimate is not None and estimate.weights > seer.model.size  # projector counted


# -- limits, with stand-ins for the loaded models -------------------------------------------


class Fake:
    """What a loader may make of an entry instead of a Llama (the server's isolated entry)."""

    scheduler = None
    busy = False

    def __init__(self, name: str, owner: Fakes) -> None:
        self.name, self.owner, self.closed = name, owner, False

    def cancel(self) -> None:
        if self.owner.log_cancels:
            self.owner.log.append(f"cancel {self.name}")

    def close(self) -> None:
        if self.name in self.owner.slow:  # as a process of its own ends, up to 10 s later
            self.owner.log.append(f"closing {self.name}")
            self.owner.gate.wait(10)
        self.closed = True
        self.owner.log.append(f"closed {self.name}")
        if self.name in self.owner.failing:
            raise RuntimeError(f"{self.name} would not close")


class Fakes:
    """A loader of Fakes, logging what happens to them: the ``slow`` ones' close waits for
    ``gate``, the ``failing`` ones' raises; their cancels too with ``log_cancels``."""

    def __init__(self, slow: tuple[str, ...] = (), failing: tuple[str, ...] = (),
                 log_cancels: bool = False) -> None:  # fmt: skip
        self.slow, self.failing, self.log_cancels = slow, failing, log_cancels
        self.gate = threading.Event()
        self.log: list[str] = []
        self.made: dict[str, Fake] = {}

    def __call__(self, entry: ModelEntry) -> Fake:
        self.log.append(f"load {entry.name}")
        self.made[entry.name] = Fake(entry.name, self)
        return self.made[entry.name]


def _started(registry: ModelRegistry, name: str) -> threading.Thread:
    thread = threading.Thread(target=registry.start, args=(name,), daemon=True)
    thread.start()
    return thread


def _wait_for(condition: Any) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.parametrize(
    ("how", "failing"),
    [("forced unload", ()), ("keep_alive", ()), ("forced unload", ("alpha",))],
    ids=["forced unload", "keep_alive", "a close that raises"],
)
def test_a_model_still_closing_keeps_its_room_until_its_close_returns(
    models: Path, how: str, failing: tuple[str, ...]
) -> None:
    # Found by an audit: an unloaded model stopped counting before its close returned (an
    # isolated entry's process serves on for up to 10 s after SIGTERM), and another model
    # loaded beside it, over max_loaded or the memory budget. A close that raises ends too.
    fakes = Fakes(slow=("alpha",), failing=failing)
    one = estimate_memory(models / "alpha.gguf", **TINY).total
    limits: dict[str, Any] = (
        {"max_loaded": 1} if how == "forced unload"
        else {"memory_budget": int(one * 1.5), "keep_alive": 0.1}
    )  # fmt: skip
    with ModelRegistry(loader=fakes, **limits) as registry:
        registry.add("alpha", models / "alpha.gguf", **TINY)
        registry.add("beta", models / "beta.gguf", **TINY)
        try:
            registry.start("alpha")

            def unload() -> None:
                with contextlib.suppress(RuntimeError):  # alpha's close, when it raises
                    registry.unload("alpha", force=True)

            if how == "forced unload":
                threading.Thread(target=unload, daemon=True).start()
            _wait_for(lambda: "closing alpha" in fakes.log)
            loading = _started(registry, "beta")
            time.sleep(0.3)
            assert registry.status("beta").status == "loading"  # waiting, neither failed
            assert fakes.log == ["load alpha", "closing alpha"]  # nor loaded beside it
        finally:
            fakes.gate.set()
        loading.join(10)
        assert fakes.log[:4] == ["load alpha", "closing alpha", "closed alpha", "load beta"]
        assert registry.status("beta").status in ("loaded", "unloaded")  # keep_alive: gone


def test_the_registry_closes_every_model_and_waits_for_those_closing(models: Path) -> None:
    fakes = Fakes(slow=("alpha",), failing=("beta",))
    registry = ModelRegistry(loader=fakes)
    for name in ("alpha", "beta", "gamma"):
        registry.add(name, models / "alpha.gguf", **TINY)
        registry.start(name)
    threading.Thread(target=registry.unload, args=("alpha",), daemon=True).start()
    _wait_for(lambda: "closing alpha" in fakes.log)
    threading.Timer(0.3, fakes.gate.set).start()
    with pytest.raises(RuntimeError, match="beta would not close"):
        registry.close()  # beta's close raised: gamma is closed all the same
    assert all(fake.closed for fake in fakes.made.values())  # alpha's too, before it returned


def test_no_room_beside_pinned_models_is_permanent_and_evicts_nothing(models: Path) -> None:
    # Found by an audit: a server answered 503 model_busy, which clients retry for ever.
    fakes = Fakes()
    with ModelRegistry(max_loaded=1, loader=fakes) as registry:
        registry.add("alpha", models / "alpha.gguf", pinned=True, **TINY)
        registry.add("beta", models / "beta.gguf", **TINY)
        registry.start("alpha")
        with pytest.raises(ModelBudgetError, match="beside the pinned models 'alpha'") as full:
            registry.start("beta")
        assert full.value.permanent and not full.value.alone
    one = estimate_memory(models / "alpha.gguf", **TINY).total
    big = estimate_memory(models / "alpha.gguf", **{**TINY, "n_ctx": 4096}).total
    fakes = Fakes()
    with ModelRegistry(memory_budget=one + big - 1, loader=fakes) as registry:
        registry.add("alpha", models / "alpha.gguf", pinned=True, **TINY)
        registry.add("beta", models / "beta.gguf", **TINY)
        registry.add("big", models / "alpha.gguf", **{**TINY, "n_ctx": 4096})
        registry.start("alpha")
        registry.start("beta")  # idle: unloading it would not make room for big
        with pytest.raises(ModelBudgetError, match="budget is taken") as full:
            registry.start("big")
        assert full.value.permanent and statuses(registry)["beta"] == "loaded"


@pytest.mark.parametrize(
    "said",
    [
        "model 'apart': its process exited with 1: no memory",  # the process ended
        "model 'apart' failed to load: its process exited with 1: no memory",  # it answered
    ],
)
def test_a_failed_load_says_it_once(models: Path, said: str) -> None:
    def load(entry: ModelEntry) -> Fake:
        raise ModelLoadError(said)

    with ModelRegistry(loader=load) as registry:
        registry.add("apart", models / "alpha.gguf", **TINY)
        for obtain in (registry.start, registry.lease):  # the first time as every later one
            with pytest.raises(ModelLoadError) as failed:
                obtain("apart")
            assert str(failed.value) == (
                "model 'apart' failed to load: its process exited with 1: no memory"
            )
        assert registry.status("apart").error == "its process exited with 1: no memory"


def test_one_object_two_entries_share_is_closed_and_uncounted_once_per_entry(
    models: Path,
) -> None:
    # Found by review: unloads were counted by id(), so the second of two entries sharing
    # one object raised KeyError inside the close, leaving the rest unclosed and counted:
    # close() never returned.
    fakes = Fakes()
    shared = Fake("shared", fakes)
    registry = ModelRegistry(loader=lambda e: shared if e.name != "own" else fakes(e))
    for name in ("p", "q", "own"):
        registry.add(name, models / "alpha.gguf", **TINY)
        registry.start(name)
    closing = threading.Thread(target=registry.close, daemon=True)
    closing.start()
    closing.join(10)
    assert not closing.is_alive() and fakes.made["own"].closed and shared.closed
    assert fakes.log.count("closed shared") == 2


def test_a_model_evicted_that_fails_to_close_does_not_fail_the_load_it_made_room_for(
    models: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Found by review: alpha's close error was raised from loading beta, and beta stayed
    # failed with alpha's reason until someone loaded it again.
    fakes = Fakes(failing=("alpha",))
    with ModelRegistry(max_loaded=1, loader=fakes) as registry:
        registry.add("alpha", models / "alpha.gguf", **TINY)
        registry.add("beta", models / "beta.gguf", **TINY)
        registry.start("alpha")
        with caplog.at_level(logging.WARNING, logger="llamacrab"):
            registry.start("beta")
        assert statuses(registry) == {"alpha": "unloaded", "beta": "loaded"}
    assert "an unloaded model failed to close: RuntimeError: alpha would not close" in caplog.text


def test_eviction_spares_the_models_the_room_does_not_need(models: Path) -> None:
    # Found by review: least recently used first, a small model went too when the larger one
    # after it made room alone.
    small = estimate_memory(models / "alpha.gguf", **TINY).total
    large = {**TINY, "n_ctx": 4096}
    big = estimate_memory(models / "alpha.gguf", **large).total
    fakes = Fakes()
    with ModelRegistry(memory_budget=small + big + small // 2, loader=fakes) as registry:
        registry.add("small", models / "alpha.gguf", **TINY)
        registry.add("large", models / "alpha.gguf", **large)
        registry.add("next", models / "beta.gguf", **large)  # room: large's, not small's
        registry.start("small")  # the least recently used
        registry.start("large")
        registry.start("next")
        assert statuses(registry) == {"small": "loaded", "large": "unloaded", "next": "loaded"}


def test_closing_the_registry_cancels_every_model_before_closing_any(models: Path) -> None:
    # Found by review: each model was cancelled as its turn to close came, so the last one's
    # requests ran on while the others closed (an isolated entry's cancel waits for its
    # process: 5 s for a hung one, one child after another).
    fakes = Fakes(log_cancels=True)
    registry = ModelRegistry(loader=fakes)
    for name in ("alpha", "beta"):
        registry.add(name, models / "alpha.gguf", **TINY)
        registry.start(name)
    registry.close()
    assert fakes.log[2:] == ["cancel alpha", "cancel beta", "closed alpha", "closed beta"]


def test_a_cancel_that_raises_still_closes_every_model(models: Path) -> None:
    fakes = Fakes()
    registry = ModelRegistry(loader=fakes)
    for name in ("alpha", "beta"):
        registry.add(name, models / "alpha.gguf", **TINY)
        registry.start(name)

    def refuse() -> None:
        raise RuntimeError("alpha would not cancel")

    fakes.made["alpha"].cancel = refuse  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="alpha would not cancel"):
        registry.close()
    assert fakes.made["alpha"].closed and fakes.made["beta"].closed
