"""Bounds on llama.cpp's std::regex pre-tokenizer fallback, which recurses once per character of
a match (libstdc++'s matcher) and so overflows the stack on a long run of one character class:
a SIGSEGV, which no handler can turn into an error, so it is prevented before the call."""

from __future__ import annotations

import re
import threading
from _thread import start_new_thread
from collections.abc import Callable
from typing import TypeVar

from llamacrab._exceptions import TokenizeError
from llamacrab._native.fork import reset_in_child

T = TypeVar("T")

# tokenizer.ggml.pre names whose every regex llama.cpp splits without recursing once per
# character: unicode_regex_split_custom (src/unicode.cpp) splits it by hand, or each match is one
# character (a lone class such as \p{N}), which std::regex matches at a constant depth however
# long the run. Any other BPE vocabulary (a missing or "default" name included) may recurse.
# tests/test_pretokenizer_table.py derives this from the pinned source and names what to change.
SHALLOW_SPLIT_PRE = frozenset({
    "a.x-4.0", "chatglm-bpe", "codeshell", "command-r", "dbrx", "deepseek-r1-qwen", "exaone",
    "exaone4", "f2llmv2", "falcon-h1", "falcon3", "gemma4", "gigachat", "glm4", "glm5", "gpt-2",
    "granite-docling", "granite-embed-multi-311m", "grok-2", "hunyuan", "jais", "jina-de",
    "jina-es", "jina-v1-en", "jina-v2-code", "jina-v2-de", "jina-v2-es", "jina-v5-nano",
    "kimi-k2", "kormo", "laguna", "lfm2", "llama-bpe", "llama-v3", "llama3", "megrez", "mellum",
    "mellum2", "midm-2.0", "minerva-7b", "modern-bert", "mpt", "olmo", "phi-2", "pixtral",
    "qwen2", "qwen35", "refact", "roberta-bpe", "sarvam-moe", "smaug-bpe", "smollm",
    "solar-open", "stablelm2", "starcoder", "trillion",
})  # fmt: skip

# Stack the fallback uses per character (code point) of one match: a run of letters, digits,
# punctuation or CJK on the DeepSeek-LLM, DeepSeek-Coder, Falcon, GPT-NeoX and Aquila vocabularies
# all overflowed an 8 MiB stack between 25,875 and 26,263 characters (x86-64, libstdc++ 14).
STACK_BYTES_PER_CHAR = 324
# Texts this short tokenize on the calling thread: 660 KiB of recursion at most.
ON_CALLER_MAX_CHARS = 2048
# Longer ones on a thread of their own with this stack (address space, committed as touched).
TOKENIZER_STACK_BYTES = 1 << 30
# What that stack holds, with a 2x margin for other libstdc++ builds and the frames around.
MAX_CHARS = TOKENIZER_STACK_BYTES // STACK_BYTES_PER_CHAR // 2

# One fallback match lies within a run of whitespace, the run of other characters after it and
# the whitespace after that: its length, so the recursion's depth, is at most this many runs.
# Only ASCII whitespace splits runs here, whatever else llama.cpp counts as whitespace.
RUNS_PER_MATCH = 3
_RUN = re.compile(r"[\t-\r ]+|[^\t-\r ]+")
_RUN_BYTES = re.compile(rb"[\t-\r ]+|[^\t-\r ]+")

_stack_size_lock = threading.Lock()
reset_in_child(_stack_size_lock)  # a thread holding it at fork() is not in the child
# Each thread may touch ~518 MiB of its stack at the bound: a few at a time, the others wait.
_big_stacks = threading.BoundedSemaphore(2)


def may_recurse_per_char(pre: str) -> bool:
    """Whether a BPE vocabulary with tokenizer.ggml.pre ``pre`` ("" if missing) may reach a
    std::regex fallback that recurses once per character of a match."""
    return pre not in SHALLOW_SPLIT_PRE


def longest_match_bound(text: str | bytes) -> int:
    """The most characters (bytes for bytes) one fallback match of ``text`` can span."""
    runs = _RUN.finditer(text) if isinstance(text, str) else _RUN_BYTES.finditer(text)
    return RUNS_PER_MATCH * max((run.end() - run.start() for run in runs), default=0)


def run_bounded(text: str | bytes, work: Callable[[], T]) -> T:
    """``work()``, tokenizing ``text`` through the fallback: on this thread when short, else on
    a thread with a stack deep enough, which this one waits for. Bytes that are not UTF-8
    count one character each."""
    if len(text) <= ON_CALLER_MAX_CHARS:
        return work()
    if len(text) > MAX_CHARS and (bound := longest_match_bound(text)) > MAX_CHARS:
        raise TokenizeError(
            f"text of {len(text)} characters is too long to tokenize with this model's "
            f"pre-tokenizer: a run of characters without whitespace may make one match of up "
            f"to {bound} characters (at most {MAX_CHARS}), and llama.cpp's regex splitter "
            "would overflow the stack"
        )
    outcome: list[T] = []
    failure: list[BaseException] = []
    done = threading.Event()

    def target() -> None:
        try:
            outcome.append(work())
        except BaseException as error:  # re-raised on the caller's thread
            failure.append(error)
        finally:
            _big_stacks.release()
            done.set()

    # ``work`` holds its vocabulary in flight itself: a Ctrl-C that ends this wait early
    # leaves the thread's call running, and closing the model waits for it.
    _big_stacks.acquire()
    try:
        _start_with_stack(target)
    except TokenizeError:
        _big_stacks.release()
        raise
    done.wait()
    if failure:
        raise failure[0]
    return outcome[0]


def _start_with_stack(target: Callable[[], None]) -> None:
    # The stack size is process-wide: restored as soon as the thread exists (threading.Thread
    # would wait for it to run first, and threads started meanwhile would get this stack).
    with _stack_size_lock:
        previous = None
        try:
            previous = threading.stack_size(TOKENIZER_STACK_BYTES)
            start_new_thread(target, ())
        except (RuntimeError, ValueError) as error:
            raise TokenizeError(
                f"could not start a tokenizer thread with a {TOKENIZER_STACK_BYTES >> 20} MiB "
                f"stack: {error}"
            ) from error
        finally:
            if previous is not None:
                threading.stack_size(previous)
