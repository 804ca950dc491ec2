"""The reliability suite: how hard llamacrab is to break, measured like BENCHMARKS.md measures
its speed.

Usage: python scripts/reliability.py [--mode long|short] [--sections a,b] [--workers 2]
                                     [--seed N] [--workdir DIR] [--report RELIABILITY.md]
       python scripts/reliability.py [--mode M] [--seed N] --replay CASE_ID[,CASE_ID...]

Sections (tests/reliability_kit/sections.py; each has a short size, which CI runs through
tests/test_reliability.py, and a long one, the default here):

- lifecycle: generated sequences of operations on handles, Llama objects and streams;
- tampered-tiny, tampered-gemma: variants of the tiny model's and Gemma 3 270M's GGUF files;
- tampered-keys: the tiny model with each key llama.cpp's loader knows (the pinned
  llama-arch.cpp) added at edge values, decoded and embedded;
- tampered-reranker: variants of a tiny BERT reranker with a two-label head, and it with those
  keys added, embedded, reranked and classified;
- archs: a tiny model of each architecture of the pinned llama.cpp, grown from its own load
  errors, as it is, without each tensor in turn, and tampered or with keys added; loaded,
  decoded and embedded;
- tampered-vision, tampered-audio: variants of the tiny vision and audio projectors, each
  loaded as the tiny model's projector and given an image or a sound;
- tampered-lora, tampered-cvec: variants of the tiny LoRA adapter and of a control vector,
  each applied to a completion of the tiny model;
- tampered-imatrix: variants of an importance matrix for the tiny model (llama-imatrix's GGUF
  form), each given to quantize() of it, the output then completed with;
- parameters: Llama and completion keywords set to extreme or ill-typed values;
- inputs: generated grammars, JSON Schemas and chat templates through the public API;
- states: saved states (KV cache, recurrent, hybrid) tampered under a valid checksum;
- media: sound files, image files and pixel arrays, valid and tampered, through a tiny
  model with a vision or an audio projector;
- registry: programs of operations on a ModelRegistry from several threads (loads, leases,
  streams, unloads with and without force, keep-alive expiry, close);
- hub: resolve of a repository through a Hub look-alike whose answers are changed (listing,
  pages, headers, statuses, redirects, bodies); nothing written outside the cache, no token
  sent to another host;
- interrupts: SIGINT (Ctrl-C) or a counting SIGUSR1 handler sent at random moments of loads,
  completions, long prompts (a Ctrl-C aborts the decode), streams, state saves and loads on
  Gemma 3 270M; each handler runs exactly once, nothing swallowed in a callback, the Llama's
  next token unchanged, no model leaked; each interrupted case notes how soon it raised;
- server: the server under load and faults, several models under churn (in its process and
  in processes of their own killed at random), and leaks
  (scripts/reliability_server.py; CI runs its short size through
  tests/test_reliability_server.py).

Every case runs in a child process (many per child; a death or hang is pinned on one case by
rerunning alone), and is counted as worked, refused (a LlamaError subclass), unclean (any other
exception), a signal death or a hang. Exits 1 if any case crashed, hung or failed uncleanly,
or a server section failed.

``--replay`` draws a section's cases again for the mode and seed a run reported (the same list
in every process for one hypothesis version) and runs the named ones in one child, printing
what each did: a reported failure reproduced without the rest of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "scripts"))

import machine_info  # noqa: E402
import reliability_server  # noqa: E402

from reliability_kit.children import TESTS, Report  # noqa: E402
from reliability_kit.sections import SECTIONS, SEED, replay_job, run  # noqa: E402

SERVER = "server"  # the server sections, reported apart (their own counts)

# What the suite found when it was first run, and where each is fixed (kept here so the report
# says it; a new finding is fixed in the library, gets a regression test, and a row here).
FOUND = [
    ("lifecycle", "`SamplerChain.sample(context, i)` with no logits at output i (none decoded "
     "yet, or out of range)", "SIGABRT: `GGML_ASSERT(logits != nullptr)` (llama-sampler.cpp:940)",
     "`_native/sampler.py`: InvalidParameterError first"),
    ("lifecycle", "a context with more sequences than `n_batch` or `n_ctx`, e.g. "
     "`Llama(path, embeddings=True, n_ctx=32)` (64 sequences)",
     "SIGABRT: `GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max)` (llama-context.cpp:2273)",
     "`_native/context.py`: n_batch and n_ctx at least n_seq_max"),
    ("lifecycle", "an embeddings context with pooling and `n_ubatch` below `n_seq_max`",
     "SIGABRT: `GGML_ASSERT(ggml_can_mul_mat(a, b))` reserving the graph",
     "`_native/context.py`: n_ubatch at least n_seq_max"),
    ("lifecycle", "`Batch.set_one(token, pos, seq_id)` with a seq_id past `n_seq_max`",
     "SIGSEGV in `llama_decode` (a seq_id pointer past its cells)",
     "`_native/batch.py`: seq_id, positions and tokens checked"),
    ("lifecycle", "one stream read from two threads at once",
     "ValueError (generator already executing) escaping (unclean)",
     "`_engine/stream.py`: ConcurrentUseError for the second reader"),
    ("lifecycle", "`Context.embeddings(width, count=...)` wider or longer than the output rows",
     "SIGSEGV, or reads past the buffer", "`_native/context.py`: rows checked against outputs"),
    ("lifecycle", "closing a model while another thread tokenizes, builds a sampler (a grammar), "
     "creates a context or adapter, or reads metadata",
     "SIGSEGV (use after free); AttributeError from an adapter closed before it was set up",
     "`_native/` vocab, sampler, context, adapter, mtmd, model: those calls hold the model in "
     "flight; handle.py: a child adopted by a closing parent is freed at once"),
    ("lifecycle", "a whole-context state blob (raw, or a SavedState with a valid checksum) whose "
     "first 4 bytes claim a long model name",
     "llama.cpp zero-fills a buffer of that length first: 4 GiB and ~5 s per load (the OOM "
     "killer on a smaller machine)", "`_native/context.py`: StateError before llama.cpp reads"),
    ("lifecycle (ASan)", "one `Llama` closed from two threads at once",
     "heap-use-after-free in `llama_context::~llama_context`: the second `close()` found the "
     "context's free taken and freed the model while `llama_free` still read it",
     "`_native/handle.py`: `close()` waits for a free in progress (test in "
     "`tests/test_ffi_traps.py`)"),
    ("tampered", "`general.alignment` below 32 (e.g. 1)",
     "SIGABRT: `GGML_ASSERT(... \"buffer pointer must be aligned\")` (ggml-backend.cpp:2527)",
     "`validate_gguf`: the first tensor's data 32-byte aligned"),
    ("tampered", "`tokenizer.ggml.model = \"rwkv\"` over a vocabulary whose first bytes are not "
     "tokens", "tokenizing loops forever, appending tokens until memory runs out (8 GB in 44 s)",
     "`validate_gguf`: each first byte of an RWKV token is a token"),
    ("tampered-gemma", "a norm vector re-typed F16, BF16 or quantized (Q4_0)",
     "SIGABRT at the first decode: `binary_op: unsupported types` (ggml-cpu binary-ops.cpp:135)",
     "`validate_gguf`: float vectors are F32"),
    ("inputs", "GBNF repetition `x{5,2}` (maximum below minimum)",
     "llama.cpp adds rules until memory runs out (4 GB in 10-25 s, then bad_alloc or the OOM "
     "killer)", "`_native/gbnf/bounds.py`: GrammarError"),
    ("inputs", "a chat template doubling a string with `~` in a loop",
     "unbounded memory (MemoryError, or the OOM killer)", "`_chat/template.py`: `~` checked "
     "like `+`"),
    ("inputs", "templates nested past Jinja's parser or Python's 100 indentation levels",
     "RecursionError or IndentationError escaping (unclean)", "`_chat/template.py`: "
     "TemplateError"),
    ("inputs", "JSON Schema keywords of the wrong type (`{\"enum\": 5}`); 5,000 optional "
     "properties (a 612 MB grammar, 2.4 GB RSS, before the refusal)",
     "TypeError escaping (unclean); unbounded memory", "`_grammar/json_schema.py`: GrammarError"),
    ("inputs", "chat message content parts that are not objects",
     "AttributeError escaping (unclean)", "`_chat/prompt.py`: InvalidParameterError"),
    ("inputs (seed 2027)", "`root ::= (r0){1000}` where `r0` may match nothing "
     "(`\"\" \\| . \\| ...`)", "a hang: minutes in llama.cpp's grammar sampler, every stack "
     "of 1000 skippable items opened at each character",
     "`_native/gbnf/fanout.py`: GrammarError past 256 stacks at one position, or past "
     "50,000 ways to split 10 characters among optional items in a row (`([a-z]?){24}`: 22 s "
     "for two Gemma 3 tokens)"),
    ("lifecycle (seed 2027)", "`Context.copy(src, dst, p0, p1)` of part of a sequence when "
     "each sequence has its own buffer (`kv_unified=False`, several sequences)",
     "SIGABRT: `GGML_ASSERT(is_full && \"seq_cp() is only supported for full KV buffers\")` "
     "(llama-kv-cache.cpp:506)", "`_native/context.py`: InvalidParameterError; whole "
     "sequences copy"),
    ("inputs (seed 2031)", "a GBNF rule that comes back to itself through rules matching "
     "nothing only through a group (`root ::= r0 r1 root \"\"`, `r0 ::= (\"\" \\| \"\")`), "
     "which llama.cpp's left-recursion check misses",
     "SIGABRT at the first token: `GGML_ASSERT(!stacks.empty())` (llama-grammar.cpp:948)",
     "`_native/gbnf/fanout.py`: GrammarError for any left recursion"),
    ("a grammar search", "an ambiguous grammar: a rule that starts the root over after any "
     "character (`tests/reliability_kit/ambiguous.gbnf`), sampled",
     "a hang: its parse stacks multiplied with every token (0.01 s for the first tokens, "
     "3.4 s for the sixth, minutes after) inside one sampling call",
     "llamacrab-sys patch `llama-grammar-stack-bound`: past 1,024 stacks the token's accept "
     "throws; `_native/sampler.py`: GrammarError"),
    ("reading libmtmd's sound decoding, then a crafted file", "a 100 kB WAV declaring a "
     "sample rate of 1 Hz (28 hours at the projector's 16 kHz)", "6 GB allocated and "
     "zero-filled, 42 s, then `std::bad_alloc` (the OOM killer on a smaller machine)",
     "llamacrab-sys patch `mtmd-audio-length-bound`: past an hour the helper throws before "
     "allocating; `_native/mtmd.py`: MediaError. Samples: `_native/media.py` checks "
     "`MAX_AUDIO_SECONDS` before resampling"),
    ("tampered-vision, tampered-audio", "a projector with a `clip.*` key of another type "
     "(a float `block_count`, an array for a scalar)",
     "SIGABRT: `GGML_ASSERT(type_to_gguf_type<T>::value == type)` (gguf.cpp:196) or "
     "`get_ne() == 1` (gguf.cpp:1140-1182): 176 of the first run's 245 signal deaths",
     "llamacrab-sys patch `clip-metadata-types`: libmtmd's scalar getters throw; "
     "ModelLoadError"),
    ("tampered-vision, tampered-audio", "a projector whose tensors disagree with its "
     "hyperparameters or each other (renamed, removed, reshaped; a width, head count or image "
     "size changed)", "SIGABRT in ggml's shape assertions while libmtmd builds its warm-up "
     "graph or computes the first image (a position table shorter than the patches), SIGSEGV "
     "on a missing tensor: 63 deaths", "`_native/projector_probe.py`: the projector is loaded, "
     "and a small image or sound encoded, in a child process first; a death there is a "
     "ModelLoadError"),
    ("tampered-vision, tampered-audio", "a projector's layer-norm epsilon set negative, NaN "
     "or -inf", "SIGABRT at the first image or sound (ggml's norm kernel)",
     "`_native/gguf/check.py`: positive and finite (InvalidModelError)"),
    ("mutated images (before the media section)", "a PNG whose IDAT declares 0 bytes, then a "
     "chunk type that is not letters", "SyntaxError escaping from Pillow (unclean)",
     "`_native/media.py`: any error while Pillow decodes is a MediaError"),
    ("reading the control-vector loader (then tampered-cvec)", "a control vector whose tensor "
     "is `direction.100000000` (or 2^31)", "one row per layer up to it: 24 GiB asked of numpy, "
     "a MemoryError (unclean; the OOM killer where overcommit lets it through)",
     "`_native/control_vector.py`: layers 1..512 (InvalidModelError); strengths finite"),
    ("extreme Llama keywords, each in a child (then parameters)", "`kv_overrides="
     "{\"llama.block_count\": 2**40}`", "SIGABRT: `GGML_ASSERT(hparams.n_layer_all > 0 && ... "
     "<= LLAMA_MAX_LAYERS)` (llama-model.cpp:1328): llama.cpp reads the override, which "
     "`validate_gguf` had not seen, into a uint32 (0)", "`_native/gguf/check.py`: the header "
     "checked again with the overrides applied as llama.cpp reads them; an override of "
     "another type than the file's value is an InvalidParameterError"),
    ("extreme Llama and completion keywords (then parameters)", "values of another type or "
     "past the C types: `n_ctx=2**32`, `n_threads=2**31`, `top_k=2**31`, `logit_bias="
     "{\"5\": 1.0}`, `typical_p=None`, `logprobs=[1]`, `max_queue=\"1\"`, `lora=True`, "
     "`prompt_cache=\"dir\\0\"`, a kv_overrides integer past 64 bits; `n=2**31 - 1`",
     "OverflowError or TypeError from cffi or a comparison, ValueError from a path (unclean); "
     "NaN settings accepted (NaN logits); 2 billion choices started",
     "`_field_types.py`: options dataclasses checked against their annotations; "
     "`check_range` for C integers; NaN refused; n and best_of at most 128"),
    ("parameters", "`penalty_last_n=2**31 - 1` (or `dry_penalty_last_n`)", "SIGABRT: "
     "std::bad_alloc escaping `llama_sampler_init_penalties`, called without its shim, for a "
     "ring of 2^31 tokens (8 GB zero-filled where memory allows it)", "`_native/sampler.py`: "
     "every sampler made through its exception-safe shim; the windows at most 2^20 tokens"),
    ("parameters", "`n_threads=4097` (or `n_threads_batch`)", "the process exits with status 1: "
     "libgomp could not create the threads (`Thread creation failed`)", "`_native/context.py`: "
     "1..512 threads (ggml's GGML_MAX_N_THREADS)"),
    ("extreme Llama keywords (the memory a context takes)", "`n_ctx=2**26` on the tiny model "
     "(below the cells' own limit)", "llama.cpp zero-filled 3 GiB of KV cells and a 16 GiB "
     "cache (60 s, 19 GiB RSS) before its 64 GiB attention mask failed to allocate (the OOM "
     "killer on a smaller machine)", "`_native/context.py`: the cells, the host layers' keys "
     "and values (`_native/kv_layout.py`, from the GGUF header) and one micro-batch's mask "
     "checked against the machine's memory first (ContextError)"),
    ("registry", "a one-slot model reached through `ModelRegistry.get` while it generates, "
     "with a short `keep_alive`", "the keep-alive timer closed it under its own generation "
     "(ClosedHandleError mid-stream); `unload()` without force too", "`_registry.py`: a model "
     "is idle only when no generation runs or waits (`Llama.busy`), on one slot as on "
     "parallel slots"),
    ("registry", "`ModelRegistry(max_loaded=\"2\")`, `keep_alive=\"1\"` or NaN, "
     "`memory_budget=0`, `ModelEntry(pinned=\"yes\")`", "TypeError from a comparison "
     "(unclean); a budget of 0 or NaN keep-alive accepted", "`_registry.py`: limits and "
     "entries checked by type and range (InvalidParameterError)"),
    ("registry (1 in 5,000 programs)", "leaving the interpreter while another thread loads a "
     "model (llama.cpp logging through Python meanwhile)", "SIGABRT at exit: \"FATAL: "
     "exception not rethrown\": Python ends the thread with `pthread_exit` when it asks for "
     "the GIL back, and the shim's `catch (...)` swallowed glibc's forced unwind",
     "`build_tools/shims.py`: the shims rethrow `abi::__forced_unwind` (no longer `noexcept`); "
     "`tests/test_ffi_traps.py` reproduces it every time with the old shims"),
    ("server: models (several models, room for one)", "a forced unload (or a close) while "
     "clients leave the two-slot model's queue", "a hang: the engine thread, leaving, walked "
     "its queue while a cancelled stream took a job out (\"deque mutated during iteration\"); "
     "the jobs after it waited forever with the model's lease held (503 model_busy for good)",
     "`_engine/scheduler.py`: the queue taken under the engine's lock (test in "
     "`tests/test_parallel.py`)"),
    ("server: models", "an entry whose context the machine cannot hold; a whole completion "
     "cut by a forced unload", "a bare 500 \"Internal Server Error\" on the entry's first use "
     "(a ContextError escaped the routes; a broken connection for a stream); a 504 \"ran past "
     "the timeout\"", "`_registry.py`: any refusal while loading is the entry's "
     "ModelLoadError (`model_load_failed`); `server/_streaming.py`: cancelled before the "
     "deadline is 503 `shutting_down`"),
    ("lifecycle (1 in 10,000 programs, after it reached vision projectors)", "a Llama with a "
     "vision projector closed while another thread ran a completion with an image",
     "SIGSEGV in `mtmd_tokenize`: the projector, chunks and bitmaps it read were freed under "
     "it", "`_native/mtmd.py`: tokenize, the audio decoder and the chunk accessors hold what "
     "they read in flight (test in `tests/test_multimodal.py`)"),
    ("compat (llama-cpp-python's API)", "keywords of another type: `temperature=\"1\"`, "
     "`top_k=[1]`, `logit_bias=True` or `{2: [1]}`, `logprobs=\"yes\"`, `functions=True`, "
     "`function_call={\"type\": \"function\"}`, `chat_format=5`, `lora_path=5` (28 of 400 "
     "cases)", "TypeError from a comparison, AttributeError, KeyError or ValueError from deep "
     "inside (unclean)", "`compat/llama.py`: the public methods check their arguments "
     "against their annotations (`check_arguments` in `_field_types.py`, which moved below "
     "the handles for it); logit_bias and function_call checked by shape"),
    ("a probe of Llama's methods (after the compat section)", "`tokenize(5)`, "
     "`detokenize([\"a\"])`, `create_completion(None)`, `create_chat_completion(\"hi\")`, "
     "`load_state(b\"x\")`, `set_lora_adapters(5)`, `lora=5`; `llm.seed = \"x\"`",
     "TypeError, ValueError or AttributeError from deep inside (unclean); the bad seed kept, "
     "refusing every later completion", "`_llama.py`: the public methods `@checked` against "
     "their annotations (`_field_types.checked`); `seed` a checked property"),
    ("compat", "`Llama(5)`, `Model.load(\"a\\0b\")`, a projector, adapter, draft model or control "
     "vector path of 5,000 characters; `create_chat_completion(tools={\"a\": 1})`",
     "TypeError from pathlib, OSError \"File name too long\" (`Path.is_file()` lets it "
     "through), AttributeError (unclean)", "`_field_types.file_path` for every path; "
     "`_native/gguf_reader.py` turns an OSError into ModelLoadError; `_chat/options.py` checks "
     "its fields"),
    ("server: isolated (models in processes of their own, killed at random)", "a stream on "
     "Anthropic's `/v1/messages` whose model process dies mid-answer", "an OpenAI-shaped "
     "`data: {\"error\": ...}` line, which Anthropic's SDK skips: a silently cut message",
     "`server/_forward.py`: the error event in the shape of the route's API (test in "
     "`tests/test_server_isolation.py`)"),
    ("server: isolated", "a stream whose generation a forced unload cancelled mid-answer",
     "its error event said `timeout` (\"ran past 600 s\") after a fraction of a second",
     "`server/_streaming.py`: a stream cancelled before its deadline ends with `shutting_down`, "
     "as a whole completion does (test in `tests/test_server_models.py`)"),
    ("server: isolated", "an entry that fails to load, asked twice through Anthropic's route",
     "two different messages: the first the file's error alone, later ones \"model 'x' failed "
     "to load: ...\"", "`_registry.py`: every failure to load is worded the same, naming the "
     "entry"),
    ("a probe of `os.fork()` (then lifecycle's fork operation)", "a process forked after "
     "llama.cpp computed (multiprocessing's default start method on Linux): the parent's "
     "Llama used in the child, a model of the child's own, the child's exit while a parent "
     "thread generated", "the child's first decode waited forever in libgomp for the "
     "parent's OpenMP threads (even with its own model); a parallel Llama's completion, or a "
     "stream it had open, waited for its engine thread; the exit waited 10 s for the "
     "parent's calls", "`_native/fork.py`: handles made before the fork are foreign in the "
     "child (ForkedHandleError, never freed), the Llama's locks reset there, one compute "
     "thread where GNU OpenMP's pool is the parent's (tests in `tests/test_fork.py`; with "
     "the fix undone, 55 of 1,000 short lifecycle programs failed, 7 of them hangs)"),
    ("a probe of custom samplers (then lifecycle's reenter operation)", "a custom sampler "
     "that uses its own Llama: a completion, a close, a reset", "on parallel slots, a "
     "completion from inside waited forever for the engine thread it ran on; on one slot it "
     "cut the running generation short; a close was refused half-way, leaving the model "
     "closed and never freed (8 of 1,000 short lifecycle programs with the fix undone)",
     "`_features/completion.py`: no generation starts on a thread inside the context "
     "(`Context.held_here`); `_native/handle.py`: `check_closable` refuses before changing "
     "anything (test in `tests/test_threads.py`)"),
    ("probes in cgroups (a container's limits)", "`Llama(path, n_ctx=2**23, n_ubatch=1)` on "
     "the tiny model (2.4 GiB) in 1 GiB of memory; Gemma 3 270M with `use_mmap=False` in 160 "
     "MiB; `n_threads=4` under a pids limit of 3", "SIGKILL by the OOM killer (the memory "
     "checks compared with the machine's 23 GiB); exit status 1 from libgomp (\"Thread "
     "creation failed\")", "`_native/host_limits.py`: the least of physical memory and the "
     "process's cgroup v1 / v2 limits; compute threads capped to the pids room (tests in "
     "`tests/test_host_limits.py`, in real cgroups where they can be made)"),
    ("hub (the first run of the section, on the code before it)", "a hub endpoint answering "
     "an ETag or X-Linked-Etag that is a path (absolute, climbing, weak), a listing whose "
     "\"next\" link names another host, a listing of names that are not strings", "the "
     "download written to that path, outside the cache (huggingface_hub 2.4.0 names the blob "
     "after the ETag); the token sent to the other host; AttributeError (unclean): 30 of 300 "
     "short cases", "`_features/hub_guard.py`: ETags and commit hashes must be plain names "
     "before huggingface_hub makes paths of them; the listing is llamacrab's own, bounded and "
     "on the endpoint's origin (tests in `tests/test_hub_hostile.py`)"),
    ("interrupts (the first run of the section, on the code before it)", "SIGINT sent while "
     "Gemma 3 270M loads, with or without mmap", "the KeyboardInterrupt raised inside "
     "llama.cpp's log or progress callback, printed (\"exception in a callback from "
     "llama.cpp\") and lost, the load going on: 12 of 120 short cases",
     "`_native/signals.py`: signal handlers held while a native object is made and run by the "
     "load's progress callback (a raising one cancels the load); an interrupt caught in any "
     "other callback raised when the call returns (tests in `tests/test_interrupts.py`)"),
    ("interrupts (its first long run)", "SIGINT at 2 ms into a stream on a Llama with a RAM "
     "prompt cache", "the next completion failed: DecodeError \"invalid batch (tokens or "
     "positions rejected)\" (the memory cut back, the engine's record of its tokens not yet)",
     "`_engine/generation.py`: a prompt goes on from the positions the memory holds, not from "
     "the record (test in `tests/test_interrupts.py`)"),
    ("interrupts (its first long run)", "SIGINT while a state read from disk loads, then a "
     "garbage collection", "SIGSEGV in `gc.collect()` (\"memoryview has 1 exported buffer\"): "
     "the interrupted frame, kept by the traceback in a cycle, held cffi's buffer over the "
     "state's payload view", "`_native/context.py`: the buffer is released as the call ends "
     "(test in `tests/test_interrupts.py`)"),
    ("interrupts (a long run, 2026-12-03)", "SIGINT while a `Llama` with a disk prompt cache "
     "looks up a prompt on the main thread, then two threads completing on it", "a hang: the "
     "threads waited 60 s for the database lock (2 of 2,000 cases); diskcache's transaction "
     "was left open by an interrupt landing just after its `BEGIN IMMEDIATE`",
     "`_engine/cache.py`: every diskcache call holds signal handlers until it returns (test "
     "in `tests/test_state.py`)"),
    ("reading libmtmd's encoder while making its encodes stoppable (2026-12-04)", "one "
     "`Projector` evaluating prompts with images for two contexts on two threads",
     "SIGSEGV: libmtmd keeps one compute graph and one output buffer per projector",
     "`_native/mtmd.py`: one evaluation at a time per projector, the second a "
     "ConcurrentUseError (test in `tests/test_multimodal.py`)"),
    ("lifecycle (seed 2035, 2026-12-04)", "a `SamplerChain` with a grammar accepting an "
     "end-of-generation token before the grammar is complete", "SIGABRT: llama.cpp's grammar "
     "aborts (`GGML_ABORT`) when no parse may end there (5 cases of 10,000)",
     "`_native/sampler.py`: the grammar's own apply tests the end token first; a GrammarError "
     "names it (test in `tests/test_crash_proof.py`)"),
    ("media (seed 2035, 2026-12-04)", "an 844-byte WAV file whose format chunk claims 21,776 "
     "bytes and whose RIFF size is 3", "a hang: libmtmd's decoder (miniaudio's dr_wav) seeks "
     "back by the chunk's size less its extension, an int below 0, and reads the same chunks "
     "for ever (1 case of 3,000)", "`_native/media.py` (`check_wav_format_chunks`): a format "
     "chunk that cannot hold its extension is a MediaError first (tests in "
     "`tests/test_multimodal.py`)"),
    ("interrupts (CI, seed 2026, 2026-12-04)", "SIGINT during the first completion of a "
     "`Llama` just loaded, which the case then drops; one collection", "the model file still "
     "mapped after the collection (1 case of 120): the Model and its Vocab held each other, so "
     "every dropped model waited for the cyclic collector, here for a second collection after "
     "the one that freed the interrupted frames", "`_native/model.py`: the model holds its "
     "Vocab weakly, so a dropped `Llama` frees its model at once (tests in "
     "`tests/test_handles.py`)"),
    ("lifecycle (seed 2041)", "`os.fork()` while another thread loads a `Llama`", "the "
     "forked child's own load hung for ever: before Python 3.12 `functools.cached_property` "
     "holds one lock for every instance while it computes (a model's metadata), and the child "
     "inherited it held", "`_native/fork.py`: `cached_property`, its lock reset in a forked "
     "child"),
    ("reading llama.cpp's API for what llamacrab did not call (`llama_model_cls_label`, "
     "2026-12-06)", "rank pooling on a model without a head of one output per label: the tiny "
     "llama with `classifier.output_labels` of 65 names or more, or any `pooling=\"rank\"` on a "
     "generative model", "SIGABRT at the first decode (`GGML_ASSERT(offset + size <= "
     "ggml_nbytes(tensor) && \"tensor read out of bounds\")`, ggml-backend.cpp:283); below 65 "
     "labels, other texts' hidden-state values as scores", "`_native/context.py` "
     "(`_check_classifier`): the head's outputs (from the file's tensors) must equal the "
     "labels' count when the context is made (tests in `tests/test_classify.py`)"),
    ("the same reading, the widths llama.cpp copies embeddings at", "a tiny llama with "
     "`llama.embedding_length_out = 1000`, embeddings taken", "SIGABRT at the first decode "
     "(the same assert); 16: values strided wrongly", "`_native/gguf/arch_rules.py` "
     "(`_output_width_rule`): equal to `embedding_length` but for the graphs that make their "
     "output that wide (test in `tests/test_gguf_check.py`)"),
    ("compat (seed 2049, projector chat handlers drawn)", "a projector chat handler's "
     "`clip_model_path` of 5,000 characters (`Llava15ChatHandler(clip_model_path=\"x\" * "
     "5000)`)", "OSError \"File name too long\" escaping from `Path.exists()` (unclean; 4 "
     "cases of 10,000)", "`compat/llama_chat_format.py`: InvalidParameterError naming "
     "`clip_model_path` (test in `tests/test_multimodal.py`)"),
    ("archs (2026-12-07: each architecture's synthesized tiny model as it is, 24 of 138 "
     "died)", "hybrids without a recurrent or an attention layer (lfm2, plamo2, nemotron_h); "
     "optional tensors a graph multiplies by (phi3/pockettts attention, the mamba2 conv bias "
     "of falcon-h1/granitehybrid/nemotron_h, qwen3.5/qwen3next projections, T5's layer-0 "
     "relative bias); afmoe without a window", "SIGABRT (`GGML_ASSERT(buffer)`) or SIGSEGV "
     "at the context's creation or first decode", "`_native/gguf/arch_rules.py` "
     "(`_layer_tensor_rules`, archs.HYBRID_INPUTS and LAYER_TENSORS; tests in "
     "`tests/test_synthesized_archs.py`)"),
    ("the same run", "key caches narrower than the keys: `head_count_kv` != `head_count` in "
     "minicpm3, plm, t5, t5encoder, deepseek2-ocr, dots1, olmoe, deepseek2; latent MLA "
     "(deepseek32, glm-dsa, glm5-next, hy_v4, kimi) with 2 KV heads or another key length; an "
     "indexer key length of 32; T5 buckets of 2; no `expert_gating_func` (dots1, hy_v4, "
     "minimax-m2); llama4 of 2 layers; chameleon of 271 tokens", "SIGABRT: `ggml_set_rows`, "
     "`ggml_reshape_3d`, `ggml_can_mul_mat`, `ggml_can_repeat`, `get_rows` asserts, "
     "`GGML_ABORT` in `build_moe_ffn`, \"tensor buffer not set\", `ggml_set_1d`",
     "`_native/gguf/arch_rules.py` (KEYS_FOR_EVERY_HEAD, MLA_LATENT, INDEXER_ROTATED, "
     "T5_BUCKETS, GATING_REQUIRED, `_llama4_rules`, the chameleon vocabulary)"),
    ("the same run", "a qwen4exp context with `embeddings=True`; plm with flash attention "
     "(auto) on a prompt; a chameleon prompt longer than `n_ubatch`", "SIGABRT (embeddings "
     "read past the graph's output; `ggml_set_rows`; `ggml_set_1d` of a micro-batch without "
     "outputs) whatever the file", "`_native/context.py` (`_fit_graph`: refused, or flash "
     "attention off for plm) and `Context._compute` (every chameleon token an output)"),
    ("archs (long, 12,000 cases, seed 2026: 2 of them; then the synthesizer's next three "
     "architectures)", "gpt-oss with `attention.value_length_swa = 1`; qwen3vl with "
     "`n_deepstack_layers = 7` (of 2 layers); bailingmoe3 with 2 latent KV heads; rwkv6 with "
     "KV head groups", "SIGABRT: `ggml_set_rows`, `ggml_can_repeat` in the deepstack add "
     "after the last layer kept only its output rows, `ggml_reshape_4d`",
     "`_native/gguf/attention.py` (HEADS_ALL_ROPE) and `arch_rules.py` "
     "(DEEPSTACK_AFTER_LAYER, MLA_LATENT, the rwkv6 heads)"),
    ("archs (long, 40,000 cases, seed 2026: 3 signal deaths, 2 hangs)", "falcon-h1's "
     "`blk.1.ssm_d` (1 x 8) as F16; `rope.dimension_count = 0` (gemma, bailingmoe2); "
     "`qwen.attention.head_count_kv = [1, 2]`; `mistral4.expert_used_count = [1, 2]`",
     "SIGABRT (binary_op \"unsupported types\", `ggml_set_rows`, `ggml_view_2d` past the "
     "routed experts); a hang: ggml's rope kernel loops for ever over 0 dimensions",
     "`_native/gguf_reader.py` (any 1 x N vector F32), `attention.py` (ROPE_WHOLE_HEAD, "
     "uniform head_count_kv arrays but for PER_LAYER_KV_HEADS, step35), `arch_rules.py` "
     "(uniform expert_used_count but for nemotron_h); granitemoe and minicpm joined "
     "HEADS_K_EQ_V_EQ_ROT"),
    ("archs (long, 40,000 cases, seed 2026, after those fixes: 1 signal death)",
     "`granite_swa.attention.rope_pattern = [0, 0, 0]`", "SIGABRT at the first decode: "
     "\"tensor buffer not set\" (the positions input its graph builds, used by no layer)",
     "`_native/gguf/arch_rules.py`: a layer that ropes"),
    ("the synthesizer growing deepseek4 (its loader's scoring and compress-ratio keys)",
     "every deepseek4 file it made: `compress_ratios` [0, 0] or [0, 128]; 2 KV heads; "
     "indexer keys of 32 or 96; embeddings taken", "SIGFPE (an indexer KV cache without "
     "layers: its forced rotation's size loop overflows to % 0); SIGABRT (`ggml_set_rows`, "
     "`ggml_reshape_2d`, \"tensor read out of bounds\")", "`_native/gguf/arch_rules.py` "
     "(`_deepseek4_rules`; deepseek32, glm-dsa, dots3note need a main layer) and "
     "`_native/context.py` (deepseek4 embeddings refused)"),
    ("archs (long, 40,000 cases, seed 2026, with deepseek4: 2 signal deaths, 2 hangs)",
     "`bailingmoe.attention.value_length = 1000`; `kimi-k3.leading_dense_block_count = "
     "2^32 - 1`; `deepseek4.hash_layer_count` 2^32 - 1 (and 2^40 as a u64)", "SIGABRT "
     "(`ggml_set_rows`); SIGSEGV (a dense FFN the loader never made: it compares the count as "
     "an int, the graph as unsigned); the hangs were llamacrab's own check listing 2^32 tensor "
     "names", "`_native/gguf/archs.py` (bailingmoe in HEADS_ALL_ROPE), `arch_rules.py` "
     "(`leading_dense_block_count <= block_count`; the hash-layer count capped at the layers)"),
    ("archs in CI (2026-12-07: arwkv7 as it is refused in some children, not in others)",
     "arwkv7 (as rwkv7) with `wkv.head_size` 16: ggml's CPU wkv7 kernel walks a head 32 "
     "floats at a time here (64 with AVX-512) with no tail", "no signal: each row read the next "
     "head's values and the last read and wrote past its tensors, so the logits were NaN or "
     "another text with what the heap held (valgrind: uninitialised values from layer 0 on)",
     "`_native/gguf/arch_rules.py` (archs.WKV7_STEP: a multiple of 64); the archs section now "
     "poisons its children's heap with another byte than the syntheses' and compares what "
     "each model computes (synthesized.fingerprint)"),
    ("tampered-tiny on a build with UndefinedBehaviorSanitizer (2026-12-07, short size)",
     "`general.file_type` = 4294967295 or 2147483647", "undefined behaviour, no signal: the "
     "loader casts the value to `enum llama_ftype`, which holds 0..2047 (UBSan: \"not a valid "
     "value for type 'llama_ftype'\", llama-model-loader.cpp:1805)",
     "`_native/gguf/check.py`: `general.file_type` in 0..2047"),
    ("states on a build with UndefinedBehaviorSanitizer (2026-12-07, short size: 3 of 2,000)",
     "a sequence state with a token at position 2^31 - 1, then a decode", "undefined "
     "behaviour, no signal: each decode computes every sequence's next position (last + 1) "
     "in int32 (UBSan: \"signed integer overflow\", llama-batch.cpp:1265)",
     "`_native/context.py`: a loaded state past `LAST_POSITION` (2^31 - 2) is refused and the "
     "memory cleared; `Batch` and `shift` refuse such positions"),
    ("inputs on a build with AddressSanitizer (2026-12-07, long size, seed 2026: a hang)",
     "the grammar `root ::= ((\"\" ){0,100000}){0,100000}`", "the plain build: all 24 GiB of "
     "memory inside llama.cpp's grammar sampler, then the OOM killer (glibc's abort under a "
     "4 GiB limit); the fan-out bound counted a rule matching nothing as no way on",
     "`_native/gbnf/fanout.py`: each copy of a rule counts at least one way"),
    ("a review of positions in llama-batch.cpp, then lifecycle (2026-12-07: 15 of 1,000 "
     "short programs with the fix undone, once raw batches went into a BERT reranker)",
     "`Batch.set_one(token, -1)` (or `set`, `set_rows` from -1) decoded", "SIGABRT on a BERT "
     "model: its learned position table read at row -1 (`GGML_ASSERT(i01 >= 0 && i01 < ne01)`, "
     "ggml-cpu/ops.cpp:5363); on a decoder the KV cache held the token in a cell it counts as "
     "empty", "`_native/batch.py`: positions start at 0"),
    ("a review of positions, then lifecycle's project operation (2026-12-07: 6 of 1,000 "
     "short programs with the fix undone)", "`Projector.evaluate(context, chunks, n_past, "
     "seq_id)` with a `seq_id` the context lacks, or `n_past` -1 or near 2^31",
     "SIGABRT: `GGML_ASSERT(idx >= 0)` in libmtmd's helper (mtmd-helper.cpp:231); a prompt at "
     "-1, or past `INT32_MAX`", "`_native/mtmd.py`: the sequence and the prompt's positions "
     "checked first"),
    ("a call-argument audit (2026-12-07: each llama.cpp function llamacrab calls read "
     "against its guards, each finding proven in a child process)",
     "`Projector(model, path, n_threads=600)` (or 100,000), then an image",
     'libgomp exited the process ("Thread creation failed"), or SIGSEGV in '
     "`GOMP_parallel`: a projector's thread count had no bound, a context's had",
     "`_native/mtmd.py`, the RPC worker's options and `serve`: 1..512 "
     "(`host_limits.GGML_MAX_N_THREADS`)"),
    ("the same audit",
     "`Llama(t5, mmproj=...)`, then an image in a completion",
     'SIGABRT: `GGML_ASSERT(... "llama_encode must be called first")` '
     "(llama-graph.cpp:1070): libmtmd decodes into the decoder with nothing encoded",
     "`_native/mtmd.py` (`embeddings_refusal`): no projector for an encoder-decoder "
     "model"),
    ("the same audit",
     "`Llama.detokenize` of tokens whose text passes 2 GiB (3,000 copies of a 1 MiB "
     "token; 89 million of a 48-byte one of Gemma 3)",
     "a hang: llama.cpp adds the pieces' lengths up in an int32, which wrapped, and "
     "llamacrab asked again for the room it named, for ever (past 4 GiB: the text cut "
     "short)",
     "`_native/vocab.py`: one buffer sized from the pieces' lengths; past 2 GiB a "
     "TokenizeError"),
    ("the same audit",
     "a `grammar` with `infill=True` (default settings); a grammar whose every allowed "
     "token `logit_bias` bans, with `top_k=3`",
     "SIGABRT: `GGML_ABORT` in the grammar's accept (llama-grammar.cpp:1487): the last "
     "sampler picked an end-of-generation token the grammar does not allow yet (the "
     "infill sampler's, or the last of candidates all at -inf)",
     "`_native/sampler.py`: a chain with a grammar applies, checks its pick with the "
     "grammar, then accepts it; a GrammarError"),
    ("the same audit",
     "`Context.set_graph_sampler(seq, chain)` with a chain given before, a `top_k` "
     "past the vocabulary, or a chain given and then sampled on the CPU",
     "SIGABRT: `backend_init() called twice` (llama-sampler.cpp:739); ggml's top_k at "
     "the next decode; `cur_p.selected` in `llama_sampler_sample` "
     "(llama-sampler.cpp:956)",
     "`_native/sampler.py` (`claim_graph`): set_graph_sampler checks what attach does"),
    ("the same audit",
     "one `SamplerChain` accepting from two threads, or reset during an accept",
     "SIGSEGV (1 run of 3); SIGABRT in the grammar (3 of 3)",
     "`_native/sampler.py`: one thread's call at a time (ConcurrentUseError)"),
    ("the same audit",
     "`infill=True, top_k=0` on Gemma 3's 262,144 tokens",
     "a hang: the infill sampler compares every pair of candidates in one call (65,536 "
     "took 158 s)",
     "`_native/sampler.py`: at most 4,096 candidates (a top_k before it)"),
    ("the same audit",
     '`Context.shift` or `divide` with `type_k="bf16"`; on a sliding-window model '
     "whose layers all slide (`swa_full=True`)",
     "SIGABRT at the next decode: ggml's CPU rope on bf16 keys (ops.cpp:6486); "
     "`GGML_ASSERT(buffer)` (ggml-backend.cpp:205), the other layers' cache holding "
     "none",
     "`_native/context.py` (`_shiftable_memory`)"),
    ("the same audit",
     'a quantized `type_k` with `flash_attn="off"` on key heads its blocks do not '
     "divide (the tiny model's 16 in q4_0's 32); a T5 context with `pooling=\"mean\"`",
     "no signal: every attention score 0, the same logits whatever the prompt; a "
     "decoder that ignored its prompt",
     "`_native/context.py`: both refused"),
    ("archs (long, on two heaps, seed 2026, 2026-12-07)",
     "cohere2moe with `attention.key_length_swa` or `value_length_swa` = 1000 (its "
     "layers mix sliding-window and full attention)",
     "SIGABRT when the context was made: `GGML_ASSERT(a->ne[0] == b->ne[0])` in "
     "`ggml_set_rows` (the graph sizes every layer's heads by layer 0's, the KV cache "
     "each by its kind); the same for granite_swa files a test had called accepted",
     "`_native/gguf/attention.py` (`_check_mixed_kinds`): the _swa sizes equal the "
     "others where the kinds mix, but for `archs.HEADS_BY_LAYER_KIND`"),
    ("a server test failing in CI 1 run in about 20, then a stress of mixed LoRA requests "
     "(2026-12-07: 883 of 3,556 innocent requests failed)",
     "a request whose LoRA scale overflows (1e30) on a prompt longer than the next one on "
     "its slot; a `Llama` likewise",
     "no signal: NaN left in the cells its sequence freed, read again through the "
     "attention mask (the CPU's flash attention multiplies whole tiles, the V product "
     "without it every cell): later prompts came out NaN, a 500 (or a 400 blaming a "
     "scale of 0.5) for innocent requests, a context broken for good",
     "llamacrab-sys patch `llama-memory-seq-rm-zeroed`; `_native/context.py` "
     "(`note_non_finite`): after a NaN output each sequence's next removal zeroes the "
     "cells it frees"),
    ("the call-argument audit (2026-12-07), fixed the session after",
     "`Context.divide(seq, 2)` (self-extend) on any model with rope",
     "no signal: llama.cpp recorded the keys' rotation with the wrong sign (pos_div), "
     "turning them away from their new positions: the next logits 7.7 apart from an "
     "equal shift's on Gemma 3 (scale 61)",
     "llamacrab-sys patch `llama-kv-cells-divide-shift-sign`"),
    ("a review of the zeroing fix above (2026-12-07)",
     "`Context.keep(seq)`, or a sequence's state load, after an overflowing decode on "
     "another sequence (or that one)",
     "no signal: llama.cpp's keep and a state load free cells through their own removal, "
     "which left the NaN in them: the next prompts (8, 70, 100 tokens) came out NaN",
     "`_native/context.py` (`_seq_rm`): a marked sequence is removed with the zeroing "
     "removal first"),
]  # fmt: skip


# The seven FFI traps (tests/test_ffi_traps.py): what guards each, and its test class.
FFI_TRAPS = [
    ("lifetimes", "`weakref.finalize` holds the parent; children close first; "
     "`ClosedHandleError` before any C call", "TestLifetimes"),
    ("allocator mismatch", "each object freed by its own llama.cpp free function; batches and "
     "string buffers are Python's (numpy, `ffi.new`, sized by asking C first); shim errors "
     "copied into a Python-owned struct", "TestAllocatorMismatch"),
    ("C++ exceptions crossing the FFI", "a generated exception-safe shim per llama.cpp function: "
     "`NativeError`", "TestCppExceptions"),
    ("one context, several threads", "`ConcurrentUseError`; a `Llama` serializes its calls; "
     "`close()` waits for the call in flight", "TestOneContextManyThreads"),
    ("KV reuse pollution", "stale tokens removed, caches restore exact prefixes: bit-identical "
     "logits", "TestKvReusePollution"),
    ("NUL-terminated strings", "prompts pass with their length; C strings with a NUL refused by "
     "name; paths never cut", "TestNulTerminatedStrings"),
    ("duplicate symbols", "our libraries' own names and SONAMEs (`libllamacrab-llama.so.0`, "
     "...)", "TestDuplicateSymbols"),
]  # fmt: skip


def ffi_traps() -> str:
    lines = ["| trap | what guards it | tests |", "| --- | --- | --- |"]
    lines += [f"| {trap} | {guard} | `{tests}` |" for trap, guard, tests in FFI_TRAPS]
    return "\n".join(lines) + "\n"


def found() -> str:
    lines = ["| found by | input | what happened | fixed in |", "| --- | --- | --- | --- |"]
    lines += [f"| {' | '.join(row)} |" for row in FOUND]
    return "\n".join(lines) + "\n"


def table(reports: list[Report]) -> str:
    columns = ["cases", "worked", "refused", "signal deaths", "hangs", "unclean errors"]
    lines = ["| section | " + " | ".join(columns) + " | slowest case s | peak RSS MiB | wall s |",
             "| --- |" + " ---: |" * (len(columns) + 3)]  # fmt: skip
    for report in reports:
        counts = report.counts
        slowest = report.slowest
        lines.append(
            f"| {report.section} | " + " | ".join(str(counts[c]) for c in columns)
            + f" | {slowest.seconds if slowest else 0:.2f} | {report.peak_rss_mib:.0f} "
            f"| {report.wall_seconds:.0f} |"
        )  # fmt: skip
    return "\n".join(lines) + "\n"


def details(report: Report) -> str:
    section = SECTIONS[report.section]
    refused = report.error_types()
    for result in report.results:  # a lifecycle sequence counts the refusals of its operations
        if result.outcome == "ok" and "; refused: " in result.detail:
            for part in result.detail.split("; refused: ", 1)[1].split(", "):
                name, _, count = part.rpartition(" ")
                if count.isdigit():
                    refused[name] += int(count)
    refusals = ", ".join(f"{name} {n}" for name, n in refused.most_common())
    slowest = report.slowest
    lines = [
        f"### {section.title} (`{report.section}`)",
        "",
        f"{section.what[0].upper()}{section.what[1:]}. {report.extra.get('generated', 0)} cases "
        f"generated (seed {report.extra.get('seed', SEED)}, "
        f"{report.extra.get('drawn_with', 'hypothesis')}), {len(report.results)} run in "
        f"{report.children} child processes; limits: "
        f"{section.case_timeout:.0f} s per case"
        + (f", {section.memory_limit >> 30} GiB address space per child"
           if section.memory_limit else "") + ".",
        "",
        f"- refusals by type (of cases, or of a sequence's operations): {refusals or 'none'}",
    ]  # fmt: skip
    if "synthesis" in report.extra:
        lines.append(f"- synthesis: {report.extra['synthesis']}")
    if slowest is not None:
        lines.append(f"- slowest case: {slowest.id} ({slowest.seconds:.2f} s): "
                     f"{slowest.detail.splitlines()[0][:160]}")  # fmt: skip
    findings = report.findings
    lines.append(f"- crashes, hangs and unclean errors: {len(findings) or 'none'}")
    for result in findings:
        lines.append(f"  - {result.outcome} {result.id}: {result.detail.splitlines()[0][:300]}")
    return "\n".join(lines) + "\n"


def load_average() -> str:
    return " / ".join(f"{value:.1f}" for value in os.getloadavg())


def server_failures(server: dict[str, Any] | None) -> int:
    """Failed server sections (each counts its own deaths, hangs, 5xx and bounds)."""
    if server is None:
        return 0
    return sum(not part["ok"] for name, part in server.items() if isinstance(part, dict))


def markdown(
    reports: list[Report], command: str, workers: int, server: dict[str, Any] | None = None
) -> str:
    total = sum(len(r.findings) for r in reports)
    verdict = ("0 signal deaths, 0 hangs and 0 unclean errors in every section" if not total
               else f"{total} failures: see the sections")  # fmt: skip
    if server is not None:
        failed = server_failures(server)
        verdict += ("; the server: 0 signal deaths, 0 hangs, 0 5xx, RSS within its bounds"
                    if not failed else f"; {failed} server sections failed: see below")  # fmt: skip
    body = "\n".join(details(r) for r in reports)
    if server is not None:
        body += "\n" + reliability_server.server_sections_markdown(server)
    return f"""# Reliability

How hard llamacrab is to break, measured: latest results of `{command}`.
Machine: {machine_info.describe()}; {workers} worker{"s" * (workers != 1)} (child processes
at a time); load average at the end {load_average()} (1 / 5 / 15 minutes, the run's own children
included): the times are upper bounds.

Result: {verdict}.

{table(reports) if reports else ""}
"worked": the case ran to the end (a model loaded and generated, a template rendered, ...);
"refused": a `LlamaError` subclass naming the problem, the expected answer to a bad input;
"unclean": any other exception escaping the library; "signal deaths": the child process died
(SIGSEGV, SIGABRT, the OOM killer, an exit status without a report); "hangs": no report within
the case's time limit. Each death or hang is pinned on one case (the case in flight, confirmed
by rerunning it alone in a fresh child). CI runs the short size of every section
(`tests/test_reliability.py`) and asserts no failures and the case counts.

{body}
## Found and fixed

What the suite found when it was first run (each fixed at its root, with a regression test in
`tests/test_reliability.py`):

{found()}
## The seven FFI traps

`tests/test_ffi_traps.py` names each trap of wrapping llama.cpp and holds a regression test
for its guard (CI runs it):

{ffi_traps()}
Duplicate symbols, measured: llama-cpp-python 0.3.36 compiled with its own llama.cpp
(`scripts/peer_compiled.py`, cached) and llamacrab generate in one interpreter, each import
order in a child under `LD_DEBUG=bindings`. Both packages load their libraries RTLD_LOCAL
(Python's import of an extension module; ctypes' default), so neither interposes on the
other's symbols, and no symbol versioning is involved. That did not protect us: with
upstream's SONAMEs on both sides (`libllama.so.0`, `libggml.so.0`, `libggml-base.so.0`), the
dynamic loader satisfied the second package's NEEDED entries with the first one's already
loaded libraries: with llamacrab first, llama-cpp-python's libllama bound 327 symbols to our
libggml; with llama-cpp-python first, our cffi module and libmtmd bound 1,143 symbols to its
libllama and libggml, and ours were never loaded. Both generated the same text anyway (the
same commit), which is why only the loader's own account shows it. Our libraries now carry
names and SONAMEs of their own (`build_tools/native.py`: a `CMAKE_SHARED_LIBRARY_PREFIX` of
`libllamacrab-`); the test asserts that no binding crosses between the two packages' files
in either order, that each package's libllama and libggml are mapped, and that both generate
the same greedy tokens from Gemma 3 270M.

## How it works

`scripts/reliability.py` (this report) and `tests/test_reliability.py` (CI) share
`tests/reliability_kit/`: `children.py` runs many cases per child process and isolates a
culprit, `lifecycle.py`, `tampered.py`, `inputs.py`, `states.py` and `media.py` make and run the
cases, `sections.py` holds the sizes. The cases are the same list in every process for a
section, mode and seed (hypothesis draws them with `@seed` and no database, the media section
with a seeded `random.Random`; the same hypothesis version, which each section's report
records). Hypothesis's draws also depend on what the drawing process imported and drew before
(measured 2026-12-07: `import reliability_server`, which loads schemathesis, changed the
inputs section's list, and a replay drew another case for a failure of a run that had drawn
nine sections first), so each section's cases are drawn in a fresh process of their own
(`reliability_kit/draw.py`, since 2026-12-07: case ids of hypothesis-drawn sections in
earlier reports name other cases now). A failure's case id, printed with the command that
replays it, is enough: `python scripts/reliability.py --mode short --seed 2026 --replay
lifecycle-2026-29` draws the cases again and runs that one alone in a child, printing its
outcome; a failing batch's job file, which holds its exact cases, is also kept
(`PYTHONPATH=tests:scripts python -m reliability_kit.child JOB.json`).
The server's load, fault and leak sections (`scripts/reliability_server.py`) have counts of
their own: requests rather than cases, and 5xx answers and RSS growth as the failures.
"""


def replay(case_ids: list[str], mode: str, workdir: Path, seed: int) -> int:
    """Run the named cases again, in one child, printing each one's outcome."""
    job = replay_job(case_ids, mode, workdir, seed)
    print(f"replaying {', '.join(case_ids)} ({mode}, seed {seed}) from {job}", flush=True)
    env = {**os.environ, "GGML_NO_BACKTRACE": "1",
           "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO / "scripts"),
                                          os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    env.pop("RELIABILITY_FD", None)  # the child prints its reports
    child = subprocess.run([sys.executable, "-m", "reliability_kit.child", str(job)], env=env,
                           cwd=REPO, check=False)  # fmt: skip
    if child.returncode:
        print(f"the child ended with exit status {child.returncode}", flush=True)
    return child.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("long", "short"), default="long")
    parser.add_argument("--sections", default=",".join([*SECTIONS, SERVER]))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, help=f"a fresh set of cases (default: {SEED}; "
                        "the server sections' default: 0)")  # fmt: skip
    parser.add_argument("--workdir", type=Path, help="models, work files and kept job files")
    parser.add_argument("--report", type=Path, help="write the Markdown report here")
    parser.add_argument("--replay", help="case ids (comma-separated) to run again, alone")
    args = parser.parse_args()
    seed, server_seed = (SEED, 0) if args.seed is None else (args.seed, args.seed)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="llamacrab-reliability-"))
    if args.replay:
        sys.exit(replay(args.replay.split(","), args.mode, workdir, seed))
    print(f"work files, kept job files and per-case results in {workdir}", flush=True)
    names = args.sections.split(",")
    unknown = set(names) - {*SECTIONS, SERVER}
    if unknown:
        parser.error(
            f"no section {sorted(unknown)}; the sections: {', '.join([*SECTIONS, SERVER])}"
        )
    reports = []
    for name in (n for n in names if n != SERVER):
        started = time.monotonic()
        print(f"== {name} ({args.mode})", flush=True)
        report = run(name, args.mode, workdir, workers=args.workers, seed=seed,
                     progress=lambda line: print("  " + line, flush=True))  # fmt: skip
        print(report.summary(), f"({time.monotonic() - started:.0f} s)", flush=True)
        reports.append(report)
        (workdir / f"{name}-results.json").write_text(json.dumps([vars(r) for r in report.results]))
    server = None
    if SERVER in names:
        started = time.monotonic()
        print(f"== {SERVER} ({args.mode})", flush=True)
        server = reliability_server.run_server_sections(args.mode == "short", workdir / SERVER,
                                                        server_seed)  # fmt: skip
        print(f"{SERVER}: {'ok' if server['ok'] else 'FAILED'} "
              f"({time.monotonic() - started:.0f} s)", flush=True)  # fmt: skip
        (workdir / f"{SERVER}-results.json").write_text(json.dumps(server, indent=1))
    command = " ".join(["python scripts/reliability.py", *sys.argv[1:]])
    if reports:
        print(table(reports))
    if server is not None:
        print(reliability_server.server_sections_markdown(server))
    if args.report:
        args.report.write_text(markdown(reports, command, args.workers, server))
    failed = any(r.findings for r in reports) or (server is not None and not server["ok"])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
