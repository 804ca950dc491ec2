"""DRY's sequence breakers processed from an index of the vocabulary (dry_breakers) are the ones
llama_sampler_init_dry makes by walking it: the same (head, tail) pairs, in the same order, as a
loop-by-loop port of its get_overlapping_token_sequences, each once where llama.cpp repeats some;
and llama.cpp's own sampler (the repeats in it) and ours penalize as the port says, every token
as a breaker on its own or not, and each pair."""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llamacrab import Model, ModelParams, NativeError
from llamacrab._native import dry_sampler
from llamacrab._native.call import call, call_helper, ffi, lib
from llamacrab._native.dry_breakers import ProcessedBreakers, processed_breakers, token_texts

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "llamacrab-sys") not in sys.path:
    sys.path.insert(0, str(REPO / "llamacrab-sys"))  # build_tools: where the pinned source is

BREAKERS = [b.encode() for b in (
    "\n", ":", '"', "*",  # llama.cpp's defaults
    "é", "日本語", "🙂 ok", "é" * 20,  # multi-byte: prefixes end inside a character
    " the", "ing", "Hello", "<s>",  # whole tokens of some vocabularies (a control token's text)
    "  ", "\n\n", " \n\t",  # spaces and newlines (" " would make most BPE tokens breakers)
    "th", " t", "in",  # prefixes of common tokens
    "s and then some more words to fill it up",  # 40 bytes: many tokens end with its prefixes
    "a" * 40,  # its rests cut to 20 tokens: different rests, the same tails
    "=<s><bos>[CLS]<|endoftext|>",  # rests that hold special tokens' texts, read as text
    "ing", "a" * 41,  # again (llama.cpp adds its pairs again), and the same once cut to 40
    "",  # empty (skipped)
)] + [
    # Not UTF-8, which our API never makes, but llama.cpp reads bytes: cut inside a character.
    "é".encode()[:1], "日本".encode()[:5], b"ok\xf0\x9f",
]  # fmt: skip

# The settings of the samplers compared: a repeat of k tokens costs 2 ** (k - 1), exactly.
MULTIPLIER, BASE, ALLOWED_LENGTH = 1.0, 2.0, 1

Pairs = list[tuple[int, tuple[int, ...]]]


def vocab_file(name: str) -> Path:
    from build_tools.source import resolve_source

    return Path(resolve_source().path) / "models" / f"ggml-vocab-{name}.gguf"


def token_text(vocab: Any, token: int) -> bytes:
    """``vocab.detokenize({token}, true)`` as get_overlapping_token_sequences calls it."""
    size = 64
    while True:
        buf = ffi.new("char[]", size)
        n = call("llama_detokenize", vocab, ffi.new("llama_token[]", [token]), 1, buf, size,
                 False, True)  # fmt: skip
        if n >= 0:
            return ffi.buffer(buf, n)[:]
        size = -n


def ported(model: Model, breakers: Sequence[bytes]) -> Pairs:
    """llama.cpp's get_overlapping_token_sequences, loop by loop, called as
    llama_sampler_init_dry does: the (head, tail) pairs in the order they are inserted."""
    with model.vocab.in_flight() as vocab:
        words = [token_text(vocab, token) for token in range(model.vocab.n_tokens)]
    tokenized: dict[bytes, tuple[int, ...]] = {}
    inserted: Pairs = []
    tails_of: dict[int, list[tuple[int, ...]]] = {}
    for breaker in breakers:
        if not breaker:
            continue
        breaker = breaker[:40]
        for token, word in enumerate(words):
            tails = tails_of.setdefault(token, [])
            if breaker in word:
                inserted.append((token, ()))
                tails.append(())
                continue
            pos = word.find(breaker[:1])
            while pos != -1:
                i, match = 1, True
                while i < len(breaker) and i + pos < len(word):
                    if word[pos + i] != breaker[i]:
                        match = False
                        break
                    i += 1
                if match:
                    rest = breaker[i:]
                    if rest not in tokenized:
                        tokens = model.vocab.tokenize(rest, add_special=False, parse_special=False)
                        tokenized[rest] = tuple(tokens[:20])
                    if tokenized[rest] not in tails:  # a duplicate tail is left out
                        inserted.append((token, tokenized[rest]))
                        tails.append(tokenized[rest])
                pos = word.find(breaker[:1], pos + 1)
    return inserted


def processed(model: Model, breakers: Sequence[bytes]) -> ProcessedBreakers:
    return processed_breakers(token_texts(model), model.vocab, breakers)


def pairs(done: ProcessedBreakers) -> Pairs:
    ends = np.cumsum(done.tail_lengths).tolist()
    lengths = done.tail_lengths.tolist()
    return [(head, tuple(done.tails[ends[i] - lengths[i] : ends[i]].tolist()))
            for i, head in enumerate(done.heads.tolist())]  # fmt: skip


@dataclass
class Vocabulary:
    model: Model
    ported: Pairs  # of BREAKERS


@pytest.fixture(scope="module", params=["tiny", "gpt-2", "llama-spm", "bert-bge"])
def small_vocab(request: pytest.FixtureRequest, tiny_model_path: Path) -> Iterator[Vocabulary]:
    """Vocabularies of each kind: SentencePiece (the generated one, llama's), GPT-2's byte-level
    BPE and BERT's WordPiece."""
    path = tiny_model_path if request.param == "tiny" else vocab_file(request.param)
    with Model.load(path, ModelParams(vocab_only=True)) as model:
        yield Vocabulary(model, ported(model, BREAKERS))


@pytest.fixture(scope="module")
def gemma_vocab(gemma_path: Path) -> Iterator[Vocabulary]:
    with Model.load(gemma_path, ModelParams(vocab_only=True)) as model:
        yield Vocabulary(model, ported(model, BREAKERS))


def check_same_pairs(vocab: Vocabulary) -> None:
    model = vocab.model
    assert pairs(processed(model, BREAKERS)) == list(dict.fromkeys(vocab.ported))
    assert {bool(tail) for _, tail in vocab.ported} == {True, False}


def test_the_pairs_are_llama_cpps_in_its_order(small_vocab: Vocabulary) -> None:
    check_same_pairs(small_vocab)


def test_the_pairs_are_llama_cpps_in_its_order_on_gemma(gemma_vocab: Vocabulary) -> None:
    check_same_pairs(gemma_vocab)
    # llama.cpp repeats pairs (of the same breaker twice, of a token with two in it), which
    # ours leaves out: the samplers compared below hold different counts of them.
    assert len(set(gemma_vocab.ported)) < len(gemma_vocab.ported)


class Sampler:
    """A native DRY sampler fed histories and candidates directly."""

    def __init__(self, pointer: Any) -> None:
        self.pointer = pointer

    def penalized(self, history: Sequence[int], candidates: Sequence[int]) -> np.ndarray:
        """The logits of ``candidates`` (all 0 before) after ``history``."""
        lib.llama_sampler_reset(self.pointer)
        for token in history:
            lib.llama_sampler_accept(self.pointer, int(token))
        data = np.zeros(len(candidates), dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
        data["id"] = candidates
        array = ffi.new("llama_token_data_array *", {
            "data": ffi.cast("llama_token_data *", ffi.from_buffer(data)),
            "size": len(data), "selected": -1, "sorted": False,
        })  # fmt: skip
        lib.llama_sampler_apply(self.pointer, array)
        return data["logit"].copy()


@pytest.fixture
def samplers(request: pytest.FixtureRequest) -> Iterator[tuple[Vocabulary, Sampler, Sampler]]:
    """The vocabulary the test takes, and DRY samplers of BREAKERS (more than a request may
    have) with a window as long as the longest history: llama_sampler_init_dry's own, ours."""
    vocab: Vocabulary = request.getfixturevalue(request.param)
    settings = (MULTIPLIER, BASE, ALLOWED_LENGTH, 2 * vocab.model.vocab.n_tokens + 8)
    theirs = dry_sampler.walked(vocab.model, BREAKERS, *settings)
    ours = dry_sampler.from_tokens(vocab.model, processed(vocab.model, BREAKERS), *settings)
    try:
        yield vocab, Sampler(theirs), Sampler(ours)
    finally:
        lib.llama_sampler_free(theirs)
        lib.llama_sampler_free(ours)


def outsiders(listed: Pairs, n_tokens: int, count: int) -> list[int]:
    """Tokens in no pair, as head or in a tail."""
    used = {head for head, _ in listed} | {token for _, tail in listed for token in tail}
    found = [t for t in range(n_tokens) if t not in used][:count]
    assert len(found) == count
    return found


def check_whole_token_breakers(vocab: Vocabulary, theirs: Sampler, ours: Sampler) -> None:
    """Each token c follows A in "A c1 A c2 ... A ck A Y A": choosing it repeats "A c" and
    costs 1, unless c is a breaker on its own (a head with an empty tail) — for every token."""
    n_tokens = vocab.model.vocab.n_tokens
    whole = {head for head, tail in vocab.ported if not tail}
    a, y = outsiders(vocab.ported, n_tokens, 2)
    probed = [t for t in range(n_tokens) if t not in (a, y)]
    for start in range(0, len(probed), 50_000):
        chunk = probed[start : start + 50_000]
        history = [token for c in chunk for token in (a, c)] + [a, y, a]
        candidates = [*chunk, y]
        expected = np.array([0.0 if c in whole else -1.0 for c in candidates], dtype=np.float32)
        np.testing.assert_array_equal(theirs.penalized(history, candidates), expected)
        np.testing.assert_array_equal(ours.penalized(history, candidates), expected)


def last_breaker(by_head: dict[int, list[tuple[int, ...]]], history: list[int]) -> tuple[int, int]:
    """Step 1 of llama_sampler_dry_apply: (how far from the end the last breaker's head is, the
    length of its tail); (len(history), 0) where none is."""
    n = len(history)
    for back in range(n):
        longest = -1
        for tail in by_head.get(history[n - 1 - back], []):
            follows = tuple(history[n - back : n - back + len(tail)])
            if longest < len(tail) <= back and follows == tail:
                longest = len(tail)
        if longest >= 0:
            return back, longest
    return n, 0


def check_tails(vocab: Vocabulary, theirs: Sampler, ours: Sampler) -> None:
    """For (a sample of) each head h and tail t: in "W h t A Y W h t A Y", the breaker h t
    ends 2 tokens from the end, so choosing W (which repeats all 2 + len(t) + 3 tokens) costs
    as a repeat of 2: only if the sampler has h t, and no longer breaker from h. Not where a
    breaker inside t ends later (a token of t that is one on its own, say): then that one is
    the last, here as in any history where h t is, and h t never counts."""
    by_head: dict[int, list[tuple[int, ...]]] = {}
    for head, tail in vocab.ported:
        by_head.setdefault(head, []).append(tail)
    w, a, y = outsiders(vocab.ported, vocab.model.vocab.n_tokens, 3)
    with_tails = [pair for pair in vocab.ported if pair[1]]
    histories, looked = [], 0
    for i in np.random.default_rng(0).permutation(len(with_tails)):
        head, tail = with_tails[i]
        history = [w, head, *tail, a, y] * 2
        looked += 1
        if last_breaker(by_head, history) == (len(tail) + 2, len(tail)):
            histories.append(history)
            if len(histories) == 3000:
                break
    assert len(histories) > looked / 4
    for history in histories:
        candidates = sorted(set(history))
        penalized = theirs.penalized(history, candidates)
        np.testing.assert_array_equal(ours.penalized(history, candidates), penalized)
        assert penalized[candidates.index(w)] == -2.0


def check_random_histories(vocab: Vocabulary, theirs: Sampler, ours: Sampler) -> None:
    """Repeats around the pairs' tokens and others, 300 of them."""
    rng = np.random.default_rng(1)
    listed = [token for head, tail in vocab.ported for token in (head, *tail)]
    pool = np.unique(listed + rng.integers(0, vocab.model.vocab.n_tokens, 200).tolist())
    for _ in range(300):
        block = rng.choice(pool, rng.integers(3, 12)).tolist()
        history = (rng.choice(pool, rng.integers(0, 30)).tolist() + block
                   + rng.choice(pool, rng.integers(0, 5)).tolist()
                   + block[: rng.integers(2, len(block))])  # fmt: skip
        candidates = sorted(set(history) | set(rng.choice(pool, 50).tolist()))
        np.testing.assert_array_equal(
            ours.penalized(history, candidates), theirs.penalized(history, candidates)
        )


def check_same_penalties(vocab: Vocabulary, theirs: Sampler, ours: Sampler) -> None:
    check_whole_token_breakers(vocab, theirs, ours)
    check_tails(vocab, theirs, ours)
    check_random_histories(vocab, theirs, ours)


@pytest.mark.parametrize("samplers", ["small_vocab"], indirect=True)
def test_both_samplers_penalize_as_llama_cpp_processes_breakers(
    small_vocab: Vocabulary, samplers: tuple[Vocabulary, Sampler, Sampler]
) -> None:
    check_same_penalties(*samplers)


@pytest.mark.parametrize("samplers", ["gemma_vocab"], indirect=True)
def test_both_samplers_penalize_as_llama_cpp_processes_breakers_on_gemma(
    gemma_vocab: Vocabulary, samplers: tuple[Vocabulary, Sampler, Sampler]
) -> None:
    check_same_penalties(*samplers)


def test_where_llama_cpp_exports_it_the_breakers_are_processed_here() -> None:
    # Windows DLLs export only llama.h's functions (no llama_sampler_init_dry_testing).
    assert dry_sampler.FROM_TOKENS is (sys.platform != "win32")


SETTINGS = {
    "enabled": (0.8, 1.75, 64),
    "no multiplier": (0.0, 1.75, 64),
    "base below 1": (0.8, 0.5, 64),
    "no window": (0.8, 1.75, 0),
    "negative window": (0.8, 1.75, -5),
    "base 1 as a float": (0.8, 1 - 1e-9, 64),
    "multiplier 0 as a float": (1e-50, 1.75, 64),
}


@pytest.mark.parametrize(("multiplier", "base", "window"), SETTINGS.values(), ids=SETTINGS)
def test_settings_that_disable_dry_make_llama_cpps_sampler(
    tiny_model_path: Path, multiplier: float, base: float, window: int
) -> None:
    # Disabled, llama.cpp's sampler that does nothing ("?dry", no DRY state for a breaker to
    # go to; as llama.cpp decides, in floats); else its DRY sampler, with breakers or none.
    with Model.load(tiny_model_path, ModelParams(vocab_only=True)) as model:
        for breakers in ([b"\n", b"the"], []):
            settings = (multiplier, base, 1, window)
            theirs = dry_sampler.walked(model, breakers, *settings)
            ours = dry_sampler.from_tokens(model, processed(model, breakers), *settings)
            try:
                names = [ffi.string(lib.llama_sampler_name(s)) for s in (theirs, ours)]
                assert names[0] == names[1]
                history = model.vocab.tokenize(" the cat sat on the mat\n the cat sat on the")
                candidates = list(range(model.vocab.n_tokens))
                np.testing.assert_array_equal(
                    Sampler(theirs).penalized(history, candidates),
                    Sampler(ours).penalized(history, candidates),
                )
            finally:
                lib.llama_sampler_free(theirs)
                lib.llama_sampler_free(ours)


def test_the_shim_refuses_a_negative_tail_length(tiny_model_path: Path) -> None:
    with Model.load(tiny_model_path, ModelParams(vocab_only=True)) as model:
        heads, lengths = ffi.new("llama_token[]", [5]), ffi.new("int32_t[]", [-1])
        with pytest.raises(NativeError, match="tail length is negative"):
            call_helper("llamacrab_dry_from_tokens", model.vocab.pointer, 1.0, 2.0, 1, 64,
                        heads, lengths, 1, ffi.NULL)  # fmt: skip


def test_the_index_is_built_once_per_model_and_freed_with_it(tiny_model_path: Path) -> None:
    model = Model.load(tiny_model_path, ModelParams(vocab_only=True))
    texts = token_texts(model)
    assert token_texts(model) is texts
    assert [model.vocab.token_to_bytes(t) for t in texts.containing(b"cat")] == [b" cat"]
    index = weakref.ref(texts)
    model.close()
    del model, texts
    gc.collect()
    assert index() is None
