"""The seven FFI traps of wrapping llama.cpp, one class each: a named regression test for every
protection, which fails if the protection is removed. Wider coverage of each lives elsewhere
(test_handles, test_threads, test_state, test_crash_proof, tests/sys/test_shims); these are the
one place that names the trap and proves the guard.

1. lifetimes: a child keeps its parent alive; a closed handle never reaches C;
2. allocator mismatch: memory is freed by the allocator that made it;
3. C++ exceptions crossing the FFI: an exception-safe shim turns them into Python exceptions;
4. one context used from several threads: refused or serialized, never concurrent;
5. KV reuse pollution: a request never sees what an earlier one left in the KV cache;
6. NUL-terminated strings: an embedded NUL is a byte of a prompt, or refused, never a cut;
7. duplicate symbols: another llama.cpp build in the same process (llama-cpp-python with its
   own compiled libllama) and ours each run their own code, in either import order.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llamacrab import (
    Batch,
    ClosedHandleError,
    ConcurrentUseError,
    Context,
    ContextParams,
    GrammarError,
    InvalidParameterError,
    Llama,
    LlamaError,
    LoraAdapter,
    Model,
    NativeError,
    RamCache,
    SamplerChain,
    SamplingOptions,
)
from llamacrab._native import handle
from llamacrab._native.call import call, ffi, lib, read_string
from llamacrab._native.handle import NativeHandle, address
from llamacrab_sys import build_info

from support import REPO, Gate, load_repo_module

GREEDY = {"temperature": 0.0}
make_tiny = load_repo_module("scripts/make_tiny_gguf.py")

Frees = list[tuple[str, int]]


@pytest.fixture
def frees(monkeypatch: pytest.MonkeyPatch) -> Frees:
    """Every native free, in order: (kind, address)."""
    seen: Frees = []
    monkeypatch.setattr(handle, "free_observer", lambda kind, at: seen.append((kind, at)))
    return seen


# -- 1. lifetimes ------------------------------------------------------------------------------


class TestLifetimes:
    """A model outlives every context and sampler made from it, whatever the user drops first
    and whatever order the garbage collector picks; after close(), every use raises before
    reaching C."""

    def test_a_child_keeps_its_dropped_parent_alive(self, tiny_model_path: Path,
                                                    frees: Frees) -> None:  # fmt: skip
        model = Model.load(tiny_model_path)
        model_at = address(model._pointer)
        context = Context(model, ContextParams(n_ctx=64))
        sampler = SamplerChain(model)
        del model
        gc.collect()
        assert frees == []  # the context and the sampler hold the model
        batch = Batch(8)
        batch.set(np.array([1, 260, 261], dtype=np.int32), 0)
        context.decode(batch)  # the model's weights are still there to decode with
        assert 0 <= sampler.sample(context) < 271
        del context
        gc.collect()
        assert frees and frees[-1][0] == "context"  # the sampler still holds the model
        del sampler
        gc.collect()
        assert frees[-1] == ("model", model_at)  # the parent last

    def test_a_parent_closed_from_two_threads_is_freed_after_its_child(self) -> None:
        # Found by ASan (a lifecycle sequence closing one Llama from two threads): the second
        # close() found the context's free already taken by the first and freed the model
        # while llama_free, still running, read it.
        events: list[str] = []

        def free_child(pointer: Any) -> None:
            events.append("child freeing")
            time.sleep(0.3)
            events.append("child freed")

        parent = NativeHandle(ffi.new("int *"), lambda p: events.append("parent freed"), None)
        child = NativeHandle(ffi.new("int *"), free_child, parent)
        closers = [threading.Thread(target=parent.close) for _ in range(2)]
        for closer in closers:
            closer.start()
            time.sleep(0.05)  # the first is inside the child's free when the second closes
        for closer in closers:
            closer.join(10)
        assert events == ["child freeing", "child freed", "parent freed"]
        assert child.closed and parent.closed

    def test_use_after_close_raises_and_never_reaches_c(self, tiny_model_path: Path) -> None:
        model = Model.load(tiny_model_path)
        context = Context(model, ContextParams(n_ctx=64))
        vocab = model.vocab
        model.close()  # closes its children first
        assert context.closed
        for use in (context.clear, lambda: vocab.tokenize("the cat"), lambda: model.n_embd,
                    lambda: Context(model)):  # fmt: skip
            with pytest.raises(ClosedHandleError, match="is closed"):
                use()


# -- 2. allocator mismatch ---------------------------------------------------------------------

# What frees each kind of handle: the llama.cpp (or mtmd) function paired with the one that
# made it, from the same library. Never Python's allocator, never libc's free().
MATCHING_FREE = {
    "model": "llama_model_free",  # llama_model_load_from_file
    "context": "llama_free",  # llama_init_from_model
    "sampler": "llama_sampler_free",  # llama_sampler_chain_init (owns what was added to it)
    "LoRA adapter": "llama_adapter_lora_free",  # llama_adapter_lora_init
}


class TestAllocatorMismatch:
    """Memory is freed by the allocator that made it: llama.cpp's objects by their own free
    function, buffers C fills are Python's (ffi.new, numpy) and freed by Python, and no string
    llama.cpp or a shim allocates is ever handed to Python to free."""

    def test_each_native_object_is_freed_by_its_own_free_function(
        self, tiny_model_path: Path, tmp_path: Path
    ) -> None:
        lora = make_tiny.write_tiny_lora(tmp_path / "lora.gguf")
        with Model.load(tiny_model_path) as model:
            context = Context(model, ContextParams(n_ctx=64))
            objects: list[NativeHandle] = [model, context, SamplerChain(model),
                                           LoraAdapter(model, lora)]  # fmt: skip
            seen = {}
            for obj in objects:
                peeked = obj._finalizer.peek()
                assert peeked is not None
                _kind, free, pointer, *_ = peeked[2]
                assert address(pointer) == address(obj._pointer)
                seen[obj.kind] = free.__name__
        assert seen == MATCHING_FREE

    def test_a_batch_is_python_memory_that_c_only_reads(self, tiny_llama: Llama,
                                                       frees: Frees) -> None:  # fmt: skip
        # llama_batch_init would malloc arrays that only llama_batch_free may release; the
        # Batch's arrays are numpy's instead, and nothing native is freed with it.
        batch = Batch(16)
        batch.set(np.array(tiny_llama.tokenize("the cat"), dtype=np.int32), 0)
        assert int(ffi.cast("uintptr_t", batch.struct.token)) == batch._tokens.ctypes.data
        assert int(ffi.cast("uintptr_t", batch.struct.pos)) == batch._positions.ctypes.data
        tiny_llama.context.clear()
        tiny_llama.context.decode(batch)
        batch.close()
        gc.collect()
        assert frees == []

    def test_strings_from_c_land_in_buffers_python_sized_and_owns(self, tmp_path: Path) -> None:
        # The size-then-retry protocol: C reports the length it needs, Python allocates it.
        template = "{{ messages[0].content }}" + "x" * 5000  # far past the first 256 bytes
        path = make_tiny.write_tiny_llama(tmp_path / "t.gguf", chat_templates={"": template})
        with Model.load(path) as model:
            assert model.metadata["tokenizer.chat_template"] == template
        sizes: list[int] = []

        def fill(buf: Any, size: int) -> int:
            sizes.append(size)
            text = b"y" * 700
            ffi.memmove(buf, text[: size - 1], min(size - 1, len(text)))
            return len(text)

        assert read_string(fill) == "y" * 700 and sizes == [256, 701]

    def test_a_shim_error_message_is_copied_into_python_memory(self) -> None:
        # The shim writes what() into a fixed array inside a struct Python allocated (ffi.new):
        # no C++-allocated string crosses that Python would have to free.
        message = ffi.typeof("llamacrab_error").fields[1][1]
        assert message.type.kind == "array" and message.type.length == 1024


# -- 3. C++ exceptions crossing the FFI --------------------------------------------------------


class TestCppExceptions:
    """A C++ exception unwinding through cffi's C frames would terminate the process; every
    llama.cpp call goes through a shim that catches it, and Python raises."""

    EXIT_DURING_LOAD = """
import gc, sys, threading, time
from llamacrab import Model

loading = threading.Event()

def progress(fraction):
    loading.set()
    time.sleep(0.2)  # wakes while the interpreter is finalizing: it may not take the GIL back
    return True

class SlowTeardown:
    def __del__(self, sleep=time.sleep):
        sleep(1.0)  # the final collection, after finalizing began: the thread's window

gc.disable()
threading.Thread(target=Model.load, args=(sys.argv[1], None, progress), daemon=True).start()
loading.wait(30)
teardown = SlowTeardown()
teardown.cycle = teardown
del teardown
"""

    def test_leaving_while_a_daemon_thread_is_inside_a_callback_of_a_shimmed_call(
        self, tiny_model_path: Path
    ) -> None:
        # Python 3.11-3.13 end such a thread with pthread_exit once it asks for the GIL back:
        # glibc unwinds it through llama.cpp's loader into the shim, whose catch (...) once
        # swallowed the unwind: "FATAL: exception not rethrown", SIGABRT (found by the
        # registry reliability section: a model loading on another thread at exit).
        for _ in range(3):
            child = subprocess.run(
                [sys.executable, "-c", self.EXIT_DURING_LOAD, str(tiny_model_path)],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert child.returncode == 0, child.stderr[-2000:]
            assert "exception not rethrown" not in child.stderr

    def test_a_throwing_call_becomes_a_native_error(self, tiny_llama: Llama) -> None:
        vocab = tiny_llama.model.vocab
        # std::out_of_range inside llama.cpp:
        with vocab.in_flight() as pointer, pytest.raises(NativeError) as info:
            call("llama_vocab_get_text", pointer, -5)
        assert info.value.code == lib.LLAMACRAB_STD_EXCEPTION and str(info.value)
        assert isinstance(info.value, LlamaError)
        assert tiny_llama.tokenize("the cat")  # the vocabulary is fine afterwards

    def test_a_grammar_rejecting_an_accepted_token_raises_through_the_public_api(
        self, tiny_llama: Llama
    ) -> None:
        chain = SamplerChain(tiny_llama.model, SamplingOptions(grammar='root ::= "cat"'))
        dog = tiny_llama.tokenize(" dog", add_special=False)[-1]
        # llama.cpp's std::runtime_error, named: it was a NativeError with llama.cpp's words.
        with pytest.raises(GrammarError, match=f"does not allow token {dog} here"):
            chain.accept(dog)
        chain.reset()
        chain.close()
        assert tiny_llama.create_completion("the cat", max_tokens=2).usage.completion_tokens


# -- 4. one context used from several threads --------------------------------------------------


class TestOneContextManyThreads:
    """cffi releases the GIL around every C call, so two threads could be inside llama.cpp on
    one context at once. A raw context refuses a second thread; a Llama serializes its calls;
    close() waits for the call in flight."""

    def test_a_second_thread_entering_a_context_is_refused(self, tiny_llama: Llama) -> None:
        entered, release = threading.Event(), threading.Event()

        def hold() -> None:
            with tiny_llama.context.exclusive():
                entered.set()
                release.wait(10)

        holder = threading.Thread(target=hold)
        holder.start()
        assert entered.wait(10)
        try:
            with pytest.raises(ConcurrentUseError, match="another thread"):
                tiny_llama.context.clear()
        finally:
            release.set()
            holder.join()

    def test_concurrent_completions_equal_sequential_ones(self, tiny_llama: Llama) -> None:
        prompts = ["the cat", "a dog sat on", "hello world"]
        options = {"max_tokens": 12, "min_tokens": 12, **GREEDY}
        alone = [tiny_llama.create_completion(p, **options).choices[0].tokens for p in prompts]
        together: dict[int, tuple[int, ...]] = {}
        start = threading.Barrier(len(prompts))

        def run(i: int) -> None:
            start.wait(10)
            together[i] = tiny_llama.create_completion(prompts[i], **options).choices[0].tokens

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert [together.get(i) for i in range(len(prompts))] == alone

    def test_close_from_another_thread_waits_for_the_native_call(
        self, tiny_model_path: Path
    ) -> None:
        llm = Llama(tiny_model_path, n_ctx=64, n_threads=1)
        gate, outcome = Gate(), []
        stream = llm.stream_completion("the cat", max_tokens=4, custom_samplers=(gate,))

        def generate() -> None:
            try:
                outcome.append(len(list(stream)))
            except LlamaError as error:
                outcome.append(type(error).__name__)

        worker = threading.Thread(target=generate)
        worker.start()
        time.sleep(0.3)  # the worker is inside llama_sampler_sample, held by the gate
        closer = threading.Thread(target=llm.close)
        closer.start()
        closer.join(0.5)
        assert closer.is_alive(), "close() freed the context under a native call in flight"
        gate.open.set()
        closer.join(30)
        worker.join(30)
        assert not closer.is_alive() and llm.closed and outcome
        with pytest.raises(ClosedHandleError):
            llm.create_completion("the cat", max_tokens=1)


# -- 5. KV reuse pollution ---------------------------------------------------------------------


def _fresh_logits(path: Path, prompts: list[str]) -> np.ndarray:
    """The logits after decoding ``prompts`` one after the other in a new Llama."""
    with Llama(path, n_ctx=128, n_threads=1) as fresh:
        for prompt in prompts:
            fresh.create_completion(prompt, max_tokens=0, **GREEDY)
        return fresh.context.logits().copy()


class TestKvReusePollution:
    """Reusing a KV cache (the common prefix of the last request, a prompt cache) must give a
    request exactly the logits it would get alone: bit for bit, nothing left from the tokens an
    earlier request generated or from a prompt that only looked alike."""

    PROMPT = "the cat sat on the mat"

    def test_generated_tokens_of_the_last_request_are_gone(self, tiny_model_path: Path) -> None:
        extended = self.PROMPT + " and the dog"
        with Llama(tiny_model_path, n_ctx=128, n_threads=1) as llm:
            llm.create_completion(self.PROMPT, max_tokens=8, min_tokens=8, **GREEDY)
            result = llm.create_completion(extended, max_tokens=0, **GREEDY)
            assert result.usage.cached_tokens == len(llm.tokenize(self.PROMPT))  # reused
            reused = llm.context.logits().copy()
        # The same two prompt decodes, without 8 generated tokens in between.
        assert np.array_equal(reused, _fresh_logits(tiny_model_path, [self.PROMPT, extended]))

    def test_an_unrelated_request_sees_nothing_of_the_last_one(self, tiny_model_path: Path) -> None:
        other = "hello world"
        with Llama(tiny_model_path, n_ctx=128, n_threads=1) as llm:
            llm.create_completion(self.PROMPT, max_tokens=8, **GREEDY)
            llm.create_completion(other, max_tokens=0, **GREEDY)
            after = llm.context.logits().copy()
        assert np.array_equal(after, _fresh_logits(tiny_model_path, [other]))

    def test_a_prompt_cache_restores_exactly_the_prefix(self, tiny_model_path: Path) -> None:
        cache = RamCache(capacity_bytes=64 << 20)
        extended = self.PROMPT + " and the dog"
        with Llama(tiny_model_path, n_ctx=128, n_threads=1, cache=cache) as llm:
            llm.create_completion(self.PROMPT, max_tokens=6, min_tokens=6, **GREEDY)
            llm.reset()  # only the cache can help now
            result = llm.create_completion(extended, max_tokens=0, **GREEDY)
            assert result.usage.cached_tokens == len(llm.tokenize(self.PROMPT))
            restored = llm.context.logits().copy()
        assert np.array_equal(restored, _fresh_logits(tiny_model_path, [self.PROMPT, extended]))


# -- 6. NUL-terminated strings -----------------------------------------------------------------


class TestNulTerminatedStrings:
    """C reads a char* up to its first NUL. Text passed with its length (a prompt) keeps the
    NUL as a byte; text passed as a C string (a grammar, a template name, a path) is refused
    with InvalidParameterError or a load error, never silently cut short at the NUL."""

    def test_a_prompt_keeps_everything_after_a_nul(self, tiny_llama: Llama) -> None:
        whole = tiny_llama.tokenize("the\0cat", add_special=False)
        cut = tiny_llama.tokenize("the", add_special=False)
        assert len(whole) > len(cut) + 1 and whole[: len(cut)] == cut
        assert tiny_llama.detokenize(whole) == "the\0cat"
        usage = tiny_llama.create_completion("the\0cat", max_tokens=1).usage
        assert usage.prompt_tokens == len(tiny_llama.tokenize("the\0cat"))

    @pytest.mark.parametrize(
        ("call_with_nul", "what"),
        [
            (lambda llm: llm.create_completion("x", max_tokens=1, grammar='root ::= "a\0b"'),
             "grammar"),
            (lambda llm: llm.model.chat_template("chatml\0x"), "template name"),
            (lambda llm: llm.create_chat_completion([{"role": "user", "content": "h\0i"}],
                                                    chat_format="chatml", max_tokens=1),
             "content"),
            (lambda llm: SamplerChain(llm.model, SamplingOptions(dry_multiplier=0.8,
                                                                 dry_sequence_breakers=("a\0",))),
             "dry breaker"),
        ],
    )  # fmt: skip
    def test_c_strings_with_a_nul_are_refused_by_name(
        self, tiny_llama: Llama, call_with_nul: Any, what: str
    ) -> None:
        with pytest.raises(InvalidParameterError, match=f"{what} contains a NUL"):
            call_with_nul(tiny_llama)

    def test_a_path_with_a_nul_never_opens_the_file_before_it(self, tiny_model_path: Path) -> None:
        # Cut at the NUL, these paths would name a real model. As an adapter llama.cpp would
        # refuse it (a LlamaError too): only the refusal by name shows it was never opened.
        with pytest.raises(InvalidParameterError, match=r"the model .*without NUL"):
            Llama(f"{tiny_model_path}\0.other", n_ctx=64)
        with (
            Model.load(tiny_model_path) as model,
            pytest.raises(InvalidParameterError, match=r"the adapter path .*without NUL"),
        ):
            LoraAdapter(model, f"{tiny_model_path}\0.other")


# -- 7. duplicate symbols ----------------------------------------------------------------------

TWO_BUILDS = REPO / "tests" / "two_llama_cpp_builds.py"


def _side(path: str, ours: Path, peer: Path) -> str | None:
    resolved = Path(path).resolve()
    if resolved.is_relative_to(ours):
        return "llamacrab"
    if resolved.is_relative_to(peer):
        return "llama-cpp-python"
    return None


def bindings_across(logs: list[Path], ours: Path, peer: Path) -> list[tuple[str, str]]:
    """The dynamic loader's bindings (LD_DEBUG=bindings) from a file of one package to a file of
    the other, as (line, symbol): ``binding file A [0] to B [0]: normal symbol `name'``."""
    crossing = []
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            _, found, rest = line.partition("binding file ")
            if not found:
                continue
            source, _, rest = rest.partition(" [")
            target = rest.partition(" to ")[2].partition(" [")[0]
            sides = {_side(source, ours, peer), _side(target, ours, peer)}
            if sides == {"llamacrab", "llama-cpp-python"}:
                crossing.append((line.strip(), line.partition("symbol `")[2].partition("'")[0]))
    return crossing


def gnu_unique_symbols(*packages: Path) -> set[str]:
    """The STB_GNU_UNIQUE objects the packages' libraries define (``nm`` type ``u``): static
    locals of inline functions and templates, which the loader keeps one of per process by
    design (the C++ one-definition rule), RTLD_LOCAL or not."""
    names = set()
    for package in packages:
        for library in package.rglob("lib*.so*"):
            listing = subprocess.run(["nm", "-D", "--defined-only", str(library)],
                                     capture_output=True, text=True, check=True).stdout  # fmt: skip
            names |= {line.split()[2] for line in listing.splitlines()
                      if len(line.split()) == 3 and line.split()[1] == "u"}  # fmt: skip
    return names


@pytest.fixture(scope="module")
def compiled_peer() -> Path:
    """llama-cpp-python with its own compiled llama.cpp (built once, cached, ~10-15 min)."""
    return Path(load_repo_module("scripts/peer_compiled.py").compiled_peer())


@pytest.mark.real_model
@pytest.mark.timeout(3600)  # the first run on a machine compiles llama-cpp-python
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's loader (LD_DEBUG)")
@pytest.mark.skipif(bool(build_info().sanitize), reason="a question for the loader, not ASan")
class TestDuplicateSymbols:
    """Another package's llama.cpp in the same process (llama-cpp-python 0.3.36 with its own
    compiled libllama.so.0, libggml.so.0, libggml-base.so.0) must not bind to our code, nor we
    to theirs. Both load RTLD_LOCAL (Python's import, ctypes' default), so neither interposes
    on the other's symbols; but the dynamic loader reuses an already-loaded library whose
    SONAME matches a NEEDED entry, and with upstream's SONAMEs the second package to load ran
    the first one's libllama and libggml (seen here before the fix, in both orders). Our
    libraries have names and SONAMEs of their own (libllamacrab-llama.so.0, ...;
    build_tools/native.py). Each import order runs in a child, under LD_DEBUG=bindings: no
    function or ordinary object of either package resolves into the other's files (GNU
    unique objects aside, which the C++ ABI makes one per process), each package's libraries
    are mapped, both generate, and greedily they agree (the same commit, the same model)."""

    @pytest.mark.parametrize("order", ["llamacrab-first", "peer-first"])
    def test_two_builds_in_one_process_each_run_their_own_code(
        self, order: str, compiled_peer: Path, gemma_path: Path, tmp_path: Path
    ) -> None:
        env = {**os.environ, "GGML_NO_BACKTRACE": "1", "LD_BIND_NOW": "1",
               "LD_DEBUG": "bindings", "LD_DEBUG_OUTPUT": str(tmp_path / "bindings")}  # fmt: skip
        child = subprocess.run(
            [sys.executable, str(TWO_BUILDS), order, str(gemma_path), str(compiled_peer)],
            capture_output=True, text=True, timeout=600, env=env,
        )  # fmt: skip
        assert child.returncode == 0, child.stderr[-3000:]
        result = json.loads(child.stdout.strip().splitlines()[-1])
        ours = Path(result["ours_dir"]).parent.resolve()
        peer = Path(result["peer_dir"]).parent.resolve()
        assert peer.is_relative_to(compiled_peer.resolve())  # its own build, not ours
        mapped = {Path(p).resolve() for p in result["mapped"]}
        for name in ("llama", "ggml-base", "ggml"):
            for package, prefix in ((ours, "libllamacrab-"), (peer, "lib")):
                assert any(p.name.startswith(f"{prefix}{name}.so") and p.is_relative_to(package)
                           for p in mapped), (name, package, sorted(mapped))  # fmt: skip
        logs = sorted(tmp_path.glob("bindings.*"))
        assert logs and any("llama_decode" in log.read_text(errors="replace") for log in logs)
        crossing = bindings_across(logs, ours, peer)
        unique = gnu_unique_symbols(ours, peer)
        # Functions and ordinary data: each package's own. Only GNU unique objects are shared
        # (libstdc++'s template statics, and four constant locals of llama.cpp's tokenizer
        # and loader: the same definitions at the same commit).
        assert [line for line, symbol in crossing if symbol not in unique] == []
        assert len({symbol for _, symbol in crossing}) < 60, crossing
        assert result["ours"]["prompt"] == result["theirs"]["prompt"]
        assert len(result["ours"]["tokens"]) == 12
        assert result["ours"]["tokens"] == result["theirs"]["tokens"], result
        assert "France" in result["ours"]["text"]
