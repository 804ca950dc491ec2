"""The reliability suite's short sizes (CI): lifecycle fuzzing, tampered models, generated
grammars, schemas and templates, tampered saved states, hostile images and sounds, a model
registry's programs, a hostile hub endpoint and signals at random moments, each
asserting no signal death, no hang and no unclean error over at least its case count.
``scripts/reliability.py`` runs the long sizes and writes RELIABILITY.md. Below them, a
regression test for each crash the suite found."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from llamacrab import (
    ConcurrentUseError,
    GrammarError,
    InvalidParameterError,
    Llama,
    StateError,
    TemplateError,
    schema_to_grammar,
)

from reliability_kit import media, sections, tampered
from reliability_kit.children import (
    HEAP_BYTE,
    OTHER_HEAP_BYTE,
    Report,
    Result,
    Runner,
    kit_environment,
    poisoned_heap,
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("reliability")


def run_short(name: str, workdir: Path) -> Report:
    report = sections.run(name, "short", workdir)
    print(report.summary())
    return report


def assert_clean(report: Report, minimum: int) -> None:
    assert not report.findings, report.summary()
    assert len(report.results) >= minimum, report.summary()


def test_lifecycle_sequences(workdir: Path) -> None:
    report = run_short("lifecycle", workdir)
    assert_clean(report, 1000)
    assert report.count("ok") >= 900  # the sequences ran (a refusal inside one is normal)


def test_tampered_tiny_models(workdir: Path) -> None:
    report = run_short("tampered-tiny", workdir)
    assert_clean(report, 500)
    assert report.count("ok") > 0 and report.count("error") > 0


@pytest.mark.real_model
def test_tampered_gemma_models(workdir: Path) -> None:
    report = run_short("tampered-gemma", workdir)
    assert_clean(report, 500)
    assert report.count("ok") > 0 and report.count("error") > 0


@pytest.mark.parametrize("name", ["tampered-keys", "tampered-reranker"])
def test_keys_added_to_a_model_and_a_tampered_reranker(workdir: Path, name: str) -> None:
    report = run_short(name, workdir)
    assert_clean(report, 400)
    assert report.count("ok") > 0 and report.count("error") > 0
    # Each case that worked took embeddings too (the outputs only they read).
    worked = [r.detail for r in report.results if r.outcome == "ok"]
    assert all("embedded (" in detail for detail in worked), worked[:3]


def test_synthesized_models_of_every_architecture(workdir: Path) -> None:
    report = run_short("archs", workdir)
    assert_clean(report, 400)
    # Most architectures of the pin grow into a loadable tiny model (a bump that breaks the
    # synthesis shows here), and each of those ran as it is (the first cases), computing what
    # it did when it was made (else it would be a finding): only what llamacrab refuses by
    # design for a few graphs (their embeddings, a drafter alone) may be refused.
    loaded = int(report.extra["synthesis"].split(" of ")[0])
    assert loaded >= 145, report.extra["synthesis"]
    as_it_is = [r for r in report.results if int(r.id.split("-")[1]) < report.extra["as it is"]]
    assert len(as_it_is) >= loaded
    by_design = ("models give no embeddings", "is an encoder-decoder model: embeddings",
                 "drafts for a target model")  # fmt: skip
    refused = [r.detail for r in as_it_is if r.outcome != "ok"]
    assert all(any(reason in detail for reason in by_design) for detail in refused), refused
    assert report.count("error") > 0


def test_a_case_that_computes_otherwise_on_another_heap_is_a_finding(tmp_path: Path) -> None:
    runner = Runner("probe", "heap_probe", {}, tmp_path, env=poisoned_heap(HEAP_BYTE))
    cases = [{"id": "probe-0"}, {"id": "probe-1", "differs": True}]
    report = runner.run(cases)
    assert [r.outcome for r in report.results] == ["ok", "ok"]
    runner.env = poisoned_heap(OTHER_HEAP_BYTE)
    sections.run_again(report, runner, cases)
    assert [r.id for r in report.findings] == ["probe-1"]
    assert report.findings[0].outcome == "unclean"
    assert f"computed {HEAP_BYTE}; then ok: computed {OTHER_HEAP_BYTE}" in (
        report.findings[0].detail
    )
    assert report.extra["run again"] == 2


@pytest.mark.parametrize(
    ("sanitizer", "summary"),
    [("address", "SUMMARY: AddressSanitizer: heap-buffer-overflow probe.c:7 in read"),
     ("undefined", "probe.c:9:5: runtime error: load of value 7, which is not a valid value "
                   "for type 'kind'")],
)  # fmt: skip
def test_a_sanitizer_report_is_a_death_that_names_it(
    tmp_path: Path, sanitizer: str, summary: str
) -> None:
    runner = Runner("probe", "heap_probe", {}, tmp_path)
    cases = [{"id": "probe-0"}, {"id": "probe-1", "sanitizer": sanitizer}, {"id": "probe-2"}]
    report = runner.run(cases)
    assert [(r.id, r.outcome) for r in report.results] == [
        ("probe-0", "ok"), ("probe-1", "crash"), ("probe-2", "ok")]  # fmt: skip
    detail = report.findings[0].detail
    assert detail.startswith(f"exited with 99 ({summary}) during its case"), detail


@pytest.mark.parametrize(
    ("name", "cases"),
    [("tampered-vision", 300), ("tampered-audio", 300), ("tampered-lora", 300),
     ("tampered-cvec", 241),  # (every variant of the small control vector)
     ("tampered-imatrix", 300)],
)  # fmt: skip
def test_tampered_files_used_with_the_tiny_model(workdir: Path, name: str, cases: int) -> None:
    report = run_short(name, workdir)
    assert_clean(report, cases)
    assert report.count("ok") > 0 and report.count("error") > 0


def test_extreme_and_ill_typed_parameters(workdir: Path) -> None:
    report = run_short("parameters", workdir)
    assert_clean(report, 400)
    assert report.count("ok") >= 100 and report.count("error") >= 100


def test_llama_cpp_python_api_with_extreme_and_ill_typed_values(workdir: Path) -> None:
    report = run_short("compat", workdir)
    assert_clean(report, 400)
    assert report.count("ok") >= 100 and report.count("error") >= 100


def test_tampered_saved_states(workdir: Path) -> None:
    report = run_short("states", workdir)
    assert_clean(report, 2000)
    assert report.count("ok") > 0 and report.count("error") > 0


def test_grammars_schemas_and_templates(workdir: Path) -> None:
    report = run_short("inputs", workdir)
    assert_clean(report, 500)
    slowest = report.slowest
    assert slowest is not None and slowest.seconds < 30, slowest


def test_hostile_images_and_sounds(workdir: Path) -> None:
    report = run_short("media", workdir)
    assert_clean(report, 300)
    # The seed files decode as made (the generator's files are valid), and changes get refused.
    made = [r for r in report.results if int(r.id.rsplit("-", 1)[1]) < len(media.seeds())]
    assert all(r.outcome == "ok" for r in made), [r for r in made if r.outcome != "ok"]
    assert report.count("error") > 0


def test_model_registry_programs(workdir: Path) -> None:
    report = run_short("registry", workdir)
    assert_clean(report, 300)
    assert report.count("ok") >= 150 and report.count("error") > 0


def test_a_hostile_hub(workdir: Path) -> None:
    report = run_short("hub", workdir)
    assert_clean(report, 300)
    assert report.count("ok") >= 20 and report.count("error") >= 150


@pytest.mark.real_model
def test_signals_at_random_moments(workdir: Path) -> None:
    report = run_short("interrupts", workdir)
    assert_clean(report, 120)
    # The timer lands inside the operations (not only after them) in most cases.
    interrupted = [r for r in report.results if r.detail.startswith("interrupted")]
    assert len(interrupted) >= 40, report.summary()


DRAW = """
import hashlib, json, sys
from reliability_kit import inputs, lifecycle, media
module = {"lifecycle": lifecycle, "inputs": inputs, "media": media}[sys.argv[1]]
cases = module.generate(200, 7)
assert len(cases) >= 150, len(cases)
print(hashlib.sha256(json.dumps(cases).encode()).hexdigest())
"""


@pytest.mark.parametrize("section", ["lifecycle", "inputs", "media"])
def test_a_failing_case_id_replays_in_another_process(section: str) -> None:
    """The generated cases are the same list in every process for a seed (PYTHONHASHSEED and
    all), so the case id a failure reports is enough to replay it (`--replay`)."""
    digests = set()
    for hash_seed in ("1", "2"):
        child = subprocess.run(
            [sys.executable, "-c", DRAW, section], capture_output=True, text=True, timeout=300,
            env={**os.environ, "PYTHONHASHSEED": hash_seed,
                 "PYTHONPATH": os.pathsep.join(sys.path)},
        )  # fmt: skip
        assert child.returncode == 0, child.stderr[-3000:]
        digests.add(child.stdout.strip())
    assert len(digests) == 1
    assert sections.section_of(f"{section}-7-3") == section
    report = Report(section, extra={"replay": sections.replay_command("short", 7),
                                    "drawn_with": sections.drawn_with()})  # fmt: skip
    report.results.append(Result(f"{section}-7-3", "crash", "killed by SIGSEGV"))
    assert "--mode short --seed 7 --replay CASE_ID (hypothesis " in report.summary()


DRAWN = """
import hashlib, json, sys
from pathlib import Path
from reliability_kit import draw, lifecycle
if sys.argv[1] == "after":
    import reliability_server  # imports schemathesis, which changes what hypothesis draws here
    lifecycle.generate(50, 1)
cases = draw.drawn("inputs", "short", Path(sys.argv[2]), 2026)[0]
print(hashlib.sha256(json.dumps(cases).encode()).hexdigest())
"""


def test_a_section_s_cases_do_not_depend_on_what_its_process_imported(tmp_path: Path) -> None:
    # scripts/reliability.py imports schemathesis (the server sections); drawn there, the inputs
    # section's cases differed from those a test or another tool drew for the same seed, so a
    # case id could name another case. Each section is drawn in a process of its own.
    digests = []
    for how in ("after", "bare"):
        child = subprocess.run(
            [sys.executable, "-c", DRAWN, how, str(tmp_path)], capture_output=True, text=True,
            timeout=300, env=kit_environment(),
        )  # fmt: skip
        assert child.returncode == 0, child.stderr[-3000:]
        digests.append(child.stdout.strip())
    assert digests[0] == digests[1]


# -- regressions: what the suite found ---------------------------------------------------------

CHILD = """
import sys, threading, time
import numpy as np
from llamacrab import (Batch, ClosedHandleError, Context, ContextParams, InvalidParameterError,
                       Llama, LlamaError, LoraAdapter, Model, SamplerChain, SamplingOptions)
path, check = sys.argv[1], sys.argv[2]

def refused(call, error=InvalidParameterError):
    try:
        call()
    except error as e:
        print("refused:", e)
    else:
        raise AssertionError("not refused")

if check == "sample-without-logits":
    model = Model.load(path)
    context = Context(model, ContextParams(n_ctx=64, n_threads=1))
    refused(lambda: SamplerChain(model).sample(context, 0))
elif check == "more-sequences-than-rows":
    with Llama(path, embeddings=True, n_ctx=32, n_threads=1) as llm:  # 64 sequences
        print(len(llm.embed("the cat")))
    model = Model.load(path)
    Context(model, ContextParams(n_ctx=64, n_batch=1, n_seq_max=4, n_threads=1)).close()
    Context(model, ContextParams(n_ctx=64, n_ubatch=1, n_seq_max=4, embeddings=True,
                                 pooling="mean", n_threads=1)).close()
elif check == "batch-bounds":
    batch = Batch(4, 1)
    refused(lambda: batch.set_one(5, 0, 2**20))
    refused(lambda: batch.set(np.array([1, 2], dtype=np.int32), 2**31 - 1))
elif check == "embedding-rows":
    model = Model.load(path)
    context = Context(model, ContextParams(n_ctx=64, embeddings=True, n_seq_max=4, n_threads=1))
    batch = Batch(8, 4)
    batch.set(np.array([1, 5, 6], dtype=np.int32), 0, logits_all=True)
    context.decode(batch)
    print(context.embeddings(model.n_embd_out, count=3).shape)
    refused(lambda: context.embeddings(10**7))
    refused(lambda: context.embeddings(model.n_embd_out, count=1000))
elif check == "copy-part-across-buffers":
    model = Model.load(path)
    context = Context(model, ContextParams(n_ctx=256, n_seq_max=2, n_threads=1))  # 2 buffers
    batch = Batch(8, 2)
    batch.set(np.array([1, 5, 6, 7], dtype=np.int32), 0, seq_id=0)
    context.decode(batch)
    refused(lambda: context.copy(0, 1, 1, 3))
    refused(lambda: context.copy(0, 1, 0, 2))
    context.copy(0, 1)  # a whole sequence: replaces sequence 1's
    batch.set(np.array([8], dtype=np.int32), 4, seq_id=1)
    context.decode(batch)
    print(context.positions(0), context.positions(1))
    assert context.positions(1) == (0, 4)
    unified = Context(model, ContextParams(n_ctx=256, n_seq_max=2, kv_unified=True, n_threads=1))
    batch.set(np.array([1, 5, 6, 7], dtype=np.int32), 0, seq_id=0)
    unified.decode(batch)
    unified.copy(0, 1, 1, 3)  # one buffer: a part shares its cells
    assert unified.positions(1) == (1, 2)
elif check.startswith("close-while-"):
    work = check.removeprefix("close-while-")
    for delay in (0.0, 0.001, 0.005, 0.02):
        model = Model.load(path)
        started = threading.Event()
        def run():
            started.set()
            try:
                if work == "tokenizing":
                    model.vocab.tokenize("the cat sat on the mat " * 50_000)
                elif work == "building-a-sampler":
                    grammar = "root ::= " + " | ".join(f'"w{i}" [a-z]*' for i in range(1000))
                    SamplerChain(model, SamplingOptions(grammar=grammar)).close()
                elif work == "loading-an-adapter":
                    LoraAdapter(model, sys.argv[3]).close()
                else:
                    Context(model, ContextParams(n_ctx=2048, n_threads=1)).close()
            except ClosedHandleError:
                pass  # refused: the close came first
            except BaseException as error:  # a use after free shows up here, if not as a crash
                errors.append(error)
        errors = []
        thread = threading.Thread(target=run)
        thread.start()
        started.wait()
        time.sleep(delay)
        model.close()
        thread.join()
        assert not errors, errors
print("ok")
"""


@pytest.mark.parametrize(
    "check",
    ["sample-without-logits", "more-sequences-than-rows", "batch-bounds", "embedding-rows",
     "copy-part-across-buffers", "close-while-tokenizing", "close-while-building-a-sampler",
     "close-while-creating-a-context", "close-while-loading-an-adapter"],
)  # fmt: skip
def test_handles_refuse_what_used_to_crash(
    tiny_model_path: Path, tmp_path: Path, check: str
) -> None:
    lora = sections.script("make_tiny_gguf").write_tiny_lora(tmp_path / "lora.gguf")
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), str(tiny_model_path), check, str(lora)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "GGML_NO_BACKTRACE": "1"},
    )  # fmt: skip
    assert child.returncode == 0, f"exit {child.returncode}\n{child.stdout}\n{child.stderr[-3000:]}"
    assert child.stdout.rstrip().endswith("ok")


def variant(tiny_model_path: Path, tmp_path: Path, spec: dict[str, object]) -> Path:
    work = tampered.WorkFile.create(tiny_model_path, tmp_path, 0)
    path, _ = work.prepare(spec, tmp_path / "scratch.gguf")
    return path


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"kind": "kv_add", "key": "general.alignment", "vtype": tampered.U32, "value": 1},
         "not a multiple of 32"),
        ({"kind": "kv", "key": "tokenizer.ggml.model", "vtype": tampered.STRING, "value": "rwkv"},
         "loop without end"),
        ({"kind": "tensor", "index": 1, "type": 1}, "is a vector of type 1"),  # an F16 norm
    ],
    ids=["alignment-below-32", "rwkv-without-byte-tokens", "f16-norm-vector"],
)  # fmt: skip
def test_tampered_files_that_used_to_crash_or_hang(
    tiny_model_path: Path, tmp_path: Path, spec: dict[str, object], message: str
) -> None:
    spec = dict(spec)
    if spec["kind"] == "kv":  # the entry by its key
        keys = [key for key, _, _ in tampered.parse(tiny_model_path).kvs]
        spec["index"] = keys.index(str(spec.pop("key")).encode())
    path = variant(tiny_model_path, tmp_path, spec)
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent("""
            import sys
            from llamacrab import InvalidModelError, Llama
            try:
                Llama(sys.argv[1], n_ctx=64, n_threads=1).create_completion("the <s>", max_tokens=1)
            except InvalidModelError as error:
                print(error)
        """), str(path)],
        capture_output=True, text=True, timeout=60, env={**os.environ, "GGML_NO_BACKTRACE": "1"},
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    assert message in child.stdout


def test_grammar_repetition_below_its_minimum_is_refused_at_once(tiny_llama: Llama) -> None:
    started = time.monotonic()
    with pytest.raises(GrammarError, match="maximum below its minimum"):
        tiny_llama.create_completion("the cat", max_tokens=2, grammar='root ::= ("a" [b-c]){5,2}')
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    "grammar",
    [
        # The inputs section's case (seed 2027): minutes on the tiny model's 4k vocabulary.
        'root ::= (r0){1000}\nr0 ::= ([a-c]){3} | "" | . | ("xy" | [0-9])',
        'root ::= ([a-z]?){300}',
        'root ::= a{30}\na ::= b{30}\nb ::= "x"?',  # 900 through two rules
        'root ::= ' + " ".join(["opt"] * 300) + '\nopt ::= [a-z] |',  # written out, one by one
        # Splits of a token among optional items sharing characters: 22 s for 2 Gemma tokens.
        "root ::= ([a-z]?){24}",
        "root ::= " + " ".join(["[a-z]*"] * 12),
    ],
)  # fmt: skip
def test_grammars_opening_too_many_stacks_are_refused_at_once(
    tiny_llama: Llama, grammar: str
) -> None:
    started = time.monotonic()
    with pytest.raises(GrammarError, match=r"ways to continue at one position|can split"):
        tiny_llama.create_completion("the cat", max_tokens=2, grammar=grammar)
    assert time.monotonic() - started < 5
    assert tiny_llama.create_completion("the cat", max_tokens=2).usage.completion_tokens >= 0


def test_grammars_with_many_optional_items_still_run(tiny_llama: Llama) -> None:
    """Below the bound: what JSON Schemas and llama.cpp's example grammars need (an object of
    40 optional properties opens ~80 stacks), a bounded repetition of a required item, and
    a run of optional items that splits a 10-character token 12,870 ways."""
    properties = {f"p{i}": {"type": "integer"} for i in range(40)}
    schema = schema_to_grammar({"type": "object", "properties": properties})
    for grammar in [schema, "root ::= [a-z]{0,1000}", "root ::= ([a-z]?){16}"]:
        # Greedy: with a random seed, a grammar that accepts nothing at all may end at once.
        result = tiny_llama.create_completion(
            "the cat", max_tokens=2, grammar=grammar, temperature=0
        )
        assert result.usage.completion_tokens >= 1


DOUBLING = (
    "{% set ns = namespace(x='ab') %}{% for i in range(100) %}{% set ns.x = ns.x ~ ns.x %}"
    "{% endfor %}{{ ns.x | length }}"
)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (DOUBLING, "concatenation"),
        ("{% if true %}" * 200 + "x" + "{% endif %}" * 200, "does not compile"),
        ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "does not compile"),
    ],
    ids=["tilde-doubling", "nested-ifs", "nested-parentheses"],
)
def test_hostile_templates_are_refused_by_name(
    tiny_llama: Llama, template: str, message: str
) -> None:
    with pytest.raises(TemplateError, match=message):
        tiny_llama.create_chat_completion([{"role": "user", "content": "hi"}],
                                          chat_format=template, max_tokens=1)  # fmt: skip


def test_malformed_schemas_and_messages_are_refused_by_name(tiny_llama: Llama) -> None:
    for schema, message in (
        ({"enum": 5}, "'enum' .* wrong type"),
        ({"type": "array", "minItems": True}, "'minItems' .* wrong type"),
        ({"type": "object", "required": [1], "properties": {"a": {}}}, "property names"),
        ({"allOf": [{"properties": []}]}, "'properties' .* wrong type"),
        ({"type": "object", "properties": {f"k{i}": {} for i in range(5000)}}, "over the limit"),
    ):
        with pytest.raises(GrammarError, match=message):
            schema_to_grammar(schema)
    with pytest.raises(InvalidParameterError, match="content part"):
        tiny_llama.create_chat_completion([{"role": "user", "content": ["x"]}],
                                          chat_format="chatml", max_tokens=1)  # fmt: skip
    json.dumps(schema_to_grammar({"type": "object", "properties": {"a": {"type": "string"}}}))


def test_a_stream_read_from_two_threads_refuses_the_second(tiny_llama: Llama) -> None:
    """It raised ValueError ("generator already executing") from inside the generator."""
    stream = tiny_llama.stream_completion("the cat", max_tokens=40, min_tokens=40)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            for _ in stream:
                pass
        except BaseException as error:
            errors.append(error)

    readers = [threading.Thread(target=read) for _ in range(4)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    assert errors and all(isinstance(e, ConcurrentUseError) for e in errors), errors


def test_a_state_claiming_a_huge_model_name_is_refused_before_llama_cpp_allocates_it(
    tiny_llama: Llama,
) -> None:
    """llama.cpp zero-filled a buffer of the claimed length (up to 4 GiB, seconds) first."""
    context = tiny_llama.context
    data = bytearray(context.state_bytes(None))
    data[:4] = (0xFF0000FA).to_bytes(4, "little")
    started = time.monotonic()
    with pytest.raises(StateError, match="runs past its end"):
        context.load_state_bytes(bytes(data), None)
    assert time.monotonic() - started < 1
