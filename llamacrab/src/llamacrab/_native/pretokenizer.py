"""Bounds on llama.cpp's std::regex pre-tokenizer fallback, which recurses once per character of
a match (libstdc++'s matcher) and so overflows the stack on a long run of one character class:
a SIGSEGV, which no handler can turn into an error, so it is prevented before the call."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from llamacrab._exceptions import TokenizeError

T = TypeVar("T")

# tokenizer.ggml.pre names whose every regex unicode_regex_split_custom (src/unicode.cpp) splits
# without std::regex. Any other BPE vocabulary (a missing or "default" name included) may reach
# the fallback. Re-derive at a pin bump: in llm_tokenizer_bpe's constructor (src/llama-vocab.cpp)
# keep the pre types whose regex_exprs all equal a string unicode_regex_split_custom compares
# against, then the tokenizer_pre names load() maps to them.
CUSTOM_SPLIT_PRE = frozenset({
    "a.x-4.0", "chatglm-bpe", "dbrx", "deepseek-r1-qwen", "exaone4", "f2llmv2", "falcon-h1",
    "falcon3", "gemma4", "gigachat", "glm4", "glm5", "gpt-2", "granite-docling",
    "granite-embed-multi-311m", "grok-2", "hunyuan", "jais", "jina-de", "jina-es", "jina-v1-en",
    "jina-v2-code", "jina-v2-de", "jina-v2-es", "jina-v5-nano", "kimi-k2", "kormo", "laguna",
    "lfm2", "llama-bpe", "llama-v3", "llama3", "megrez", "mellum", "midm-2.0", "modern-bert",
    "mpt", "olmo", "phi-2", "pixtral", "qwen2", "qwen35", "roberta-bpe", "sarvam-moe",
    "smaug-bpe", "solar-open", "stablelm2", "trillion",
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

_stack_size_lock = threading.Lock()


def may_recurse_per_char(pre: str) -> bool:
    """Whether a BPE vocabulary with tokenizer.ggml.pre ``pre`` ("" if missing) may reach the
    std::regex fallback."""
    return pre not in CUSTOM_SPLIT_PRE


def run_bounded(n_chars: int, work: Callable[[], T]) -> T:
    """``work()``, tokenizing at most ``n_chars`` characters through the fallback: on this thread
    when short, else on a thread with a stack deep enough, which this one waits for."""
    if n_chars <= ON_CALLER_MAX_CHARS:
        return work()
    if n_chars > MAX_CHARS:
        raise TokenizeError(
            f"text of {n_chars} characters is too long to tokenize with this model's "
            f"pre-tokenizer (at most {MAX_CHARS}): llama.cpp's regex splitter for it would "
            "overflow the stack"
        )
    outcome: list[T] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            outcome.append(work())
        except BaseException as error:  # re-raised on the caller's thread
            failure.append(error)

    # ``work`` holds its vocabulary in flight itself: a Ctrl-C that ends this wait early
    # leaves the thread's call running, and closing the model waits for it.
    _start_with_stack(target).join()
    if failure:
        raise failure[0]
    return outcome[0]


def _start_with_stack(target: Callable[[], None]) -> threading.Thread:
    with _stack_size_lock:
        previous = threading.stack_size(TOKENIZER_STACK_BYTES)
        try:
            worker = threading.Thread(target=target, name="llamacrab-tokenize", daemon=True)
            try:
                worker.start()
            except RuntimeError as error:
                raise TokenizeError(
                    f"could not start a tokenizer thread with a {TOKENIZER_STACK_BYTES >> 20} MiB "
                    f"stack: {error}"
                ) from error
        finally:
            threading.stack_size(previous)
    return worker
