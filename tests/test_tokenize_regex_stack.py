"""Long runs of one character class on vocabularies whose pre-tokenizer llama.cpp splits with
std::regex: its matcher recursed once per character and a 30,000-letter prompt overflowed the
stack (SIGSEGV). Each case runs in a child process, so a signal death fails the test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llamacrab._native.pretokenizer import MAX_CHARS

from support import load_repo_module

REPO = Path(__file__).resolve().parents[1]
PIN = json.loads((REPO / "llamacrab-sys/pin.json").read_text())["llama_cpp_commit"]
# The pinned llama.cpp tree scripts/setup.sh unpacks holds llama.cpp's vocabulary-only test files.
CACHE = Path(os.environ.get("LLAMACRAB_CACHE_DIR", "~/.cache/llamacrab")).expanduser()
VOCABS = CACHE / "src" / PIN / "models"


def run(code: str, *args: object) -> dict[str, object]:
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "GGML_NO_BACKTRACE": "1"},
    )  # fmt: skip
    assert child.returncode == 0, f"exit {child.returncode}\n{child.stderr[-3000:]}"
    result: dict[str, object] = json.loads(child.stdout)
    return result


# Each child prints the tokens of 1,200 and 60,000 characters and the refusal past the bound.
RUNS = """
    import json, sys
    from llamacrab import TokenizeError
    def print_runs(tokenize, max_chars):
        try:
            tokenize(max_chars + 1)
            refusal = None
        except TokenizeError as error:
            refusal = str(error)
        short, long = tokenize(1200), tokenize(60_000)
        print(json.dumps({"short": short, "long": long, "refusal": refusal}))
"""

CHILD = (
    RUNS
    + """
    from llamacrab import Model, ModelParams
    path, char, max_chars = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with Model.load(path, ModelParams(vocab_only=True)) as model:
        print_runs(lambda n: model.vocab.tokenize(char * n, add_special=False), max_chars)
"""
)


@pytest.mark.parametrize(
    ("vocab", "char"),
    [("deepseek-llm", "a"), ("deepseek-llm", "中"), ("deepseek-coder", "!"), ("falcon", "!"),
     ("gpt-neox", "1"), ("aquila", "1")],
)  # fmt: skip
def test_a_long_run_tokenizes_and_a_longer_one_is_refused(vocab: str, char: str) -> None:
    result = run(CHILD, VOCABS / f"ggml-vocab-{vocab}.gguf", char, MAX_CHARS)
    # 1,200 divides into the runs these vocabularies cut (16 marks, 8 letters, 3 digits...)
    assert result["long"] == result["short"] * 50  # type: ignore[operator]
    assert f"at most {MAX_CHARS}" in str(result["refusal"])


ONE_CHAR_CHILD = """
    import json, sys, threading
    from llamacrab import Model, ModelParams, TokenizeError
    path, char, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    result = {}
    def tokenize():
        with Model.load(path, ModelParams(vocab_only=True)) as model:
            result["guarded"] = model.vocab.regex_may_recurse
            result["short"] = model.vocab.tokenize(char * 1200, add_special=False)
            try:
                result["long"] = model.vocab.tokenize(char * n, add_special=False)
            except TokenizeError as error:
                result["long"] = str(error)
    threading.stack_size(8 << 20)  # a main thread's usual stack: 26,000 characters of recursion
    thread = threading.Thread(target=tokenize)
    thread.start()
    thread.join()
    print(json.dumps(result))
"""


@pytest.mark.parametrize(
    ("vocab", "char"), [("starcoder", "1"), ("command-r", "1"), ("refact", "1"), ("starcoder", "a")]
)  # fmt: skip
def test_a_one_character_regex_tokenizes_any_run_on_an_ordinary_stack(
    vocab: str, char: str
) -> None:
    # These pre-tokenizers' only std::regex is \p{N}, one digit per match, at a constant depth:
    # they were guarded, so a run past MAX_CHARS was refused, and took the 1 GiB-stack thread.
    n = 1200 * (MAX_CHARS // 1200 + 1)
    result = run(ONE_CHAR_CHILD, VOCABS / f"ggml-vocab-{vocab}.gguf", char, n)
    assert result["guarded"] is False
    assert result["long"] == result["short"] * (n // 1200)  # type: ignore[operator]


MEDIA_CHILD = (
    RUNS
    + """
    import numpy as np
    from llamacrab import Image, Llama
    text, vision, max_chars = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with Llama(text, n_ctx=512, n_threads=1, mmproj=vision, mmproj_probe=False) as llm:
        projector = llm.projector
        bitmap = projector.bitmap(Image(pixels=np.full((8, 8, 3), 128, np.uint8)))
        def text_tokens(n):
            chunks = projector.tokenize(projector.marker + "a" * n, [bitmap], add_special=False)
            try:
                return chunks.text_tokens()
            finally:
                chunks.close()
        print_runs(text_tokens, max_chars)
"""
)


@pytest.fixture
def text_and_vision(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny text model on the DeepSeek-LLM vocabulary and a vision projector for it."""
    text = load_repo_module("scripts/make_tiny_gguf.py").write_tiny_draft(
        tmp_path / "text.gguf", VOCABS / "ggml-vocab-deepseek-llm.gguf"
    )
    vision = load_repo_module("scripts/make_tiny_mmproj.py").write_tiny_vision_mmproj(
        tmp_path / "vision.gguf"
    )
    return text, vision


def test_libmtmd_tokenizes_a_long_run_beside_an_image_too(
    text_and_vision: tuple[Path, Path],
) -> None:
    # libmtmd tokenizes a multimodal prompt's text with the same llama.cpp tokenizer.
    result = run(MEDIA_CHILD, *text_and_vision, MAX_CHARS)
    assert result["long"] == result["short"] * 50  # type: ignore[operator]
    assert f"at most {MAX_CHARS}" in str(result["refusal"])


GRAMMAR_CHILD = """
    import json, sys
    from llamacrab import GrammarError, Model, ModelParams
    from llamacrab._native.gbnf.bounds import check_grammar
    from llamacrab._native.grammar_sampler import grammar_sampler
    with Model.load(sys.argv[1], ModelParams(vocab_only=True)) as model:
        grammar = "root ::= <" + "a" * 60_000 + ">"
        try:
            check_grammar(grammar)
            grammar_sampler(model.vocab, grammar, "root", [])
            refusal = None
        except GrammarError as error:
            refusal = str(error)
    print(json.dumps({"refusal": refusal}))
"""


def test_a_long_token_reference_in_a_grammar_is_refused() -> None:
    # llama.cpp's grammar parser tokenizes each <piece> with the vocabulary, on the caller's
    # thread: 60,000 letters were a SIGSEGV.
    result = run(GRAMMAR_CHILD, VOCABS / "ggml-vocab-deepseek-llm.gguf")
    assert "the token reference <aaaa" in str(result["refusal"])
    assert "is 60000 characters; the limit is 256" in str(result["refusal"])


INTERRUPTED_CHILD = """
    import gc, json, sys
    import numpy as np
    from llamacrab import Image, Llama
    from llamacrab._native import mtmd
    from llamacrab._native.call import ffi
    text, vision = sys.argv[1], sys.argv[2]
    with Llama(text, n_ctx=512, n_threads=1, mmproj=vision, mmproj_probe=False) as llm:
        projector = llm.projector
        bitmap = projector.bitmap(Image(pixels=np.full((8, 8, 3), 128, np.uint8)))
        prompt = projector.marker + "a" * 200_000
        expected = projector.tokenize(prompt, [bitmap], add_special=False).text_tokens()
        left_running, run_bounded = [], mtmd.run_bounded
        def interrupted(_, work):  # a Ctrl-C ends the wait while the thread reads on
            left_running.append(work)
            raise KeyboardInterrupt
        mtmd.run_bounded = interrupted
        try:
            projector.tokenize(prompt, [bitmap], add_special=False)
        except KeyboardInterrupt:
            pass
        gc.collect()
        reused = [ffi.new("char[]", b"b" * len(prompt)) for _ in range(8)]
        # the thread, after the caller's frame is gone
        status = run_bounded(prompt, left_running[0])
        tokens = left_running[0].args[0].text_tokens()
    print(json.dumps({"status": status, "same": tokens == expected}))
"""


def test_a_multimodal_tokenization_left_running_by_ctrl_c_reads_its_own_text(
    text_and_vision: tuple[Path, Path],
) -> None:
    # The prompt's C copy was held by the caller's frame only: unwound by a Ctrl-C, it was
    # freed while the big-stack thread still read it.
    assert run(INTERRUPTED_CHILD, *text_and_vision) == {"status": 0, "same": True}


PROSE_CHILD = """
    import json, sys
    from llamacrab import Model, ModelParams
    path, max_chars = sys.argv[1], int(sys.argv[2])
    prose = "a few short words,\\nand lines. " * (max_chars // 30 + 1)
    with Model.load(path, ModelParams(vocab_only=True)) as model:
        tokens = model.vocab.tokenize(prose, add_special=False)
    print(json.dumps({"chars": len(prose), "tokens": len(tokens)}))
"""


def test_long_prose_past_the_bound_tokenizes() -> None:
    # Only one match's length bounds the recursion: a book past MAX_CHARS was refused.
    result = run(PROSE_CHILD, VOCABS / "ggml-vocab-deepseek-llm.gguf", MAX_CHARS)
    assert result["chars"] > MAX_CHARS  # type: ignore[operator]
    assert result["tokens"] > MAX_CHARS // 5  # type: ignore[operator]
