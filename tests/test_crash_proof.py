"""Inputs and teardown orders that used to kill the process. Each runs in a child process, so a
signal death (SIGSEGV, SIGABRT) fails the test instead of the test run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llamacrab import GrammarError, Llama
from llamacrab._native.gbnf.bounds import (
    MAX_GRAMMAR_BYTES,
    MAX_GRAMMAR_NESTING,
    MAX_GRAMMAR_RULES,
    check_grammar,
)


def run_child(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip


def assert_clean_exit(child: subprocess.CompletedProcess[str]) -> None:
    assert child.returncode == 0, f"exit {child.returncode}\n{child.stdout}\n{child.stderr[-3000:]}"


# -- CPU kernels --------------------------------------------------------------------------------

KERNELS_CHILD = r"""
    import json, logging, re, sys, numpy as np
    from llamacrab import Llama
    from llamacrab_sys import ffi, lib
    text = ("The history of the city begins in the Roman period, when a small settlement grew "
            "around the river crossing. During the Middle Ages it became an important market "
            "town, and its cathedral was completed in the thirteenth century.")
    buffers = []  # the buffer types llama.cpp puts the weights of each load in

    class WeightBuffers(logging.Handler):
        def emit(self, record):
            found = re.search(r"(\S+) model buffer size", record.getMessage())
            if found:
                buffers[-1].append(found.group(1))

    logging.getLogger("llamacrab").addHandler(WeightBuffers())
    logging.getLogger("llamacrab").setLevel(logging.INFO)
    runs = []
    for extra in (True, False):  # repacked or AMX weights where the CPU has them; plain ones
        buffers.append([])
        with Llama(sys.argv[1], n_ctx=256, n_threads=1, use_extra_bufts=extra) as llm:
            echo = llm.create_completion(text, max_tokens=0, logprobs=1, echo=True)
            logprobs = [p for p in echo.choices[0].logprobs.token_logprobs if p is not None]
            runs.append({"loss": -float(np.mean(logprobs)), "n": len(logprobs),
                         "buffers": buffers[-1]})
    # The extra buffer types ggml's CPU backend offers (what use_extra_bufts adds at a load).
    cpu = lib.ggml_backend_dev_by_type(lib.GGML_BACKEND_DEVICE_TYPE_CPU)
    get_extras = lib.ggml_backend_reg_get_proc_address(lib.ggml_backend_dev_backend_reg(cpu),
                                                       b"ggml_backend_dev_get_extra_bufts")
    types = [ffi.NULL] if get_extras == ffi.NULL else ffi.cast(
        "ggml_backend_buffer_type_t *(*)(ggml_backend_dev_t)", get_extras)(cpu)
    extras = []  # a NULL-terminated array
    while types[len(extras)] != ffi.NULL:
        extras.append(ffi.string(lib.ggml_backend_buft_name(types[len(extras)])).decode())
    # ggml lists AMX only on a CPU with it; the repacked Q4_K kernels need AVX2 or NEON's dot
    # products (ggml_repack_get_optimal_repack_type), CPU_REPACK is listed regardless.
    q4_k_repacks = "AMX" in extras or "CPU_REPACK" in extras and bool(
        lib.ggml_cpu_has_avx2() or lib.ggml_cpu_has_neon() and lib.ggml_cpu_has_dotprod())
    print(json.dumps({"runs": runs, "extras": extras, "q4_k_repacks": q4_k_repacks}))
"""


def test_the_cpu_s_fast_kernels_compute_what_the_plain_ones_do(gemma_path: Path) -> None:
    # On a CPU with AMX a Q4_K model's products run on tiles; GCC 12 once dropped the stores of
    # their configuration: SIGSEGV, or tiles of the wrong shape where the garbage was valid.
    # The kernels round differently (near ties may go either way): the text's likelihood agrees.
    child = run_child(KERNELS_CHILD, str(gemma_path), timeout=300)
    assert_clean_exit(child)
    seen = json.loads(child.stdout.splitlines()[-1])
    (fast, plain), extras = seen["runs"], set(seen["extras"])
    assert int(fast["n"]) == int(plain["n"]) > 30 and 1.0 < plain["loss"] < 4.0, seen
    assert plain["buffers"] and not extras & set(plain["buffers"]), seen
    used = extras & set(fast["buffers"])
    # Where this CPU has fast kernels for the model's weights, the fast load must use them:
    # else the comparison below is of the plain kernels with themselves.
    assert used or not seen["q4_k_repacks"], seen
    if used:
        assert abs(fast["loss"] - plain["loss"]) < 0.02 * plain["loss"], seen
    else:  # a CPU with no fast kernels for them: the same kernels, the same numbers
        assert fast["loss"] == plain["loss"], seen


# -- grammars ----------------------------------------------------------------------------------

HOSTILE_GRAMMAR_CHILD = """
    import json, pathlib, sys
    from llamacrab import GrammarError, Llama
    grammar = pathlib.Path(sys.argv[2]).read_text(encoding="utf-8")
    with Llama(sys.argv[1], n_ctx=128, n_threads=1) as llm:
        try:
            llm.create_completion("the cat", grammar=grammar, **json.loads(sys.argv[3]))
        except GrammarError as error:
            print("refused:", error)
        # The model stays usable.
        print(llm.create_completion("the cat", max_tokens=2, temperature=0).usage)
"""


def refused_in_a_child(model: Path, grammar: Path, **options: object) -> str:
    """Run ``grammar`` in a child process; what it printed, once it exited cleanly having
    refused the grammar and generated with the same model afterwards."""
    child = run_child(HOSTILE_GRAMMAR_CHILD, str(model), str(grammar), json.dumps(options))
    assert_clean_exit(child)
    assert "refused: " in child.stdout and "completion_tokens=2" in child.stdout, child.stdout
    return child.stdout


def test_a_deeply_nested_grammar_is_refused_not_a_crash(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    depth = 20_000  # ~40 KB: llama.cpp's parser recursed once per level and overflowed
    grammar = tmp_path / "nested.gbnf"
    grammar.write_text("root ::= " + "(" * depth + '"a"' + ")" * depth)
    out = refused_in_a_child(tiny_model_path, grammar, max_tokens=2)
    assert f"the limit is {MAX_GRAMMAR_NESTING}" in out


def test_a_left_recursive_grammar_llama_cpp_misses_is_refused_not_a_crash(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    # Found by the reliability suite's inputs section (seed 2031): r0 matches nothing only
    # through a group, so llama.cpp's left-recursion check missed it, and with no other way on
    # the grammar had no parse stack: GGML_ASSERT(!stacks.empty()) at the first token.
    grammar = tmp_path / "left.gbnf"
    grammar.write_text('root ::= r0 r1 root ""\nr0 ::= ("" | "")\nr1 ::= ""')
    out = refused_in_a_child(tiny_model_path, grammar, max_tokens=2)
    assert "the grammar is left-recursive: rule 'root'" in out


def test_an_ambiguous_grammar_is_stopped_at_the_stack_bound_not_left_to_run(
    tiny_model_path: Path,
) -> None:
    # From a grammar search: r2 starts root over after any character (.), so the ways to read
    # the text multiplied with each token: 0.01 s for the first tokens, 3.4 s for the sixth,
    # minutes soon after, all inside one sampling call that nothing can interrupt.
    grammar = Path(__file__).parent / "reliability_kit" / "ambiguous.gbnf"
    out = refused_in_a_child(tiny_model_path, grammar, max_tokens=64, temperature=1.0, seed=981)
    assert "the grammar holds" in out and "the limit is 1024" in out


@pytest.mark.parametrize(
    ("grammar", "limit"),
    [
        ("root ::= " + "(" * 200 + '"a"' + ")" * 200, str(MAX_GRAMMAR_NESTING)),
        (
            "".join(f"r{i} ::= r{i + 1}\n" for i in range(10_000)) + 'r10000 ::= "a"\n',
            str(MAX_GRAMMAR_RULES),
        ),
        ('root ::= "' + "a" * (MAX_GRAMMAR_BYTES + 1) + '"', str(MAX_GRAMMAR_BYTES)),
        # A count past Python's int() limit raised ValueError; past 2000 llama.cpp's parser
        # failed with "failed to parse grammar", naming nothing.
        ('root ::= "a"{' + "9" * 5000 + "}", "20"),
        ('root ::= "a"{2001,}', "2000"),
    ],
    ids=["nesting", "rule-chain", "size", "count-digits", "count"],
)
def test_grammar_bounds_name_the_limit(grammar: str, limit: str) -> None:
    with pytest.raises(GrammarError, match=f"limit is {limit}"):
        check_grammar(grammar)


def test_brackets_inside_literals_comments_and_classes_do_not_count() -> None:
    quoted = 'root ::= "' + "(" * 500 + '" [(\\](] # ' + "(" * 500 + "\n"
    check_grammar(quoted)


def test_trigger_words_are_bounded(tiny_llama: Llama) -> None:
    with pytest.raises(GrammarError, match="trigger word"):
        tiny_llama.create_completion(
            "the cat", max_tokens=1, grammar='root ::= "a"', grammar_trigger_words=("x" * 5000,)
        )


END_BEFORE_THE_GRAMMAR_ENDS_CHILD = """
    import json, sys
    from llamacrab import CustomSampler, GrammarError, Model, SamplerChain, SamplingOptions

    class Passes(CustomSampler):
        def apply(self, candidates):
            pass

    with Model.load(sys.argv[1]) as model:
        end = model.vocab.eog_tokens[0]
        ab = model.vocab.tokenize("ab", add_special=False, parse_special=False)
        text = "".join(model.vocab.token_to_piece(token) for token in ab)
        grammar = "root ::= " + json.dumps(text)
        shapes = {
            "alone": {},
            "after a bias and a Python sampler": {
                "logit_bias": {end: -1.0}, "custom_samplers": (Passes(),)},
        }
        for shape, extra in shapes.items():
            options = SamplingOptions(grammar=grammar, **extra)
            with SamplerChain(model, options) as chain:
                for accepted in ([], ab[:1]):  # nothing yet; the first token of two
                    for token in accepted:
                        chain.accept(token)
                    try:
                        chain.accept(end)
                    except GrammarError as error:
                        print(shape, "refused:", error)
                    chain.reset()
                for token in ab:  # the grammar is complete: it may end
                    chain.accept(token)
                chain.accept(end)
                print(shape, "ended")
        lazy = SamplingOptions(grammar=grammar, grammar_trigger_words=("zz",))
        with SamplerChain(model, lazy) as chain:
            chain.accept(end)  # a lazy grammar not yet triggered constrains nothing
            print("lazy ended")
"""


def test_an_end_token_the_grammar_does_not_allow_is_refused(tiny_model_path: Path) -> None:
    # llama.cpp aborts when a grammar sampler accepts an end-of-generation token before the
    # grammar is complete (found by the lifecycle section, seed 2035).
    child = run_child(END_BEFORE_THE_GRAMMAR_ENDS_CHILD, str(tiny_model_path))
    assert_clean_exit(child)
    lines = child.stdout.splitlines()
    for shape in ("alone", "after a bias and a Python sampler"):
        refusals = [line for line in lines if line.startswith(f"{shape} refused: ")]
        assert len(refusals) == 2, child.stdout
        assert "does not allow the end-of-generation token" in refusals[0]
        assert f"{shape} ended" in lines
    assert "lazy ended" in lines


# A Python sampler that keeps its candidates past the call; freed memory is filled with 0xA5.
KEPT_CANDIDATES_CHILD = """
    import sys
    from llamacrab import CustomSampler, Llama

    class Keeper(CustomSampler):
        kept = None

        def apply(self, candidates):
            self.kept = candidates

    keeper = Keeper()
    with Llama(sys.argv[1], n_ctx=64, n_threads=1) as llm:
        llm.create_completion("hi", max_tokens=3, custom_samplers=[keeper])
        n_vocab = llm.vocab.n_tokens
        for _ in range(20):  # what llama.cpp frees and allocates meanwhile
            llm.tokenize("the cat sat on the mat " * 50)
        ids = keeper.kept["id"]
        print(int(ids.min()), int(ids.max()), n_vocab)
"""


def test_candidates_a_python_sampler_keeps_stay_valid_memory(tiny_model_path: Path) -> None:
    # They were a view of llama.cpp's candidate vector, freed after each sampled token: read
    # back they held 0xA5A5A5A5 (-1515870811) under MALLOC_PERTURB_, and writes went to the heap.
    env = {**os.environ, "MALLOC_PERTURB_": "165", "GGML_NO_BACKTRACE": "1"}
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(KEPT_CANDIDATES_CHILD),
                            str(tiny_model_path)], capture_output=True, text=True, timeout=120,
                           env=env)  # fmt: skip
    assert_clean_exit(child)
    low, high, n_vocab = map(int, child.stdout.split())
    assert 0 <= low <= high < n_vocab, child.stdout


# -- closing while another thread decodes ------------------------------------------------------

CLOSE_DURING_DECODE_CHILD = """
    import sys, threading, time
    from llamacrab import ClosedHandleError, Llama, LlamaError
    llm = Llama(sys.argv[1], n_ctx=4096, n_batch=2048, n_threads=2)
    prompt = "The history of the city " * 300  # a prefill of seconds
    started, outcome = threading.Event(), []

    def generate():
        started.set()
        try:
            result = llm.create_completion(prompt, max_tokens=64, temperature=0)
            outcome.append(result.choices[0].finish_reason)
        except LlamaError as error:
            outcome.append(type(error).__name__)

    worker = threading.Thread(target=generate)
    worker.start()
    started.wait()
    time.sleep(0.4)  # inside llama_decode by now
    t0 = time.monotonic()
    CLOSE
    waited = time.monotonic() - t0
    worker.join(30)
    print("closed after", round(waited, 2), "worker:", outcome, "closed:", llm.closed)
    try:
        llm.create_completion("x", max_tokens=1)
    except ClosedHandleError:
        print("use after close refused")
"""


@pytest.mark.real_model
@pytest.mark.parametrize("close", ["llm.close()", "llm.context.close()"])
def test_close_from_another_thread_waits_for_the_decode(gemma_path: Path, close: str) -> None:
    child = run_child(CLOSE_DURING_DECODE_CHILD.replace("CLOSE", close), str(gemma_path))
    assert_clean_exit(child)
    assert "worker: [" in child.stdout and "worker: []" not in child.stdout
    assert "use after close refused" in child.stdout


EXIT_DURING_DECODE_CHILD = """
    import sys, threading, time
    from llamacrab import Llama
    llm = Llama(sys.argv[1], n_ctx=4096, n_batch=2048, n_threads=2)

    def generate():
        try:
            llm.create_completion("The history of the city " * 300, max_tokens=64)
        except Exception:
            pass

    threading.Thread(target=generate, daemon=DAEMON).start()
    time.sleep(0.4)
    print("main thread exits")
"""


@pytest.mark.real_model
@pytest.mark.parametrize("daemon", [True, False])
def test_interpreter_exit_while_a_thread_decodes(gemma_path: Path, daemon: bool) -> None:
    child = run_child(EXIT_DURING_DECODE_CHILD.replace("DAEMON", str(daemon)), str(gemma_path))
    assert_clean_exit(child)
    assert "main thread exits" in child.stdout


EXIT_DURING_ASYNC_STREAM_CHILD = """
    import asyncio, atexit, sys, threading
    from llamacrab import Llama
    llm = Llama(sys.argv[1], n_ctx=2048, n_threads=2)
    chunks = []

    async def consume():
        try:
            async for chunk in llm.stream_completion("Once upon a time", max_tokens=1000,
                                                     min_tokens=1000, temperature=0.8):
                chunks.append(chunk)
        except Exception:
            pass

    threading.Thread(target=lambda: asyncio.run(consume()), daemon=True).start()
    while len(chunks) < 3:
        threading.Event().wait(0.05)
    # Registered after llamacrab's exit hook, so it runs before it: what had been generated
    # when the interpreter reached the atexit hooks.
    atexit.register(lambda: print("chunks at exit:", len(chunks), flush=True))
"""


@pytest.mark.real_model
def test_interpreter_exit_while_an_event_loop_iterates_a_stream(gemma_path: Path) -> None:
    # The stream's worker was a thread of the loop's executor, which the interpreter joins at
    # exit before running atexit hooks: the exit waited for all 1000 tokens.
    child = run_child(EXIT_DURING_ASYNC_STREAM_CHILD, str(gemma_path))
    assert_clean_exit(child)
    counted = [line for line in child.stdout.splitlines() if line.startswith("chunks at exit:")]
    assert counted, child.stdout
    assert 3 <= int(counted[0].split(":")[1]) < 1000


# -- schemas and patterns turned into grammars -------------------------------------------------


def test_a_deeply_nested_schema_is_refused_by_name() -> None:
    from llamacrab import schema_to_grammar

    schema: dict[str, object] = {"type": "string"}
    for _ in range(5000):  # used to end in RecursionError
        schema = {"type": "array", "items": schema}
    with pytest.raises(GrammarError, match="nests deeper than 64"):
        schema_to_grammar(schema)


def test_a_deeply_nested_pattern_is_refused_by_name() -> None:
    from llamacrab import schema_to_grammar

    pattern = "(" * 5000 + "a" + ")" * 5000
    with pytest.raises(GrammarError, match="nests groups deeper than 32"):
        schema_to_grammar({"type": "string", "pattern": pattern})
