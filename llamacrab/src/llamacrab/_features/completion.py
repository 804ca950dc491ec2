"""Completion requests on a context: prompts in, streams of chunks out, on one slot (calls
serialized, a new call supersedes an unfinished stream) or parallel slots (the scheduler)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import numpy as np

from llamacrab._engine.cache import PromptCache
from llamacrab._engine.generation import (
    MEDIA_TOKEN,
    KvState,
    Request,
    Session,
    Step,
    generate,
    start_prompt,
)
from llamacrab._engine.scheduler import Scheduler
from llamacrab._engine.speculative import Drafter, Speculative, SpeculativeStats
from llamacrab._engine.stream import Stream
from llamacrab._exceptions import ConcurrentUseError, DecodeAbortedError, InvalidParameterError
from llamacrab._features.media import MediaInput
from llamacrab._field_types import UINT32_MAX, check_range, choice_seeds
from llamacrab._native.context import Context
from llamacrab._native.fork import reset_in_child
from llamacrab._native.host_limits import host_memory_left
from llamacrab._native.media import Media
from llamacrab._native.model import Model
from llamacrab._native.mtmd import Chunks
from llamacrab._native.sampler import Samplers, SamplingOptions
from llamacrab._native.state import SavedState
from llamacrab._native.vocab import Vocab
from llamacrab._types import (
    Completion,
    CompletionChoice,
    CompletionChunk,
    Logprobs,
    SlotInfo,
    Usage,
)

MAX_CHOICES = 128  # n and best_of, as OpenAI's API bounds n: each choice is a generation


@dataclasses.dataclass(frozen=True)
class Prompt:
    """Prompt tokens (MEDIA_TOKEN where media sit), their text, and the multimodal chunks."""

    tokens: list[int]
    text: str
    chunks: Chunks | None = None

    def text_tokens(self) -> list[int]:
        """The tokens of its text, in order: a multimodal prompt's images and sounds have none."""
        return self.tokens if self.chunks is None else self.chunks.text_tokens()


def completion_prompt(
    vocab: Vocab, media: MediaInput, prompt: str | Sequence[int] | Chunks, items: Sequence[Media]
) -> Prompt:
    if items:
        if not isinstance(prompt, str):
            raise InvalidParameterError("media= needs a text prompt with media markers")
        prompt = media.tokenize(prompt, items, add_special=True, parse_special=False)
    if isinstance(prompt, Chunks):
        media.check_own(prompt)
        return Prompt([MEDIA_TOKEN] * prompt.n_pos, "", prompt)
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidParameterError("the prompt is empty")
        return Prompt(vocab.tokenize(prompt), prompt)
    tokens = vocab.check_tokens(prompt).tolist()
    return Prompt(tokens, vocab.detokenize(tokens))


def check_generates(model: Model, embeddings: bool = False) -> None:
    """Refuse to generate from a model that computes no logits in a context with
    ``embeddings`` on or off: llama.cpp leaves them unwritten, and a generation of an
    embedding model answered "" (greedy) or [unusedNN] tokens. The checks made before the
    context is used (ahead of a template's or FIM tokens' lookup) leave ``embeddings`` off."""
    if not model.computes_logits(embeddings=False):
        raise InvalidParameterError(
            f"{model.path.name} ({model.arch}) computes no logits (no language-model head), so "
            "it cannot generate text: use embed() (or rerank() for a reranker) with it, and a "
            "text-generation model for completions and chat"
        )
    if not model.computes_logits(embeddings):
        raise InvalidParameterError(
            f"{model.path.name} ({model.arch}) computes no logits in a context with embeddings "
            "on: llama.cpp skips its language-model head there. Generate with a Llama created "
            "without embeddings=True (a server without --embeddings)"
        )


def check_speculation(model: Model) -> None:
    """Speculative decoding drops rejected drafts from the memory: before any decode, refuse a
    model whose memory cannot (it used to fail at the first rejected draft, mid-answer)."""
    if model.recurrent:
        raise InvalidParameterError(
            "speculative decoding needs a memory that can drop rejected drafts; a recurrent or "
            "hybrid model's state cannot (Model.recurrent)"
        )
    if model.encoder_decoder:
        raise InvalidParameterError(
            "speculative decoding drafts from the tokens before, which an encoder-decoder "
            "model's decoder does not see: its input is what the encoder read"
        )


class Completer:
    """Runs completion requests on ``context``: ``parallel=None`` for one slot, else N slots
    batched together by an engine thread."""

    def __init__(
        self,
        context: Context,
        cache: PromptCache | None,
        parallel: int | None,
        max_queue: int,
    ) -> None:
        self.model = context.model
        self.lock = threading.RLock()
        self.kv = KvState(context, cache)
        self.speculative_stats = SpeculativeStats()  # of the last one-slot completion
        self._session: weakref.ReferenceType[Session] | None = None
        self._running: Session | None = None  # the one-slot generation under way, if any
        # One slot: a new generation supersedes an unfinished one, or (False) waits for its end.
        self.supersede = True
        self._idle = threading.Condition(self.lock)
        reset_in_child(self.lock, self._idle)
        self.scheduler: Scheduler | None = None
        self._stop_engine: weakref.finalize[[], Completer] | None = None
        if parallel is not None:
            self.scheduler = Scheduler(context, self.lock, parallel, max_queue, cache)
            # Collected or closed, the completer stops its engine thread before the context goes.
            self._stop_engine = weakref.finalize(self, self.scheduler.close)

    def close(self) -> None:
        """Stop the engine thread (if any); one slot has nothing to stop."""
        if self._stop_engine is not None:
            self._stop_engine()

    @property
    def busy(self) -> bool:
        """Whether a generation is under way (an unfinished stream too) or waiting for a
        slot."""
        if self.scheduler is None:
            return self._running is not None
        return bool(self.scheduler.busy_slots or self.scheduler.queue_depth)

    def one_slot(self, what: str) -> KvState:
        if self.scheduler is not None:
            raise InvalidParameterError(
                f"{what} on parallel slots needs slot=i (or a Llama with parallel=None)"
            )
        return self.kv

    # -- slots ---------------------------------------------------------------------------------

    def slots(self) -> list[SlotInfo]:
        n_ctx = self.kv.context.n_ctx_seq
        if self.scheduler is None:
            return [SlotInfo(0, self._running is not None, len(self.kv.held_tokens()), n_ctx)]
        described = self.scheduler.describe()
        return [SlotInfo(i, busy, held, n_ctx) for i, (busy, held) in enumerate(described)]

    def held_tokens(self, index: int) -> list[int]:
        if self.scheduler is not None:
            return self.scheduler.held_tokens(index)
        if index != 0:
            raise InvalidParameterError(f"slot {index} does not exist: this Llama has slot 0")
        return self.kv.held_tokens()

    @contextlib.contextmanager
    def idle_slot(self, index: int) -> Iterator[KvState]:
        """Slot ``index``'s memory while it is idle (ConcurrentUseError while it generates):
        one slot has no generation under way, or a parallel slot has no job."""
        self.kv.context.check_own()  # after fork(), the parent's jobs seem to hold the slots
        if self.scheduler is not None:
            with self.scheduler.idle_slot(index) as kv:
                yield kv
            return
        if index != 0:
            raise InvalidParameterError(f"slot {index} does not exist: this Llama has slot 0")
        with self.lock:
            if self._running is not None:
                raise ConcurrentUseError(
                    "slot 0 is generating (a stream is unfinished): its state can be saved, "
                    "loaded or erased once it ends"
                )
            yield self.kv

    def save(self, index: int, scope: str) -> SavedState:
        if self.scheduler is not None and scope != "sequence":
            raise InvalidParameterError("a parallel slot saves its own sequence: scope='sequence'")
        with self.idle_slot(index) as kv:
            return kv.snapshot(scope)

    def load(self, index: int, state: SavedState) -> None:
        if self.scheduler is not None and state.scope != "sequence":
            raise InvalidParameterError(
                "a whole-context state cannot load into one of several parallel slots"
            )
        with self.idle_slot(index) as kv:
            kv.restore(state)

    def erase(self, index: int) -> int:
        """Forget what slot ``index`` holds; how many tokens it held."""
        with self.idle_slot(index) as kv:
            held = len(kv.tokens)
            if self.scheduler is None:
                kv.reset()  # the one slot's memory is the whole context's
            else:
                kv.forget()
            return held

    @property
    def cache(self) -> PromptCache | None:
        return self.kv.cache

    @cache.setter
    def cache(self, cache: PromptCache | None) -> None:
        """Every slot's memory looks up and stores prompts in ``cache`` from its next prompt."""
        with self.lock:  # the scheduler's engine reads the slots' caches under it
            slots = [] if self.scheduler is None else self.scheduler.slots
            for kv in [self.kv, *(slot.kv for slot in slots)]:
                kv.cache = cache

    def forget(self) -> None:
        """Drop every cached prompt prefix."""
        self.kv.context.check_own()  # as in idle_slot
        if self.scheduler is not None:
            self.scheduler.forget()
        else:
            with self.lock:
                self.kv.reset()

    def cancel(self) -> None:
        if self.scheduler is not None:
            self.scheduler.cancel_all()
            return
        # Through the session: its decode watch aborts a prompt's chunk in flight only while
        # the watch is open, where the context's own cancel, come late, aborted the next one's.
        session = self._session() if self._session else None
        if session is not None:
            session.cancel()

    def stream(
        self,
        prompt: Prompt,
        request: Request,
        options: SamplingOptions,
        session: Session,
        speculation: tuple[Speculative | None, Speculative | None],
        echo: bool,
        suffix: str,
    ) -> Stream[CompletionChunk]:
        """``speculation``: the call's own choice and the Llama's default."""
        check_generates(self.model, self.kv.context.params.embeddings)
        self._refuse_nested("a generation")
        speculative, default = speculation
        if prompt.chunks is not None and echo:
            raise InvalidParameterError("echo takes text prompts only")
        if speculative is not None and self.scheduler is not None:
            raise InvalidParameterError("speculative decoding needs a Llama with parallel=None")
        request.check(self.kv.context.n_ctx_seq)
        speculative = speculative if speculative is not None else default
        if speculative is not None:
            check_speculation(self.model)
        drafter = speculative.drafter(self.model) if speculative is not None else None
        # Inside the graph a sequence has no raw logits: log-probabilities, media prompts
        # (libmtmd decodes them) and speculative decoding (llama.cpp samples one output per
        # sequence and decode there; a verification decodes several) sample on the CPU, and a
        # prompt alone (max_tokens=0) samples nothing and leaves its logits to be read.
        graph = self.kv.context.graph_sampling
        cpu_only = request.logprobs is not None or prompt.chunks is not None or drafter is not None
        if cpu_only or request.max_tokens == 0:
            graph = "off"
        seen = prompt.text_tokens() if options.penalize_prompt else ()
        samplers = Samplers(self.model, options, request.min_tokens, graph, seen)
        echo_text = prompt.text if echo else None
        if self.scheduler is None:
            steps = self._one_slot_steps(request, samplers, session, drafter)
            chunks = self._chunks(request, steps, session, echo_text, suffix, samplers)
        else:
            try:  # queued now: a full queue fails here, and slots start at once
                steps = self.scheduler.submit(request, samplers, session)
            except BaseException:
                samplers.close()
                raise
            # From here the engine owns the samplers (it frees them when the job ends).
            chunks = self._chunks(request, steps, session, echo_text, suffix, None)
        return Stream(chunks, session)

    def complete(
        self,
        start: Callable[..., Stream[CompletionChunk]],
        n: int | None,
        best_of: int | None,
        kwargs: dict[str, Any],
    ) -> Completion:
        """``n`` completions from ``start(**kwargs, seed=...)`` streams; ``best_of`` > n keeps
        the n with the highest total log-probability."""
        n = 1 if n is None else n  # as OpenAI's API takes null
        check_range("n", n, 1, MAX_CHOICES)
        check_range("best_of", best_of, 1, MAX_CHOICES)
        best_of = best_of or n
        if not 1 <= n <= best_of:
            raise InvalidParameterError(f"need 1 <= n ({n}) <= best_of ({best_of})")
        seed = kwargs.pop("seed", None)
        check_range("seed", seed, 0, UINT32_MAX)
        want_logprobs = kwargs.get("logprobs")
        if best_of > n and want_logprobs is None:
            kwargs["logprobs"] = 0  # needed to rank the candidates
        seeds = choice_seeds(seed, best_of)
        if self.scheduler is None:
            # One slot: whole completions at once; concurrent callers wait their turn.
            with self.lock:
                streams = [list(start(seed=s, **kwargs)) for s in seeds]
        else:
            # Parallel slots: every candidate is queued first, so they generate side by side.
            pending: list[Stream[CompletionChunk]] = []
            try:
                for s in seeds:
                    pending.append(start(seed=s, **kwargs))
                streams = [list(stream) for stream in pending]
            finally:
                for stream in pending:
                    stream.cancel()  # a failure part-way must not leave candidates running
        candidates = [
            _choice(i, chunks, want_logprobs is not None) for i, chunks in enumerate(streams)
        ]
        if best_of > n:
            candidates.sort(key=lambda c: -sum(c[1]))
        kept = candidates[:n]
        choices = tuple(dataclasses.replace(c, index=i) for i, (c, _, _) in enumerate(kept))
        first = candidates[0][2]
        completion_tokens = sum(u.completion_tokens for _, _, u in candidates)
        usage = dataclasses.replace(first, completion_tokens=completion_tokens)
        return Completion(f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.model.path.name,
                          choices, usage)  # fmt: skip

    def evaluate(
        self, tokens: Sequence[int], all_logits: bool, after: int | None, slot: int | None
    ) -> np.ndarray:
        """Decode ``tokens`` after what a slot holds (its first ``after`` tokens), as a prompt
        that continues it (``Llama.evaluate``): the raw logits of the last of them, or of
        each. One slot runs it as a generation (it supersedes or waits for a stream); a
        parallel slot while it is idle, the other slots waiting meanwhile."""
        self._refuse_nested("evaluate()")
        check_generates(self.model, self.kv.context.params.embeddings)
        if self.model.encoder_decoder:
            raise InvalidParameterError(
                "evaluate() continues the decoder's memory; an encoder-decoder model's "
                "decoder follows its encoder's input: use create_completion()"
            )
        session = Session()
        if self.scheduler is None:
            if slot not in (None, 0):
                raise InvalidParameterError(f"slot {slot} does not exist: this Llama has slot 0")
            request = _evaluation(self.kv, tokens, all_logits, after)
            samplers = Samplers(self.model, SamplingOptions())  # samples nothing: raw logits
            try:
                steps = self._one_slot_steps(request, samplers, session, None)
                stopped = [step.finish_reason for step in steps][-1] == "cancelled"
            finally:
                samplers.close()
        else:
            if slot is None:
                raise InvalidParameterError(
                    "evaluate() on parallel slots needs slot=i: the slot whose memory it continues"
                )
            with self.scheduler.idle_slot(slot) as kv:
                request = _evaluation(kv, tokens, all_logits, after)
                stopped = not start_prompt(kv, request, session)
                kv.owner = None  # no generation goes on from it
        if stopped:
            raise DecodeAbortedError("evaluate() was cancelled (Llama.cancel(), or a newer "
                                     "generation superseded it)", 2)  # fmt: skip
        rows = session.prompt_logits
        if rows is None:  # another thread's tokens came between: some were not decoded
            raise ConcurrentUseError("the memory changed while evaluate() read it")
        return rows if all_logits else rows[0]

    def _refuse_nested(self, what: str) -> None:
        """From inside a generation (a custom sampler, logits processor or stopping criterion
        runs inside it), ``what`` would wait for itself on the engine thread, or supersede the
        generation it is called from on one slot."""
        if self.kv.context.held_here():
            raise ConcurrentUseError(
                f"{what} cannot start from inside another on the same Llama (a custom "
                "sampler, logits processor or stopping criterion runs inside it)"
            )

    def _one_slot_steps(
        self, request: Request, samplers: Samplers, session: Session, drafter: Drafter | None
    ) -> Iterator[Step]:
        """The generation on the one slot; it starts (superseding the stream before it, or
        waiting for its end) when the first chunk is asked for."""
        with self.lock:
            while not self.supersede and self._running is not None and not session.stopped():
                self._idle.wait(0.1)  # a session's deadline or cancel ends the wait too
            if not self.supersede and self._running is not None:
                yield Step("", None, "cancelled")  # stopped while waiting its turn
                return
            previous = self._session() if self._session else None
            if previous is not None:
                previous.superseded = True
            self._session = weakref.ref(session)
            self._running = session
        self.speculative_stats = stats = SpeculativeStats()
        try:
            for step in generate(self.kv, samplers, request, session, self.lock, drafter, stats):
                if step.finish_reason is not None:
                    self._ended(session)  # idle from the last step on, read or not
                yield step
        finally:
            self._ended(session)

    def _ended(self, session: Session) -> None:
        with self.lock:
            if self._running is session:  # not superseded by a newer generation
                self._running = None
                self._idle.notify_all()

    def _chunks(
        self,
        request: Request,
        steps: Iterator[Step],
        session: Session,
        echo_text: str | None,
        suffix: str,
        samplers: Samplers | None,
    ) -> Generator[CompletionChunk, None, None]:
        """Steps as completion chunks, after the prompt's (``echo_text``; None: no echo);
        ``samplers`` (if the engine does not own them) are freed at the end."""
        chunk_id, created, name = f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.model.path.name
        produced, offset = 0, len(echo_text or "")
        try:
            if echo_text is not None:
                prompt_logprobs = None
                if request.prompt_logprobs:
                    first = next(steps)  # decodes the prompt, reading its tokens' logprobs
                    steps = itertools.chain((first,), steps)
                    prompt_logprobs = _prompt_logprobs(self.model.vocab, request, session)
                # (an empty text has its logprobs too: a prompt of special tokens alone)
                if echo_text or prompt_logprobs is not None:
                    yield CompletionChunk(chunk_id, created, name, 0, echo_text,
                                          logprobs=prompt_logprobs)  # fmt: skip
            first_at = None
            for step in steps:
                now = step.at
                first_at = first_at or now
                produced += step.token is not None
                if step.end_token is not None:
                    session.end_token = step.end_token
                text = step.text
                if step.finish_reason not in (None, "cancelled"):
                    text += suffix
                started = session.prompt_started or first_at
                so_far = Usage(len(request.prompt), produced, session.reused,
                               first_at - started, now - first_at)  # fmt: skip
                tokens = () if step.token is None else (step.token,)
                logprobs = _step_logprobs(self.model.vocab, step, offset)
                offset += len(text)
                yield CompletionChunk(chunk_id, created, name, 0, text, step.finish_reason,
                                      so_far if step.finish_reason else None, tokens, logprobs,
                                      step.stop, session.slot, so_far)  # fmt: skip
        finally:
            session.cancel()  # a consumer that left early stops the generation at once
            if samplers is not None:
                # Refused while a Ctrl-C's traceback keeps the interrupted call's hold alive
                # (claims.py): the chain is then freed with its object.
                with contextlib.suppress(ConcurrentUseError):
                    samplers.close()


def _prompt_logprobs(vocab: Vocab, request: Request, session: Session) -> Logprobs | None:
    """Every prompt token with what the engine read, the first with None (nothing precedes
    it), so that the values line up with the prompt's tokens (lm-evaluation-harness reads
    them by position). The first token is shown as the echoed text has it (a BOS as
    nothing); offsets count the detokenized prompt."""
    values = session.prompt_logprobs
    if not values:
        return None
    decoder = vocab.decoder()
    first = decoder.feed(request.prompt[:1])
    offset, offsets = len(first), [0]
    rated = request.prompt[1 : len(values) + 1]
    for token in rated:
        offsets.append(offset)
        offset += len(decoder.feed((token,)))
    raws = (first.encode(), *(vocab.token_to_bytes(t, special=True) for t in rated))
    return Logprobs(
        tuple(raw.decode("utf-8", "backslashreplace") for raw in raws),  # token_to_piece's text
        (None, *(value for value, _ in values)),
        (None, *(top for _, top in values)),
        tuple(offsets),
        token_bytes=raws,
    )


def _step_logprobs(vocab: Vocab, step: Step, offset: int) -> Logprobs | None:
    if step.logprob is None or step.token is None:
        return None
    raw = vocab.token_to_bytes(step.token, special=True)
    return Logprobs(
        (raw.decode("utf-8", "backslashreplace"),),  # token_to_piece's text
        (step.logprob,),
        (step.top_logprobs or {},),
        (offset,),
        (step.top_ids,),
        (raw,),
        (step.top_bytes,),
    )


def _choice(
    index: int, chunks: list[CompletionChunk], keep_logprobs: bool
) -> tuple[CompletionChoice, tuple[float, ...], Usage]:
    """Fold a finished stream into a choice, its token log-probabilities, and its usage."""
    last = chunks[-1]
    assert last.finish_reason is not None and last.usage is not None
    parts = [c.logprobs for c in chunks if c.logprobs is not None]
    logprobs = Logprobs.join(parts) if parts else None
    choice = CompletionChoice(
        index,
        "".join(c.text for c in chunks),
        last.finish_reason,
        tuple(t for c in chunks for t in c.tokens),
        logprobs if keep_logprobs else None,
        last.stop_sequence,
        last.slot,
    )
    # (the echoed prompt's first token has no value: it ranks no candidate anyway)
    values = tuple(v for v in logprobs.token_logprobs if v is not None) if logprobs else ()
    return choice, values, last.usage


def _evaluation(kv: KvState, tokens: Sequence[int], all_logits: bool, after: int | None) -> Request:
    """The request that decodes ``tokens`` after ``kv``'s first ``after`` held tokens (all of
    them by default) and keeps the logits of the last, or of each, checked first."""
    vocab = kv.context.model.vocab
    new = vocab.check_tokens(tokens).tolist()
    if not new:
        raise InvalidParameterError("evaluate() needs at least one token")
    held = kv.held_tokens()
    if after is not None:
        check_range("after", after, 0, len(held))
        held = held[:after]  # the rest is dropped when the memory is prepared for them
    prompt = held + new
    start = len(held) if all_logits else len(prompt) - 1
    rows = len(prompt) - start
    # One row is what any decode returns; more are checked (reading /proc and the cgroups
    # takes ~0.25 ms, which a token-by-token loop would pay at every call).
    if rows > 1:
        needed, left = rows * 4 * vocab.n_tokens, host_memory_left()
        if needed > left.amount:
            raise InvalidParameterError(
                f"the logits of {rows} tokens take {needed / 2**20:,.0f} MiB, "
                f"more than this process may still use ({left.source} "
                f"{left.amount / 2**20:,.0f} MiB): evaluate fewer tokens at a time"
            )
    request = Request(prompt, max_tokens=0, logits_from=start)
    request.check(kv.context.n_ctx_seq)
    return request
