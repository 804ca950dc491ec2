"""llama.cpp's grammar sampler: made from GBNF, called with its errors translated, and asked
where its text may end when the vocabulary has no end-of-generation token to end it with."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from llamacrab._exceptions import GrammarError, NativeError
from llamacrab._native.call import c_string, call, call_bounded, ffi, lib
from llamacrab._native.custom_sampler import TOKEN_DATA
from llamacrab._native.logging import log_lines
from llamacrab._native.signals import held_signals
from llamacrab._native.vocab import Vocab

T = TypeVar("T")

LLAMA_TOKEN_NULL = -1

_REGEX_SPECIAL = re.compile(r"[\\^$.|?*+()\[\]{}]")


def grammar_sampler(vocab: Vocab, grammar: str, root: str, trigger_words: Sequence[str]) -> Any:
    """A new grammar sampler, for the caller to hand to a chain or free; lazy (waiting for
    one of ``trigger_words``) when there are any."""
    grammar_text = c_string(grammar, "grammar")
    root_name = c_string(root, "grammar_root")
    log_lines.take_errors()
    if trigger_words:
        # llama.cpp takes regular expressions: a trigger word must match only itself.
        patterns = [_REGEX_SPECIAL.sub(r"\\\g<0>", w) for w in trigger_words]
        words = [ffi.new("char[]", c_string(p, "trigger word")) for p in patterns]
        c_words = ffi.new("const char *[]", words)
        sampler = call("llama_sampler_init_grammar_lazy_patterns", vocab.pointer, grammar_text,
                       root_name, c_words, len(words), ffi.NULL, 0)  # fmt: skip
    else:
        sampler = call("llama_sampler_init_grammar", vocab.pointer, grammar_text, root_name)
    if sampler == ffi.NULL:
        reason = log_lines.take_errors() or "see the llamacrab logger"
        raise GrammarError(f"invalid grammar: {reason}")
    return sampler


class GrammarDeadEnd(GrammarError):
    """The grammar allows no token the chain could pick."""


class GrammarComplete(GrammarDeadEnd):
    """The grammar's text is complete and nothing may follow it, on a vocabulary without an
    end-of-generation token, or with every one banned (``end_banned``): one would be the only
    pick. A generation ends here, as it does at an end token."""

    def __init__(self, end_banned: bool) -> None:
        super().__init__(COMPLETE_END_BANNED if end_banned else COMPLETE)
        self.end_banned = end_banned


# What llama.cpp throws when a token accepted ends every parse: sampled, the grammar allowed
# no candidate at all (its tokens all banned, or none in the vocabulary spells what it needs);
# accepted by the caller, the token was one the grammar does not allow.
_DEAD_END = "Unexpected empty grammar stack"
NOTHING_ALLOWED = (
    "the grammar allows no token here: every token it could take was ruled out (by logit_bias "
    "or a ban) or no token of the vocabulary spells what it needs"
)
COMPLETE = (
    "the grammar is complete: nothing may follow the text it accepted, and the model's "
    "vocabulary has no end-of-generation token to end with"
)
COMPLETE_END_BANNED = (
    "the grammar is complete: nothing may follow the text it accepted but an "
    "end-of-generation token, and logit_bias bans every one"
)

# What the llama-grammar-stack-bound patch's count is, and both ways a grammar reaches it;
# what the llama-grammar-work-budget patch's steps are, and what takes so many.
_EXPLANATIONS = {
    "parse stacks": (
        " (a parse stack is one way the grammar can read the text so far, and it holds them "
        "all at once: a rule that can start over inside itself multiplies them with every "
        "token, and a very wide alternation keeps one for each of its choices that the text "
        "still fits)"
    ),
    "steps to check one token": (
        " (llama.cpp follows every way the grammar can read a candidate token before it "
        "refuses it: where rules can split a text among them many ways, an ambiguous grammar, "
        "or many alternatives accept the same characters, that grows exponentially with the "
        "token's length)"
    ),
}


def grammar_call(name: str, *args: Any, dead_end: str = NOTHING_ALLOWED) -> Any:
    """``call`` for the sampling entry points, where a grammar can hit the bound of
    llamacrab-sys's llama-grammar-stack-bound patch on the ways it reads the text at once,
    its llama-grammar-work-budget patch on the steps one token's check takes, or every parse
    end (``dead_end`` says how)."""
    try:
        return call_bounded(name, *args, refusal=GrammarError, explain=_EXPLANATIONS)
    except NativeError as error:
        if not error.message.startswith(_DEAD_END):
            raise
        raise GrammarDeadEnd(f"{dead_end} (llama.cpp: {error.message})") from error


def candidates(ctx: Any, index: int, logits: Any, n_vocab: int) -> tuple[Any, np.ndarray]:
    """Output ``index``'s ``logits`` (``n_vocab`` floats) as llama_sampler_sample hands them to
    a chain's apply (a ``llama_token_data_array *``, and the array its data is), for a caller
    that accepts the pick itself: a chain with a grammar must not accept what it refuses."""
    # Another chain sampled this output inside the graph: llama.cpp would take that token.
    if call("llama_get_sampled_token_ith", ctx, index) != LLAMA_TOKEN_NULL or any(
        call(name, ctx, index) != ffi.NULL
        for name in ("llama_get_sampled_logits_ith", "llama_get_sampled_probs_ith")
    ):
        raise GrammarError(f"output {index} was sampled inside the graph by another chain")
    rows = np.zeros(n_vocab, dtype=TOKEN_DATA)
    rows["id"] = np.arange(n_vocab, dtype=np.int32)
    rows["logit"] = np.frombuffer(ffi.buffer(logits, 4 * n_vocab), dtype=np.float32)
    data = ffi.from_buffer("llama_token_data[]", rows)
    return ffi.new("llama_token_data_array *", (data, n_vocab, -1, False)), rows


def selected(array: Any) -> int:
    """The token a chain's apply selected in ``array``."""
    if not 0 <= array.selected < array.size:  # llama_sampler_sample asserts this (an abort)
        raise NativeError(
            "llama_sampler_apply", lib.LLAMACRAB_UNKNOWN_EXCEPTION, "the chain selected no token"
        )
    return int(array.data[array.selected].id)  # a sampler may point data at its own array


def pick_without(chain: Any, left_out: int | None, array: Any) -> int:
    """The token ``chain``'s samplers but the one at ``left_out`` select in ``array``, each
    applied as the chain's apply runs them."""
    for i in range(lib.llama_sampler_chain_n(chain)):
        sampler = lib.llama_sampler_chain_get(chain, i)
        if i != left_out and sampler.iface.apply != ffi.NULL:
            call("llama_sampler_apply", sampler, array)
    return selected(array)


def refused(grammar: Any, tokens: np.ndarray) -> np.ndarray:
    """Which of ``tokens`` (int32 ids) ``grammar`` does not allow next: its apply sets their
    logits to -inf (a lazy grammar waiting for its trigger allows every token)."""
    candidates = np.zeros(len(tokens), dtype=TOKEN_DATA)
    candidates["id"] = tokens
    data = ffi.from_buffer("llama_token_data[]", candidates)
    array = ffi.new("llama_token_data_array *", (data, len(tokens), -1, False))
    grammar_call("llama_sampler_apply", grammar, array)
    refusals: np.ndarray = candidates["logit"] == -np.inf
    return refusals


def has_border(text: str) -> bool:
    """Whether a proper suffix of ``text`` is also its prefix ("aa", "abab", "<s><s")."""
    return any(text.endswith(text[:n]) for n in range(1, len(text)))


class GrammarEnd:
    """Whether a grammar that allows no token may end there, for a vocabulary with no
    end-of-generation token, or whose every one a logit_bias bans. llama.cpp's grammar allows
    an end token exactly where its text may end; banned, or with none in the vocabulary, a
    complete text leaves it nothing to allow, as a dead end does. Asked there, this replays the
    tokens the grammar accepted into a copy of it, which allows the banned end tokens or not.
    With none, it finds a token T that copy does not allow next, and replays into the grammar
    followed by T's text: that one allows T exactly where the grammar's text may end (the
    grammar cannot take T, nor a part of it with all of T's text still to follow, which T's
    text would have to start and end with: T is one whose text has no border, as "aa" or
    "abab" have)."""

    def __init__(self, vocab: Vocab, grammar: str, root: str, trigger_words: Sequence[str]):
        self.vocab, self.grammar, self.root = vocab, grammar, root
        self.trigger_words = trigger_words
        self.tokens: list[int] = []  # accepted by the grammar since it started (or a reset)

    def may_end(self) -> bool:
        ends = np.array(self.vocab.eog_tokens, dtype=np.int32)
        if ends.size:
            return not self._replayed(self.grammar, self.root, lambda g: refused(g, ends)).all()
        everything = np.arange(self.vocab.n_tokens, dtype=np.int32)
        not_next = self._replayed(self.grammar, self.root, lambda g: refused(g, everything))
        found = next(filter(None, map(self._probe, everything[not_next].tolist())), None)
        if found is None:  # it allows every token that could probe: not at its end
            return False
        token, text = found
        rule = "llamacrab-end-probe"
        while rule in self.grammar:
            rule += "-"
        literal = "".join(f"\\U{ord(char):08X}" for char in text)
        probe = f'{self.grammar}\n{rule} ::= {self.root} "{literal}"\n'
        alone = np.array([token], dtype=np.int32)
        return not self._replayed(probe, rule, lambda g: refused(g, alone))[0]

    def _probe(self, token: int) -> tuple[int, str] | None:
        """``token`` and its text as the grammar reads it, if it reads one (a NUL ends it)
        without a border."""
        try:
            text = self.vocab.token_to_bytes(token, special=True).decode("utf-8")
        except UnicodeDecodeError:  # part of a character
            return None
        return (token, text) if text and "\0" not in text and not has_border(text) else None

    def _replayed(self, grammar: str, root: str, use: Callable[[Any], T]) -> T:
        """``use`` of a new sampler of ``grammar`` that accepted the tokens, then freed."""
        with held_signals():  # nothing lands between the sampler and its free
            sampler = grammar_sampler(self.vocab, grammar, root, self.trigger_words)
            try:
                for token in self.tokens:
                    grammar_call("llama_sampler_accept", sampler, token)
                return use(sampler)
            finally:
                lib.llama_sampler_free(sampler)
