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

REPO = Path(__file__).resolve().parents[1]
PIN = json.loads((REPO / "llamacrab-sys/pin.json").read_text())["llama_cpp_commit"]
# The pinned llama.cpp tree scripts/setup.sh unpacks holds llama.cpp's vocabulary-only test files.
CACHE = Path(os.environ.get("LLAMACRAB_CACHE_DIR", "~/.cache/llamacrab")).expanduser()
VOCABS = CACHE / "src" / PIN / "models"

CHILD = """
    import json, sys
    from llamacrab import Model, ModelParams, TokenizeError
    path, char, max_chars = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with Model.load(path, ModelParams(vocab_only=True)) as model:
        tokenize = lambda n: model.vocab.tokenize(char * n, add_special=False)
        short, long = tokenize(1200), tokenize(60_000)
        try:
            tokenize(max_chars + 1)
            refusal = None
        except TokenizeError as error:
            refusal = str(error)
    print(json.dumps({"short": short, "long": long, "refusal": refusal}))
"""


@pytest.mark.parametrize(
    ("vocab", "char"),
    [("deepseek-llm", "a"), ("deepseek-llm", "中"), ("deepseek-coder", "!"), ("falcon", "!"),
     ("gpt-neox", "1"), ("aquila", "1")],
)  # fmt: skip
def test_a_long_run_tokenizes_and_a_longer_one_is_refused(vocab: str, char: str) -> None:
    path = VOCABS / f"ggml-vocab-{vocab}.gguf"
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), str(path), char, str(MAX_CHARS)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "GGML_NO_BACKTRACE": "1"},
    )  # fmt: skip
    assert child.returncode == 0, f"exit {child.returncode}\n{child.stderr[-3000:]}"
    result = json.loads(child.stdout)
    # 1,200 divides into the runs these vocabularies cut (16 marks, 8 letters, 3 digits...)
    assert result["long"] == result["short"] * 50
    assert result["refusal"] is not None
    assert f"at most {MAX_CHARS}" in result["refusal"]
