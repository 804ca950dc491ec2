"""SamplerChain: a native ``llama_sampler`` chain built from SamplingOptions; runs in C."""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from llamacrab._exceptions import DecodeError, GrammarError, InvalidParameterError, NativeError
from llamacrab._field_types import (
    FLOAT32_MAX,
    INT32_MAX,
    INT32_MIN,
    check_field_types,
    check_range,
    is_number,
)
from llamacrab._native.call import call, call_each, ffi, lib
from llamacrab._native.claims import Exclusive
from llamacrab._native.context import Context
from llamacrab._native.custom_sampler import CustomSampler, _Bridge
from llamacrab._native.dry_sampler import check_breakers, dry_sampler
from llamacrab._native.gbnf.bounds import check_grammar, check_trigger_words
from llamacrab._native.gbnf.counts import exact_repetitions
from llamacrab._native.grammar_sampler import (
    LLAMA_TOKEN_NULL,
    NOTHING_ALLOWED,
    GrammarComplete,
    GrammarDeadEnd,
    GrammarEnd,
    candidates,
    grammar_call,
    grammar_sampler,
    pick_without,
    refused,
    selected,
)
from llamacrab._native.greedy import NO_TOKEN_LEFT, NOTHING_TO_PICK, BiasedArgmax, banned_tokens
from llamacrab._native.handle import NativeHandle
from llamacrab._native.infill_end import check_infill_end
from llamacrab._native.model import Model
from llamacrab._native.signals import held_signals
from llamacrab_sys import python_sampler

# llama.cpp's default order (common/common.h): filters first, temperature last, then `dist`.
DEFAULT_ORDER = (
    "penalties", "dry", "top_n_sigma", "top_k", "typical", "top_p", "min_p", "xtc", "temperature",
)  # fmt: skip
# A top_k this large or smaller, after a logit_bias of this many tokens at most, picks its
# candidates in one pass over the logits (a heap of k plus the biased tokens).
MAX_TOP_K_FIRST = 4096
MAX_BIAS_FIRST = 64
# The most tokens a penalty looks back over: more than any context holds (-1: the context).
MAX_PENALTY_WINDOW = 1 << 20
# The largest logit a model is taken to compute when checking that the samplers' arithmetic
# stays within float32 (see _check_logit_range): far above any model's, which stay within a
# few hundred, yet it lets a temperature down to 3e-31 divide it.
MODEL_LOGIT_BOUND = 1e8


@dataclass(frozen=True, kw_only=True)
class SamplingOptions:
    """Sampler settings with llama.cpp's defaults. ``temperature <= 0`` means greedy."""

    temperature: float = 0.8
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", '"', "*")
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    adaptive_p_target: float | None = None
    adaptive_p_decay: float = 0.9
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    grammar: str | None = None
    grammar_root: str = "root"
    grammar_trigger_words: tuple[str, ...] = ()
    infill: bool = False  # llama.cpp's infill sampler (fill-in-the-middle), before the final pick
    custom_samplers: tuple[CustomSampler, ...] = ()
    seed: int | None = None
    order: Sequence[str] = DEFAULT_ORDER
    # The penalties and DRY count the prompt's tokens too (within their windows), as
    # llama-server's do; False counts the generated tokens alone, as llama-cpp-python's.
    penalize_prompt: bool = False

    def __post_init__(self) -> None:
        check_field_types(self)
        check_range("top_k", self.top_k, INT32_MIN, INT32_MAX)  # a C int32
        # DRY subtracts it from a repeat's length (at most its window) in int32.
        check_range("dry_allowed_length", self.dry_allowed_length, -MAX_PENALTY_WINDOW, INT32_MAX)
        for name in ("penalty_last_n", "dry_penalty_last_n"):
            # llama.cpp allocates (and zero-fills) a ring of this many tokens: 2^31 was 8 GB
            check_range(name, getattr(self, name), -1, MAX_PENALTY_WINDOW)
        for name in _FLOAT_FIELDS:  # C takes a float32: a NaN or an infinite one, NaN logits
            value = getattr(self, name)
            if value is not None and not abs(value) <= FLOAT32_MAX:
                shown = "NaN" if value != value else repr(value)
                raise InvalidParameterError(
                    f"{name} is {shown}: it must be a finite number within a 32-bit float's "
                    "range (±3.4e38)"
                )
        # Below 0 the repeat penalty flips the logits' signs; at 0 it divides them by zero.
        if self.repeat_penalty <= 0:
            raise InvalidParameterError(
                f"repeat_penalty must be > 0 (1 disables it), not {self.repeat_penalty!r}"
            )
        if self.dry_multiplier < 0:  # it would add to repeats, up to past float32's range
            raise InvalidParameterError(
                f"dry_multiplier must be >= 0 (0 disables DRY), not {self.dry_multiplier!r}"
            )
        check_breakers(self.dry_sequence_breakers)
        unknown = set(self.order) - set(DEFAULT_ORDER)
        if unknown:
            raise InvalidParameterError(f"unknown samplers in order: {sorted(unknown)}")
        if self.mirostat not in (0, 1, 2):
            raise InvalidParameterError(f"mirostat must be 0, 1 or 2, not {self.mirostat}")
        if not 0 <= self.top_k < 2**31 or not 0 <= self.top_p <= 1 or not 0 <= self.min_p <= 1:
            raise InvalidParameterError(
                f"top_k {self.top_k} / top_p {self.top_p} / min_p {self.min_p} out of range"
            )
        for token, bias in self.logit_bias.items():
            # A token id given as text, or a NaN bias, would reach C as garbage (or a TypeError).
            if isinstance(token, bool) or not isinstance(token, int | np.integer):
                raise InvalidParameterError(f"logit_bias keys are token ids, not {token!r}")
            # +inf (a float32 past 3.4e38 is) makes the probabilities NaN; -inf bans.
            if not is_number(bias) or not -math.inf <= _as_float(bias) <= FLOAT32_MAX:
                raise InvalidParameterError(
                    f"logit_bias of token {token} is {bias!r}; a number up to 3.4e38 (a 32-bit "
                    "float's largest) is needed (-inf bans the token)"
                )
        if self.seed is not None and not 0 <= self.seed < 2**32:
            raise InvalidParameterError(f"seed must fit in 32 bits, not {self.seed}")
        _check_logit_range(self)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing but logit_bias before it: a pick numpy can make alone."""
        if not self.greedy or self.grammar is not None or self.custom_samplers:
            return False
        return not greedy_filters(self)

    @property
    def top_k_first(self) -> bool:
        """Whether nothing before top_k changes the logits but a logit_bias of a few tokens:
        the chain then needs only the top_k largest and those tokens (``SamplerChain.sample``)."""
        if self.greedy or self.mirostat or self.grammar is not None or self.custom_samplers:
            return False
        if not 0 < self.top_k <= MAX_TOP_K_FIRST or len(self.logit_bias) > MAX_BIAS_FIRST:
            return False
        before = self.order[: list(self.order).index("top_k")] if "top_k" in self.order else None
        return before is not None and not any(_active(self, name) for name in before)


def _as_float(value: Any) -> float:
    """``value`` as the float C takes; NaN (refused) for an integer past a float's range."""
    try:
        return float(value)
    except OverflowError:
        return math.nan


_FLOAT_FIELDS = tuple(f.name for f in fields(SamplingOptions) if f.type.startswith("float"))


def _check_logit_range(o: SamplingOptions) -> None:
    """Refuse settings whose arithmetic takes a logit past float32's range: at +inf the
    probabilities are NaN, and llama.cpp's last sampler then picks its last candidate, output
    as text. Bounds the largest logit from a model's (MODEL_LOGIT_BOUND), what adds to it (a
    positive logit_bias, negative frequency and presence penalties) and what divides it (a
    repeat_penalty below 1, then a temperature below 1), in whichever order they run (greedy:
    no temperature; its penalties run, see greedy_filters)."""
    window = MAX_PENALTY_WINDOW if o.penalty_last_n < 0 else o.penalty_last_n
    penalties = "penalties" in chain_filters(o) and window > 0
    bias = max([float(b) for b in o.logit_bias.values() if b > 0], default=0.0)
    added: dict[str, float] = {}  # what a penalty adds to a logit, at most
    if penalties:
        added["frequency_penalty"] = -o.frequency_penalty * window
        added["presence_penalty"] = -o.presence_penalty
    divisors = {
        "repeat_penalty": o.repeat_penalty if penalties else 1,
        "temperature": 1
        if o.greedy or not (o.mirostat or "temperature" in o.order)
        else o.temperature,
    }
    before = MODEL_LOGIT_BOUND + bias + sum(max(value, 0) for value in added.values())
    before /= min(divisors["repeat_penalty"], 1)  # the largest logit before the temperature
    if before / min(divisors["temperature"], 1) <= FLOAT32_MAX:
        return
    causes = [f"a logit_bias of {bias}"] if bias > 0 else []
    causes += [f"{name} {getattr(o, name)}" for name, value in added.items() if value > 0]
    causes += [f"{name} {value}" for name, value in divisors.items() if value < 1]
    hint = "lower what adds to the logits or raise what divides them"
    if before <= FLOAT32_MAX:  # the temperature alone is too small
        hint = f"use a temperature of at least {before / FLOAT32_MAX * 1.01:.2g}, or 0 for greedy"
    raise InvalidParameterError(
        f"{', '.join(causes)}: a logit (a model's, taken as up to {MODEL_LOGIT_BOUND:g}) would "
        f"pass a 32-bit float's range (3.4e38) and sampling pick an arbitrary token; {hint}"
    )


class SamplerChain(NativeHandle):
    """A native sampler chain bound to a model's vocabulary. It owns the samplers it holds. It
    samples from a context whose model's vocabulary has its size: its own model's, or another
    model's of the same vocabulary (the same file loaded again, ``vocab_only`` included)."""

    kind = "sampler"

    def __init__(
        self,
        model: Model,
        options: SamplingOptions | None = None,
        first: Sequence[CustomSampler] = (),
    ) -> None:
        """``first``: Python samplers placed before everything else (see CustomSampler)."""
        self.options = options = with_model_bans(options or SamplingOptions(), model)
        # The grammar as llama.cpp gets it: counts past its limit written out exactly.
        grammar = None if options.grammar is None else exact_repetitions(options.grammar)
        self._bridges = [_Bridge(sampler) for sampler in (*first, *options.custom_samplers)]
        # Nothing lands between a sampler and its owner (signals.py). The samplers read the
        # model's vocabulary (a grammar parses against it): closing the model from another
        # thread waits for them, then closes the chain.
        with held_signals(), model.in_flight():
            pointer = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
            if pointer == ffi.NULL:
                raise InvalidParameterError("llama.cpp could not create a sampler chain")
            super().__init__(pointer, lib.llama_sampler_free, model)
            try:
                with self.in_flight() as chain:
                    for sampler in _samplers(model, options, grammar, self._bridges):
                        lib.llama_sampler_chain_add(chain, sampler)  # the chain owns it now
            except BaseException:
                self.close()
                raise
        self.in_graph = False  # given to a context, to run inside its compute graph
        self._busy = Exclusive()
        # Where the grammar sits in the chain (after the Python samplers and the bias, see
        # _samplers), and the tokens its accept aborts on unless the grammar may end.
        self._grammar_at = (
            len(self._bridges) + bool(options.logit_bias) if options.grammar is not None else None
        )
        # A pick checked by the grammar alone (_unconstrained_pick) drawn again runs the
        # Python samplers twice on a token's candidates: not a caller's, which may keep state.
        self._checks_one_pick = all(isinstance(b.sampler, _EndBan) for b in self._bridges)
        self._end_tokens = frozenset(model.vocab.eog_tokens)
        self._bans = banned_tokens(options.logit_bias)  # the tokens a pick must never be
        # Every end token banned (llama-server's ignore_eos), as none in the vocabulary
        # leaves a grammar at its end nothing to allow (GrammarEnd).
        self._end_banned = bool(self._end_tokens) and self._end_tokens <= self._bans
        self._grammar_end = (
            GrammarEnd(model.vocab, grammar, options.grammar_root, options.grammar_trigger_words)
            if grammar is not None and (self._end_banned or not self._end_tokens)
            else None
        )  # fmt: skip
        # How many of the last tokens accepted the penalties and DRY keep (in ring buffers).
        windows = {"penalties": options.penalty_last_n, "dry": options.dry_penalty_last_n}
        self._memory = max(
            (_window(model, windows[name]) for name in chain_filters(options) if name in windows),
            default=0,
        )
        self._vocab = model.vocab
        self.n_vocab = model.vocab.n_tokens
        # Why the grammar cannot go on, after llama.cpp threw in its accept (see _advance).
        self._dead_end: str | None = None
        # Built after the chain, which checked the bias's token ids against the vocabulary.
        self._argmax = (
            BiasedArgmax(self.n_vocab, options.logit_bias)
            if options.plain_greedy and not self._bridges
            else None
        )
        # The top_k candidates the chain keeps anyway (and the biased tokens), picked in C.
        self._top_k_first = options.top_k_first and not self._bridges
        if self._top_k_first:
            biased = list(options.logit_bias)
            self._biased = ffi.new("llama_token[]", biased)
            self._scratch = ffi.new("llama_token_data[]", options.top_k + 2 * len(biased))

    @contextmanager
    def exclusive(self) -> Iterator[Any]:
        """The pointer, for one thread's call that runs or changes the samplers' state (a
        grammar's parse stacks, the penalties' ring): two threads at once corrupted it (a
        SIGSEGV, a grammar's abort). Another thread's call is refused (ConcurrentUseError)."""
        here = ("this sampler chain is in use by a call on this thread: a Python sampler "
                "inside it cannot use it")  # fmt: skip
        elsewhere = "this sampler chain is in use by another thread"
        with self._busy.hold(here, elsewhere), self.in_flight() as pointer:
            yield pointer

    @property
    def picks_in_numpy(self) -> bool:
        """Whether ``sample`` picks greedily in numpy instead of running the chain in C."""
        return self._argmax is not None and not self.in_graph

    @property
    def takes_banned(self) -> bool:
        """Whether ``sample`` can forbid more tokens itself: a greedy pick in numpy, or a
        chain handed only its top_k candidates, from which the banned ones are left out."""
        return (self._argmax is not None or self._top_k_first) and not self.in_graph

    def attach(self, context: Context, seq_id: int) -> bool:
        """Have ``context`` run this chain inside its compute graph for sequence ``seq_id``;
        True when every sampler of it runs there. False at once, the chain left to the CPU,
        when ``graph_fits`` says one cannot. Once given to llama.cpp, a chain skips on the CPU
        the samplers it ran in the graph: on a later False, build a new chain for the CPU."""
        self._check_given(context)
        if not self._fits_graph(context):
            return False
        if not context.set_graph_sampler(seq_id, self):
            return False
        # llama.cpp marks each sampler it runs in the graph with "+" in its name; a sampler
        # it cannot run there ("-") would leave the rest of the chain to the CPU.
        with self.exclusive() as chain:
            names = [
                ffi.string(lib.llama_sampler_name(lib.llama_sampler_chain_get(chain, i)))
                for i in range(lib.llama_sampler_chain_n(chain))
            ]
        if names and all(name.startswith(b"+") for name in names):
            return True
        context.set_graph_sampler(seq_id, None)
        return False

    def claim_graph(self, context: Context) -> None:
        """For ``Context.set_graph_sampler``: refused unless this chain was never given to a
        graph and all of it can run in ``context``'s; then it is given (``in_graph``), and
        samples only what a graph sampled: llama.cpp skips on the CPU what it initialized for
        one (an abort where nothing is left to pick)."""
        self._check_given(context)
        if not self._fits_graph(context):
            raise InvalidParameterError(
                "this sampler chain cannot run inside a compute graph (a Python sampler, a "
                "grammar, or a top_k past the vocabulary): sample it on the CPU"
            )
        self.in_graph = True

    def _check_given(self, context: Context) -> None:
        if self.in_graph:
            raise InvalidParameterError("this sampler chain was given to a context already")
        self._check_vocabulary(context)

    def _fits_graph(self, context: Context) -> bool:
        """Asked first: ggml asserts (an abort) on some chains llama.cpp takes (a top_k past
        the vocabulary), and a Python sampler has no graph implementation."""
        return not self._bridges and graph_fits(self.options, context.n_vocab)

    def sample(self, context: Context, index: int = -1, banned: np.ndarray | None = None) -> int:
        """Pick a token from the logits of output ``index`` and accept it into the chain state
        (attached: read the token the graph sampled, and accept it). ``banned``: more tokens
        forbidden at this pick (int32, in the vocabulary), for a chain that ``takes_banned``
        only. Raises when the bans leave no token (see ``_allowed``); GrammarComplete (a
        GrammarError) where an end-of-generation token would be the only pick and the
        vocabulary has none, or logit_bias bans every one: the grammar's text is complete."""
        try:
            token = self._sample(context, index, banned)
        except GrammarDeadEnd as dead_end:
            if self._grammar_end is None:
                raise
            with self.in_flight():  # the model's vocabulary stays
                if not self._grammar_end.may_end():
                    raise
            complete = GrammarComplete(self._end_banned)
            self._dead_end = str(complete)  # its state may hold a token refused after its pick
            raise complete from dead_end
        if self._grammar_end is not None:
            self._grammar_end.tokens.append(token)
        return token

    def _sample(self, context: Context, index: int, banned: np.ndarray | None) -> int:
        if banned is not None and not self.takes_banned:
            raise InvalidParameterError(
                "banned tokens need a greedy or top_k-first chain on the CPU"
            )
        check_range("index", index, INT32_MIN, INT32_MAX)  # what cffi takes
        self._check_vocabulary(context)
        self._check_no_dead_end()
        with self.exclusive() as chain, context.exclusive() as ctx:
            # llama_sampler_sample asserts (an abort) when the output has no logits: none
            # decoded yet, an index out of range, a token decoded without logits.
            if self.in_graph:
                if call("llama_get_sampled_token_ith", ctx, index) == LLAMA_TOKEN_NULL:
                    raise InvalidParameterError(f"no token sampled for output {index}")
            elif (logits := call("llama_get_logits_ith", ctx, index)) == ffi.NULL:
                raise InvalidParameterError(f"no logits for output {index} of the last decode")
            elif self._argmax is not None:  # logit_bias and greedy keep no state to accept
                return _finite(context, logits, self._argmax.pick(logits, banned), index)
            elif self._top_k_first:
                k, biased = self.options.top_k, self._biased
                ban = ffi.NULL if banned is None else ffi.from_buffer("llama_token[]", banned)
                n_ban = 0 if banned is None else len(banned)
                token = int(lib.llamacrab_sample_top_k_first(
                    chain, ctx, index, k, biased, len(biased), ban, n_ban, self._scratch
                ))  # fmt: skip
                if token == LLAMA_TOKEN_NULL:  # where llama_sampler_sample would abort
                    raise NativeError(
                        "llamacrab_sample_top_k_first", lib.LLAMACRAB_UNKNOWN_EXCEPTION,
                        "the chain selected no token, or a C++ exception",
                    )  # fmt: skip
                return self._allowed(_finite(context, logits, token, index))
            elif self._grammar_at is not None:
                return self._grammar_pick(context, chain, ctx, index, logits)
            token = int(self._advance("llama_sampler_sample", chain, ctx, index,
                                      dead_end=NOTHING_ALLOWED))  # fmt: skip
            if not self.in_graph:  # (the graph copies out no logits to look at)
                _finite(context, logits, token, index)
        self._raise_python_error()
        return self._allowed(token)

    def _grammar_pick(self, context: Context, chain: Any, ctx: Any, index: int, logits: Any) -> int:
        """llama_sampler_sample for a chain with a grammar, its accept held back until the
        grammar takes the pick: an end-of-generation token before the grammar is complete
        aborts the process in the grammar's accept."""
        token = (
            self._unconstrained_pick(chain, ctx, index, logits) if self._checks_one_pick else None
        )
        if token is None:
            token = self._constrained_pick(chain, ctx, index, logits)
        self._advance("llama_sampler_accept", chain, token, dead_end=NOTHING_ALLOWED)
        return _finite(context, logits, token, index)

    def _unconstrained_pick(self, chain: Any, ctx: Any, index: int, logits: Any) -> int | None:
        """As llama-server samples with a grammar: the chain without it first, then its pick
        checked by the grammar alone, one token where the grammar's apply checks every one of
        the vocabulary (two thirds of a token's time on Gemma 3's 262k). None when the grammar
        or a ban refuses the pick: the chain picks again with the grammar."""
        array, rows = candidates(ctx, index, logits, self.n_vocab)
        token = pick_without(chain, self._grammar_at, array)
        del rows  # what array pointed into, alive until the pick was read
        self._raise_python_error()
        banned = token in self._bans or any(b.left_out(token) for b in self._bridges)
        if banned or self._grammar_refuses(chain, token):
            return None
        return token

    def _constrained_pick(self, chain: Any, ctx: Any, index: int, logits: Any) -> int:
        """The whole chain's pick, the grammar's apply among its samplers. The last sampler
        picks one anyway when every candidate is at -inf (the bias or a Python sampler banned
        what the grammar allows), and the infill sampler puts its end token in when no text is
        likely enough."""
        array, rows = candidates(ctx, index, logits, self.n_vocab)
        self._advance("llama_sampler_apply", chain, array, dead_end=NOTHING_ALLOWED)
        token = self._allowed(selected(array))
        del rows
        self._raise_python_error()
        if token in self._end_tokens and self._grammar_refuses(chain, token):
            if self.options.infill:
                raise GrammarDeadEnd(
                    f"the infill sampler ends the text with token {token}, which the grammar "
                    "does not allow here: what it accepted so far is not complete"
                )
            raise GrammarDeadEnd(NOTHING_ALLOWED)
        return token

    def _allowed(self, token: int, end_banned: bool = False) -> int:
        """``token``, unless it is banned (a -inf logit_bias; the end-of-generation tokens too
        with ``end_banned``): llama.cpp's last sampler picks one only when every candidate was
        at -inf, and then some token anyway. A set lookup: no pass over the vocabulary. The
        infill sampler's end token stands: it puts it in itself when no text is likely enough."""
        ends = token in self._end_tokens
        banned = token in self._bans or (end_banned and ends)
        # A Python sampler's -inf bans too: with the bias's, they could leave no token.
        banner = None if banned else next((b for b in self._bridges if b.left_out(token)), None)
        if not (banned or banner) or (self.options.infill and ends):
            return token
        if self._grammar_at is not None:  # as the grammar says it when its pick is refused
            raise GrammarDeadEnd(NOTHING_ALLOWED)
        if banner is not None:
            raise InvalidParameterError(
                f"{NOTHING_TO_PICK}: logit_bias and {banner.shown_name} together ban every token"
            )
        raise InvalidParameterError(NO_TOKEN_LEFT)

    def accept(self, token: int) -> None:
        """Record ``token`` as the one that came next (``sample`` accepts what it picks)."""
        token = self._checked_token(token)
        self._check_no_dead_end()
        with self.exclusive() as chain:
            if self._grammar_at is not None:
                self._check_grammar_allows(chain, token)
            self._advance(
                "llama_sampler_accept",
                chain,
                token,
                # reached only past the test above: a lazy grammar, at its trigger word
                dead_end=f"the grammar does not allow the text from the trigger word that "
                f"token {token} completes",
            )
        if self._grammar_end is not None:
            self._grammar_end.tokens.append(token)
        self._raise_python_error()

    def accept_prompt(self, tokens: Sequence[int]) -> None:
        """Record a prompt's ``tokens`` as the ones before the first pick, as llama-server
        accepts a prompt into every sampler but the grammar: the penalties and DRY count them
        (the other native samplers ignore a token they did not pick). Only the last ones
        within the penalties' and DRY's windows, which would push the rest out of their
        rings anyway. The grammar and the Python samplers see picked tokens alone, and the last
        sampler, which picks (dist counts its draws in the graph, none made yet), none."""
        if not self._memory or not len(tokens):
            return
        tail = self._vocab.check_tokens(list(tokens[-self._memory :])).tolist()
        skipped = {*range(len(self._bridges)), self._grammar_at}
        with self.exclusive() as chain:
            for i in range(lib.llama_sampler_chain_n(chain) - 1):
                sampler = lib.llama_sampler_chain_get(chain, i)
                # One without an accept keeps no state: nothing to call.
                if i in skipped or sampler.iface.accept == ffi.NULL:
                    continue
                call_each("llama_sampler_accept", sampler, tail)

    def _checked_token(self, token: int) -> int:
        """``token`` as an int of the vocabulary: llama.cpp's samplers take any int32 (a
        ``-1`` aborts adaptive-p's accept) and cffi a wider one not at all."""
        if isinstance(token, bool) or not isinstance(token, int | np.integer):
            raise InvalidParameterError(f"a token id is an int, not {token!r}")
        return int(self._vocab.check_tokens([token])[0])

    def _check_vocabulary(self, context: Context) -> None:
        """The chain reads (and its logit_bias writes) ``n_vocab`` logits of a row, and picks
        among as many tokens: a context of another vocabulary size has rows of another length."""
        if context.n_vocab != self.n_vocab:
            raise InvalidParameterError(
                f"this sampler chain is for a vocabulary of {self.n_vocab} tokens; the "
                f"context's model has {context.n_vocab}: build a chain with that model"
            )

    def _check_no_dead_end(self) -> None:
        if self._dead_end is not None:
            raise GrammarError(
                f"this chain's grammar cannot go on from an earlier token ({self._dead_end}): "
                "call reset() before using the chain again"
            )

    def _advance(self, name: str, *args: Any, dead_end: str) -> Any:
        """``_grammar_call`` for a call that accepts a token into the chain. llama.cpp throws
        from the grammar's accept only after it emptied (or overfilled) the grammar's parse
        stacks, and the grammar's next use would abort on them: the chain refuses until
        ``reset``."""
        try:
            return grammar_call(name, *args, dead_end=dead_end)
        except GrammarError as error:
            self._dead_end = str(error)
            raise

    def _check_grammar_allows(self, chain: Any, token: int) -> None:
        """The grammar's accept throws with its parse stacks already emptied when ``token``
        does not fit, and aborts the process for an end-of-generation token that comes before
        the grammar is complete. Its apply is the same test without either: it sets the
        token's logit to -inf unless the grammar allows it here (or a lazy grammar waits)."""
        if not self._grammar_refuses(chain, token):
            return
        if token in self._end_tokens:
            raise GrammarError(
                f"the grammar does not allow the end-of-generation token {token} here: the "
                "text it accepted so far is not complete"
            )
        piece = self._vocab.token_to_piece(token, special=True)
        raise GrammarError(
            f"the grammar does not allow token {token} here: its text {piece!r} does not "
            "continue what the grammar accepted so far"
        )

    def _grammar_refuses(self, chain: Any, token: int) -> bool:
        """Whether the chain's grammar does not allow ``token`` next (``refused``)."""
        return bool(refused(self._grammar(chain), np.array([token], dtype=np.int32))[0])

    def _grammar(self, chain: Any) -> Any:
        """The chain's grammar sampler."""
        grammar = lib.llama_sampler_chain_get(chain, self._grammar_at)
        if grammar == ffi.NULL:
            raise NativeError(
                "llama_sampler_chain_get",
                lib.LLAMACRAB_UNKNOWN_EXCEPTION,
                "the chain has no sampler where its grammar was put",
            )
        return grammar

    def reset(self) -> None:
        with self.exclusive() as chain:
            call("llama_sampler_reset", chain)
        self._dead_end = None  # the grammar starts over from its root
        if self._grammar_end is not None:
            self._grammar_end.tokens.clear()
        self._raise_python_error()

    def _raise_python_error(self) -> None:
        """What a Python sampler raised while llama.cpp ran it reaches the caller here."""
        for bridge in self._bridges:
            bridge.raise_error()


def _finite(context: Context, logits: Any, token: int, index: int) -> int:
    """``token``, unless the model's logit for it is NaN or infinite: the model computed
    nothing usable there (weights, an adapter's scale or a control vector that overflowed), and
    every pick would be the same arbitrary token, output as if it were text. The context then
    zeroes the cells its removals free (``Context.note_non_finite``)."""
    if not math.isfinite(logits[token]):
        context.note_non_finite()
        raise DecodeError(
            f"the model computed a logit of {logits[token]} for output {index} (weights, a LoRA "
            "scale or a control vector strength that overflows): nothing to sample from",
            status=0,
        )
    return token


class _EndBan(CustomSampler):
    """Forbids end-of-generation tokens while ``active`` (min_tokens). First in the chain, where
    the candidates are still in token-id order, so banning costs O(number of end tokens)."""

    name = "min-tokens"

    def __init__(self, end_tokens: tuple[int, ...]) -> None:
        self.end_tokens = np.array(end_tokens, dtype=np.int32)
        self.active = True

    def apply(self, candidates: np.ndarray) -> None:
        if not self.active or self.end_tokens.size == 0:
            return
        ids = candidates["id"]
        if ids.size > self.end_tokens.max() and (ids[self.end_tokens] == self.end_tokens).all():
            candidates["logit"][self.end_tokens] = -np.inf
        else:
            candidates["logit"][np.isin(ids, self.end_tokens)] = -np.inf


class Samplers:
    """The chain one generation samples with, plus the min_tokens switch. ``graph`` "on"
    lets ``bind`` run the chain inside the compute graph when every sampler of it can run
    there (see ``graph_fits``); "off" keeps it on the CPU. With ``options.penalize_prompt``
    the chain accepts ``prompt`` (its text tokens: an image or a sound is none) first."""

    def __init__(
        self,
        model: Model,
        options: SamplingOptions,
        min_tokens: int = 0,
        graph: str = "off",
        prompt: Sequence[int] = (),
    ) -> None:
        self.model = model
        self.options = options = with_model_bans(options, model)
        self.prompt = prompt if options.penalize_prompt else ()
        self.ban = _EndBan(model.vocab.eog_tokens) if min_tokens > 0 else None
        # A plain greedy pick and a top_k-first chain ban the end tokens themselves (see
        # sample); any other chain runs the ban as its first, Python, sampler.
        bans_itself = options.plain_greedy or options.top_k_first
        first = (self.ban,) if self.ban is not None and not bans_itself else ()
        self.main = self._chain(first)
        self.graph = (
            graph == "on" and self.ban is None and graph_fits(options, model.vocab.n_tokens)
        )
        self._bound: tuple[Context, int] | None = None

    @property
    def in_graph(self) -> bool:
        """Whether the chain samples inside the compute graph (after ``bind``)."""
        return self._bound is not None

    def bind(self, context: Context, seq_id: int) -> None:
        """Before the first decode of a generation on sequence ``seq_id``: give the chain to
        ``context``'s graph if planned, else take any chain out of that sequence. Called
        holding the lock that serializes the context's users."""
        if self.graph and not self.main.in_graph:
            try:
                attached = self.main.attach(context, seq_id)
            except NativeError:  # llama.cpp threw while building the sampling graph
                attached = False
            if attached:
                self._bound = (context, seq_id)
                return
            # Refused, or only part of it runs there: the CPU samples with a fresh chain.
            self.graph = False
            self.main.close()
            self.main = self._chain(())
        context.set_graph_sampler(seq_id, None)

    def _chain(self, first: Sequence[CustomSampler]) -> SamplerChain:
        chain = SamplerChain(self.model, self.options, first=first)
        try:
            chain.accept_prompt(self.prompt)
        except BaseException:
            chain.close()
            raise
        return chain

    def unbind(self) -> None:
        """At the end of the generation (holding the same lock): the sequence's outputs have
        raw logits again. Another generation's chain, set since, stays."""
        if self._bound is None:
            return
        context, seq_id = self._bound
        self._bound = None
        if not context.closed and context.graph_sampler(seq_id) is self.main:
            context.set_graph_sampler(seq_id, None)

    def sample(self, context: Context, end_allowed: bool = True, index: int = -1) -> int:
        banned = None
        if self.ban is not None:
            self.ban.active = not end_allowed
            if self.ban.active and self.main.takes_banned:
                banned = self.ban.end_tokens
        try:
            token = self.main.sample(context, index, banned)
        except GrammarComplete as complete:
            if end_allowed:
                raise
            raise GrammarError(f"{complete}, before min_tokens were generated") from complete
        # An end token picked while min_tokens bans it (-inf) means nothing else was left.
        return self.main._allowed(token, end_banned=self.ban is not None and self.ban.active)

    def close(self) -> None:
        self.main.close()


# At the pin llama.cpp's greedy pick in the graph is the argmax's position in the row it is
# handed, never mapped back to a token id as its dist maps it: after top_k or top_p, which hand
# on a row of their candidates, that position is no token id (top_p sorts its row by logit:
# token 0 was generated every time).
_GRAPH_GREEDY_BLOCKERS = ("top_k", "top_p")


def with_model_bans(options: SamplingOptions, model: Model) -> SamplingOptions:
    """``options`` with the model's suppressed tokens banned (a -inf logit_bias, which no bias
    of the caller's lifts), as llama.cpp's common sampler, and so llama-server, merges them."""
    suppressed = model.vocab.suppressed_tokens
    if all(options.logit_bias.get(token) == -math.inf for token in suppressed):
        return options
    bans = dict.fromkeys(suppressed, -math.inf)
    return replace(options, logit_bias={**options.logit_bias, **bans})


def graph_fits(options: SamplingOptions, n_vocab: int) -> bool:
    """Whether every sampler of ``options``' chain has an implementation inside llama.cpp's
    compute graph at the pin: logit_bias, then greedy, or penalties, top_k, top_p, min_p,
    temperature (dynatemp too) and dist. Not: Python samplers, grammar, DRY, top_n_sigma,
    typical, XTC, mirostat, adaptive-p, infill, nor a greedy pick after top_k or top_p (see
    _GRAPH_GREEDY_BLOCKERS). (llama.cpp runs penalties in the graph only with one output per
    sequence and decode, its default; ``SamplerChain.attach`` checks what it accepted.)"""
    o = options
    if o.custom_samplers or o.grammar is not None:
        return False
    outside = ("dry", "top_n_sigma", "typical", "xtc")
    if o.greedy:
        blockers = (*outside, *_GRAPH_GREEDY_BLOCKERS)
        return not any(name in blockers for name in greedy_filters(o))
    if (
        o.mirostat
        or o.infill
        or o.adaptive_p_target is not None
        or any(_active(o, name) for name in o.order if name in outside)
    ):
        return False
    return not ("top_k" in o.order and o.top_k > n_vocab)  # ggml's top_k asserts k <= n


def _window(model: Model, last_n: int) -> int:
    """A penalty's window: -1 is the model's training context (llama.cpp at the pin takes -1
    as 0, which turns the penalty off: DRY did nothing at its default)."""
    return min(model.n_ctx_train, MAX_PENALTY_WINDOW) if last_n < 0 else last_n


def _checked(sampler: Any, what: str) -> Any:
    if sampler == ffi.NULL:
        raise InvalidParameterError(f"llama.cpp rejected the {what} sampler settings")
    return sampler


def _samplers(
    model: Model, o: SamplingOptions, grammar: str | None, python: Sequence[_Bridge]
) -> Iterator[Any]:
    """The samplers of the chain, in order; the last one picks the token. Each is handed to the
    chain as soon as it exists, so an error part-way leaks nothing."""
    n_vocab = model.vocab.n_tokens
    seed = o.seed if o.seed is not None else secrets.randbits(32)
    # Python samplers see every candidate, in token-id order, before anything native runs.
    for bridge in python:
        yield python_sampler(bridge)
    if o.logit_bias:
        tokens = model.vocab.check_tokens(list(o.logit_bias))
        bias = ffi.new("llama_logit_bias[]", len(o.logit_bias))
        for entry, token, value in zip(bias, tokens, o.logit_bias.values(), strict=True):
            entry.token, entry.bias = int(token), value
        yield _checked(
            call("llama_sampler_init_logit_bias", n_vocab, len(bias), bias), "logit_bias"
        )
    if grammar is not None:
        check_grammar(grammar)
        check_trigger_words(o.grammar_trigger_words)
        yield grammar_sampler(model.vocab, grammar, o.grammar_root, o.grammar_trigger_words)
    if o.greedy:
        for name in greedy_filters(o):
            yield _checked(_filter(model, o, name, seed), name)
        yield _checked(call("llama_sampler_init_greedy"), "greedy")
        return
    if o.mirostat:
        yield _checked(call("llama_sampler_init_temp", o.temperature), "temperature")
        if o.mirostat == 1:
            miro = call(
                "llama_sampler_init_mirostat", n_vocab, seed, o.mirostat_tau, o.mirostat_eta, 100
            )
        else:
            miro = call("llama_sampler_init_mirostat_v2", seed, o.mirostat_tau, o.mirostat_eta)
        yield _checked(miro, "mirostat")
        return
    for name in chain_filters(o):
        yield _checked(_filter(model, o, name, seed), name)
    if o.infill:
        check_infill_end(model.vocab)  # a chain built without the feature layer's check too
        _check_infill_candidates(o, n_vocab)
        yield _checked(call("llama_sampler_init_infill", model.vocab.pointer), "infill")
    if o.adaptive_p_target is not None:
        final = call("llama_sampler_init_adaptive_p", o.adaptive_p_target, o.adaptive_p_decay, seed)
    else:
        final = call("llama_sampler_init_dist", seed)
    yield _checked(final, "final")


# llama.cpp's infill sampler compares every candidate's piece with every other's, in one call
# nothing interrupts: 2,048 took 0.1 s, 32,768 17 s, Gemma 3's 262,144 would take an hour.
MAX_INFILL_CANDIDATES = 4096


def _check_infill_candidates(o: SamplingOptions, n_vocab: int) -> None:
    """A top_k before the infill sampler leaves it at most MAX_INFILL_CANDIDATES."""
    reaching = o.top_k if "top_k" in o.order and _active(o, "top_k") else n_vocab
    if min(reaching, n_vocab) > MAX_INFILL_CANDIDATES:
        raise InvalidParameterError(
            f"the infill sampler would compare {min(reaching, n_vocab)} candidates pairwise, "
            f"in one call nothing interrupts: give it a top_k of at most "
            f"{MAX_INFILL_CANDIDATES} (in the sampler order)"
        )


# The samplers that can change which token a greedy pick takes: penalties and DRY change
# logits, typical and XTC may drop the most likely token. (top_k, top_p, min_p and top_n_sigma
# keep it, though they change what the samplers after them see; a temperature of 0 keeps it
# alone.)
_GREEDY_CHANGERS = ("penalties", "dry", "typical", "xtc")


def greedy_filters(o: SamplingOptions) -> list[str]:
    """The samplers that run before a greedy pick: the active ones of ``o.order`` before its
    temperature, up to the last that can change the pick, as llama.cpp's chain runs them before
    its temperature of 0 keeps the most likely token (a repeat penalty at temperature 0 is
    llama-server's and llama-cpp-python's too); none where none can. Those after the last
    (top_k, top_p, min_p, top_n_sigma) keep the most likely token: left out, the pick is the
    same. Mirostat: none (llama.cpp's mirostat chain is its temperature alone)."""
    if o.mirostat:
        return []
    end = o.order.index("temperature") if "temperature" in o.order else len(o.order)
    before = [name for name in o.order[:end] if _active(o, name)]
    changers = [i for i, name in enumerate(before) if name in _GREEDY_CHANGERS]
    return before[: changers[-1] + 1] if changers else []


def chain_filters(o: SamplingOptions) -> list[str]:
    """The samplers of ``o.order`` that the chain holds: a greedy pick's filters, none beside
    mirostat, else every active one."""
    if o.greedy:
        return greedy_filters(o)
    return [] if o.mirostat else [name for name in o.order if _active(o, name)]


def _active(o: SamplingOptions, name: str) -> bool:
    """Whether the sampler ``name`` of ``o.order`` has anything to do (a neutral one is left
    out of the chain)."""
    if name == "penalties":
        return o.repeat_penalty != 1.0 or o.frequency_penalty != 0 or o.presence_penalty != 0
    return {
        "dry": o.dry_multiplier != 0, "top_n_sigma": o.top_n_sigma > 0, "top_k": o.top_k > 0,
        "typical": o.typical_p < 1, "top_p": o.top_p < 1, "min_p": o.min_p > 0,
        "xtc": o.xtc_probability > 0, "temperature": True,
    }[name]  # fmt: skip


def _filter(model: Model, o: SamplingOptions, name: str, seed: int) -> Any:
    """The native sampler ``name`` of ``o.order``, which ``_active`` said has work to do."""
    if name == "penalties":
        return call("llama_sampler_init_penalties", model.vocab.n_tokens,
                    _window(model, o.penalty_last_n), o.repeat_penalty, o.frequency_penalty,
                    o.presence_penalty)  # fmt: skip
    if name == "dry":
        window = _window(model, o.dry_penalty_last_n)
        breakers = tuple(o.dry_sequence_breakers)
        return dry_sampler(
            model, (breakers, o.dry_multiplier, o.dry_base, o.dry_allowed_length, window)
        )
    simple = {
        "top_n_sigma": lambda: call("llama_sampler_init_top_n_sigma", o.top_n_sigma),
        "top_k": lambda: call("llama_sampler_init_top_k", o.top_k),
        "typical": lambda: call("llama_sampler_init_typical", o.typical_p, 1),
        "top_p": lambda: call("llama_sampler_init_top_p", o.top_p, 1),
        "min_p": lambda: call("llama_sampler_init_min_p", o.min_p, 1),
        "xtc": lambda: call("llama_sampler_init_xtc", o.xtc_probability, o.xtc_threshold, 1, seed),
    }
    if name in simple:
        return simple[name]()
    if o.dynatemp_range > 0:  # temperature
        return call(
            "llama_sampler_init_temp_ext", o.temperature, o.dynatemp_range, o.dynatemp_exponent
        )
    return call("llama_sampler_init_temp", o.temperature)
