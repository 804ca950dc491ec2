"""Vocabularies llama.cpp cannot load safely are refused before it sees them, by name.

A token longer than MAX_TRIE_TOKEN_BYTES in an RWKV or t5 (UGM) vocabulary: llama.cpp's naive_trie
recurses once per byte of it, and the load died of a stack overflow (SIGSEGV). A plamo2 vocabulary
past gguf.plamo2's bounds: llama.cpp's table building is cubic in a token's length, and one
5,000-byte token kept the load in one native call for more than 120 s. A byte token not
spelt <0xXX>, or a t5 vocabulary of fewer than 3 tokens: llama.cpp threw std::out_of_range and the
error said ``basic_string::substr: __pos (which is 3) > this->size() (which is 2)`` or
``vector::_M_range_check``. Loads that could crash run in a child process, on a thread with a
256 KiB stack (an 8 MiB main thread, or an unlimited one, would need ~50,000 bytes to die).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from test_tokenize_regex_stack import VOCABS

from llamacrab import InvalidModelError, Llama, TokenizeError
from llamacrab._native.gguf import plamo2
from llamacrab._native.gguf.check import validate_gguf
from llamacrab._native.gguf.vocab_check import MAX_TRIE_TOKEN_BYTES
from llamacrab._native.gguf_reader import read_file

from support import load_repo_module

tiny = load_repo_module("scripts/make_tiny_gguf.py")

NORMAL, CONTROL, USER_DEFINED, BYTE = (int(t) for t in (
    gguf.TokenType.NORMAL, gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED,
    gguf.TokenType.BYTE))  # fmt: skip
STACK_KIB = 256


def vocabulary_model(
    path: Path,
    model: str,
    replace: dict[int, tuple[str | bytes, int]] | None = None,
    tokens: list[str] | None = None,
) -> Path:
    """The tiny model with tokenizer ``model`` ("rwkv": the vocabulary with bytes escaped as
    its tokenizer reads them), token i replaced by (text, type) for each entry of ``replace``,
    or with ``tokens`` (all normal) as the whole vocabulary."""
    texts, scores, types = tiny.vocabulary(no_end_tokens=model == "rwkv")
    if tokens is not None:
        texts, scores, types = tokens, [0.0] * len(tokens), [NORMAL] * len(tokens)
    for i, (text, kind) in (replace or {}).items():
        texts[i], types[i] = text, kind
    writer = gguf.GGUFWriter(str(path), "llama")
    tiny._metadata(writer, tiny.N_LAYER, 1e-5)  # then the vocabulary written over its own
    writer.add_key_value("tokenizer.ggml.model", model, gguf.GGUFValueType.STRING)
    writer.add_array("tokenizer.ggml.tokens", texts)
    writer.add_array("tokenizer.ggml.scores", scores)
    writer.add_key_value("tokenizer.ggml.token_type", types, gguf.GGUFValueType.ARRAY,
                         sub_type=gguf.GGUFValueType.INT32)  # fmt: skip
    if tokens is not None:
        for name in ("unk", "bos", "eos"):
            writer.add_key_value(f"tokenizer.ggml.{name}_token_id", 0, gguf.GGUFValueType.UINT32)
    if model == "gpt2":
        writer.add_array("tokenizer.ggml.merges", ["▁ t"])
    tiny.write_gguf(writer, tiny._tensors(0, len(texts)))
    return path


# Loads the model and tokenizes the long token's text on a thread with a STACK_KIB stack;
# "unchecked" skips validate_gguf (the header is read, nothing checked).
CHILD = textwrap.dedent(f"""
    import json, sys, threading
    import llamacrab._native.model
    from llamacrab import Llama, LlamaError
    from llamacrab._native.gguf_reader import read_file
    path, mode, text = sys.argv[1:]
    if mode == "unchecked":
        llamacrab._native.model.validate_gguf = lambda path, **kwargs: read_file(path)[:2]
    outcome = []
    def load():
        try:
            with Llama(path, n_ctx=64, n_threads=1) as llm:
                outcome.append(["loaded", llm.tokenize(text, add_special=False)])
        except LlamaError as error:
            outcome.append([type(error).__name__, str(error)])
    threading.stack_size({STACK_KIB} * 1024)
    thread = threading.Thread(target=load)
    thread.start()
    thread.join()
    print(json.dumps(outcome[0]))
""")


def load_in_child(
    path: Path, mode: str, text: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(path), mode, text], capture_output=True, text=True,
        timeout=timeout, env={**os.environ, "GGML_NO_BACKTRACE": "1"},
    )  # fmt: skip


LAST = len(tiny.vocabulary()[0]) - 1  # "." (a word: no byte token, no special token)


@pytest.mark.parametrize(
    ("model", "kind"),
    [("rwkv", NORMAL), ("t5", NORMAL), ("t5", USER_DEFINED)],
    ids=["rwkv", "t5-normal", "t5-user-defined"],
)
def test_a_long_trie_token_is_refused_where_the_load_overflowed_the_stack(
    tmp_path: Path, model: str, kind: int
) -> None:
    length = 8_000  # ~1.4 MB of stack
    path = vocabulary_model(tmp_path / "long.gguf", model, {LAST: ("a" * length, kind)})
    checked = load_in_child(path, "checked", "a")
    assert checked.returncode == 0, checked.stderr[-2000:]
    error, message = json.loads(checked.stdout)
    assert error == "InvalidModelError", message
    assert f"token {LAST} of the {model} vocabulary is {length} bytes long" in message
    assert f"at most {MAX_TRIE_TOKEN_BYTES}" in message
    unchecked = load_in_child(path, "unchecked", "a")
    assert unchecked.returncode == -signal.SIGSEGV, (
        f"llama.cpp no longer overflows the stack on a {length}-byte {model} token (exit "
        f"{unchecked.returncode}): re-audit naive_trie in src/llama-vocab.cpp\n"
        f"{unchecked.stdout}{unchecked.stderr[-2000:]}"
    )


@pytest.mark.parametrize(
    ("model", "kind"), [("rwkv", NORMAL), ("t5", USER_DEFINED)], ids=["rwkv", "t5-user-defined"]
)
def test_a_token_at_the_bound_loads_and_matches_on_a_small_stack(
    tmp_path: Path, model: str, kind: int
) -> None:
    text = "a" * MAX_TRIE_TOKEN_BYTES
    path = vocabulary_model(tmp_path / "bound.gguf", model, {LAST: (text, kind)})
    checked = load_in_child(path, "checked", text)
    assert checked.returncode == 0, checked.stderr[-2000:]
    outcome, tokens = json.loads(checked.stdout)
    assert outcome == "loaded" and LAST in tokens, (outcome, tokens)  # matched whole


def test_the_bound_counts_the_bytes_the_trie_holds(tmp_path: Path) -> None:
    """RWKV's escapes count unescaped, a t5 control token is not in the trie, and a BPE
    vocabulary (no trie: GPT-NeoX has tokens of 1,024 bytes) is not bounded."""
    at_bound = "\\x61" * MAX_TRIE_TOKEN_BYTES  # 4 bytes stored, 1 in the trie
    validate_gguf(vocabulary_model(tmp_path / "escaped.gguf", "rwkv", {LAST: (at_bound, NORMAL)}))
    over = vocabulary_model(tmp_path / "over.gguf", "rwkv", {LAST: (at_bound + "a", NORMAL)})
    with pytest.raises(InvalidModelError, match=f"is {MAX_TRIE_TOKEN_BYTES + 1} bytes long"):
        validate_gguf(over)
    long = "a" * 8_000
    validate_gguf(vocabulary_model(tmp_path / "control.gguf", "t5", {LAST: (long, CONTROL)}))
    validate_gguf(vocabulary_model(tmp_path / "bpe.gguf", "gpt2", {LAST: (long, NORMAL)}))


def test_a_plamo2_token_long_enough_to_hang_the_load_is_refused(tmp_path: Path) -> None:
    """Before: llama.cpp built its table for this token for more than 120 s (775 MB), in one
    native call; the child's timeout fails the test there."""
    path = vocabulary_model(tmp_path / "long.gguf", "plamo2", {LAST: ("a" * 5_000, NORMAL)})
    checked = load_in_child(path, "checked", "a", timeout=60)
    assert checked.returncode == 0, checked.stderr[-2000:]
    error, message = json.loads(checked.stdout)
    assert error == "InvalidModelError", message
    assert f"token {LAST} alone (5,000 characters) counts 125,000,000,000" in message
    assert f"at most {plamo2.MAX_COPIES:,}" in message


def test_a_plamo2_token_under_the_bound_loads_and_matches(tmp_path: Path) -> None:
    text = "a" * 600  # 600³ = 216M of the 268M byte copies
    with Llama(vocabulary_model(tmp_path / "600.gguf", "plamo2", {LAST: (text, NORMAL)}),
               n_ctx=64, n_threads=1) as llm:  # fmt: skip
        assert llm.tokenize(text, add_special=False) == [LAST]


@pytest.mark.parametrize(
    ("text", "fits"),
    [("a" * 645, True), ("a" * 646, False), ("あ" * 447, True), ("あ" * 448, False),
     (b"\xff" * 447, True), (b"\xff" * 448, False), ("b\0" + "a" * 5_000, True)],
    ids=["ascii", "ascii+1", "japanese", "japanese+1", "invalid", "invalid+1", "cut-at-nul"],
)  # fmt: skip
def test_the_plamo2_bound_counts_characters_as_llama_cpp_decodes_them(
    tmp_path: Path, text: str | bytes, fits: bool
) -> None:
    """Characters² times bytes: "あ" is 1 character of 3 bytes, an invalid byte 1 character that
    llama.cpp re-encodes as U+FFFD's 3; a token ends at its first NUL (llama.cpp reads C
    strings). The tiny vocabulary's other tokens count 1,381."""
    path = vocabulary_model(tmp_path / "v.gguf", "plamo2", {LAST: (text, NORMAL)})
    if fits:
        validate_gguf(path)
    else:
        named = f"token {LAST} alone \\((448|646) characters\\)"
        with pytest.raises(InvalidModelError, match=named):
            validate_gguf(path)


def test_plamo2_byte_tokens_are_not_counted(tmp_path: Path) -> None:
    """llama.cpp's table leaves out byte tokens (type 6)."""
    validate_gguf(vocabulary_model(tmp_path / "b.gguf", "plamo2", {LAST: ("a" * 5_000, BYTE)}))


def strings(tokens: list[bytes]) -> tuple[bytes, np.ndarray]:
    """``tokens`` as a GGUF string array's region and where each starts (StringTable's)."""
    region, starts = bytearray(), []
    for token in tokens:
        region += len(token).to_bytes(8, "little")
        starts.append(len(region))
        region += token
    return bytes(region), np.array(starts, dtype=np.uint64)


def test_many_plamo2_tokens_are_bounded_by_their_lookups() -> None:
    """Short tokens cost llama.cpp a lookup per prefix of each suffix, a cache miss each once
    the table is big (233,000 8-byte tokens, under the bound, took 10 s to load here)."""
    under = [f"{i:012d}".encode() for i in range(100_000)]  # 7.8M lookups, 173M byte copies
    assert plamo2.table_problem(*strings(under), None) is None
    problem = plamo2.table_problem(*strings(under + [f"x{i:011d}".encode()
                                                     for i in range(8_000)]), None)  # fmt: skip
    assert problem is not None and "would cost llama.cpp 8,424,000 table lookups" in problem
    assert f"at most {plamo2.MAX_LOOKUPS:,}" in problem


@pytest.mark.parametrize("vocab", ["llama-spm", "nomic-bert-moe", "gemma-4", "qwen2"])
def test_real_vocabularies_fit_the_plamo2_bounds(vocab: str) -> None:
    """No plamo2 vocabulary in the pinned tree: real ones of up to 262k tokens stand in
    (SentencePiece: Llama's, XLM-R's; Gemma 4's; Qwen 2's BPE, of 128-byte tokens). A
    PLaMo-2 one holds 100k."""
    _, metadata, _ = read_file(VOCABS / f"ggml-vocab-{vocab}.gguf")
    words = metadata["tokenizer.ggml.tokens"].strings
    assert plamo2.table_problem(words.region, words.starts, None) is None


BYTE_0A = 3 + 0x0A  # <0x0A>, after <unk>, <s> and </s>


@pytest.mark.parametrize("model", ["llama", "t5", "gpt2"])
@pytest.mark.parametrize("spelling", ["zz", "<0xZZ>", "0x0A", "<0x0A0>"])
def test_a_byte_token_not_spelt_0xXX_is_refused_by_name(
    tmp_path: Path, model: str, spelling: str
) -> None:
    """Before: "zz" failed with basic_string::substr's message, the others loaded and
    detokenized to a byte read from their 4th and 5th characters."""
    path = vocabulary_model(tmp_path / "byte.gguf", model, {BYTE_0A: (spelling, BYTE)})
    with pytest.raises(InvalidModelError) as caught:
        Llama(path, n_ctx=64, n_threads=1)
    message = str(caught.value)
    assert f"token {BYTE_0A} is a byte token" in message and repr(spelling) in message, message
    assert "<0xXX>" in message


def test_lowercase_byte_tokens_and_byte_types_elsewhere_still_load(tmp_path: Path) -> None:
    """strtol reads <0x0a> as llama.cpp's byte 10; RWKV and the test tokenizer never read a
    byte token's text."""
    path = vocabulary_model(tmp_path / "lower.gguf", "llama", {BYTE_0A: ("<0x0a>", BYTE)})
    with Llama(path, n_ctx=64, n_threads=1) as llm:
        assert llm.detokenize([BYTE_0A]) == "\n"
    validate_gguf(vocabulary_model(tmp_path / "rwkv.gguf", "rwkv", {LAST: ("zz", BYTE)}))


@pytest.mark.parametrize("tokens", [["a"], ["a", "b"]], ids=["1", "2"])
def test_a_t5_vocabulary_of_fewer_than_3_tokens_is_refused_by_name(
    tmp_path: Path, tokens: list[str]
) -> None:
    """Before: vector::_M_range_check (llama.cpp loads a t5 vocabulary with token 2 as the
    unknown token, before reading tokenizer.ggml.unknown_token_id)."""
    path = vocabulary_model(tmp_path / "small.gguf", "t5", tokens=tokens)
    with pytest.raises(InvalidModelError, match=f"t5 \\(UGM\\) vocabulary of {len(tokens)} "):
        Llama(path, n_ctx=64, n_threads=1)
    with Llama(vocabulary_model(tmp_path / "three.gguf", "t5", tokens=["a", "b", "c"]),
               n_ctx=64, n_threads=1) as llm:  # fmt: skip
        assert llm.vocab.n_tokens == 3


def test_llama_cpp_test_vocabularies_pass() -> None:
    """Every vocabulary-only file of the pinned llama.cpp tree (SPM, BPE with 1,024-byte tokens,
    WordPiece, XLM-R's t5, Gemma 4's BPE with <0xXX> byte tokens)."""
    paths = sorted(VOCABS.glob("ggml-vocab-*.gguf"))
    assert len(paths) >= 19, VOCABS
    for path in paths:
        validate_gguf(path)


DETOKENIZE_CHILD = """
    import sys
    from llamacrab import Llama, TokenizeError
    with Llama(sys.argv[1], n_ctx=64, n_threads=1) as llm:
        long = llm.vocab.n_tokens - 1
        try:
            llm.detokenize([long] * 3000)
            print("detokenized")
        except TokenizeError as error:
            print("refused:", error)
        print("after:", len(llm.detokenize([long, long])))
"""


def test_a_text_past_what_llama_cpp_s_detokenizer_counts_is_refused(tmp_path: Path) -> None:
    """3,000 tokens of a 1 MiB piece: llama.cpp adds the pieces' lengths up in an int32, which
    wrapped to -1.15 GB; it asked for that room again after each try (a loop allocating it)."""
    piece = "x" * 2**20
    path = tiny.write_tiny_llama(tmp_path / "long.gguf", extra_tokens=[(piece, NORMAL)])
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(DETOKENIZE_CHILD), str(path)],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    assert "refused: the text of these 3000 tokens would take 3145728000 bytes" in child.stdout
    assert f"after: {2 * len(piece)}" in child.stdout  # the Llama works on


def test_text_no_token_covers_is_refused_where_llama_cpp_gave_minus_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An RWKV vocabulary without an unknown token, none of whose tokens starts with byte 0xFF:
    llama.cpp's tokenizer stood -1 (LLAMA_TOKEN_NULL) for that byte, and tokenize returned it."""
    rwkv_vocabulary = tiny.vocabulary

    def without_ff(*args: Any, **kwargs: Any) -> tuple[list[str], list[float], list[int]]:
        texts, scores, types = rwkv_vocabulary(*args, **kwargs)
        if "\\xff" in texts:  # the RWKV spelling (its weights are sized by the other one)
            texts[texts.index("\\xff")] = "\\xfe\\xfe"
        return texts, scores, types

    monkeypatch.setattr(tiny, "vocabulary", without_ff)
    no_ff = tiny.write_tiny_llama(tmp_path / "no-ff.gguf", no_end_tokens=True)  # no unknown token
    with Llama(no_ff, n_ctx=64, n_threads=1) as llm:
        with pytest.raises(TokenizeError, match="no token of this vocabulary covers part of it"):
            llm.tokenize(b"a\xffb", add_special=False)
        assert min(llm.tokenize(b"a\xfeb", add_special=False)) >= 0
