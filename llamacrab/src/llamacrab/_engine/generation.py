"""The generation loop: prompt decoding with KV prefix reuse, token sampling, stop handling."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from llamacrab._engine.cache import PromptCache
from llamacrab._engine.decode_watch import watched
from llamacrab._engine.lines import LineRules, check_line_rules
from llamacrab._engine.logprobs import PromptLogits, PromptLogprobs, PromptRows, token_logprobs
from llamacrab._engine.lora import LoraPlan, lora_plan
from llamacrab._engine.speculative import Drafter, SpeculativeStats
from llamacrab._engine.stop import StopMatcher
from llamacrab._exceptions import (
    ConcurrentUseError,
    ContextOverflowError,
    DecodeAbortedError,
    InvalidParameterError,
    LlamaError,
    StateError,
)
from llamacrab._field_types import check_field_types, stop_strings
from llamacrab._native.adapter import LoraAdapter
from llamacrab._native.batch import Batch
from llamacrab._native.claims import Flag
from llamacrab._native.context import Context
from llamacrab._native.custom_sampler import EndGeneration
from llamacrab._native.grammar_sampler import GrammarComplete
from llamacrab._native.mtmd import Chunks
from llamacrab._native.sampler import Samplers
from llamacrab._native.state import SavedState, StateCheckpoint
from llamacrab._native.vocab import Vocab
from llamacrab._types import FinishReason, common_prefix

log = logging.getLogger("llamacrab")


@dataclass
class Step:
    """What one generation step produced: new text, and the reason when it is the last."""

    text: str
    token: int | None
    finish_reason: FinishReason | None = None
    logprob: float | None = None
    top_logprobs: dict[str, float] | None = None
    stop: str | None = None  # the stop string that ended it (finish_reason "stop")
    top_ids: tuple[int, ...] = ()  # the ids of top_logprobs' tokens, in their order
    top_bytes: tuple[bytes, ...] = ()  # and their bytes
    end_token: int | None = None  # the end-of-generation token that ended it ("eos")
    # time.monotonic() when it was made: the engine thread of parallel slots makes steps
    # ahead of a consumer that may read them late, and usage times what the engine did.
    at: float = field(default_factory=time.monotonic)


# Stands for a position filled by an image or sound: never equal to a real token.
MEDIA_TOKEN = -1

# Checkpoints of a sliding-window model's windowed layers (a recurrent model's state), where
# llama-server takes them:
# 4 tokens before a prompt's end, so that the next prompt repeating it (a chat's next turn, a
# retry) finds one even where a template ends the two a little differently, and a micro-batch
# before that, for one that changes the prompt's last message. At most
# ContextParams.ctx_checkpoints per sequence, the newest.
CHECKPOINT_BEFORE_END = 4
# A checkpoint this close after another saves less decoding than it costs (its own decode
# split, a copy of the window): resuming from the earlier one decodes these few tokens again.
MIN_CHECKPOINT_GAP = 16


@dataclass(frozen=True)
class Request:
    """What to generate from a prompt. A multimodal prompt comes as ``media`` chunks, with
    ``prompt`` holding MEDIA_TOKEN for each position they take."""

    prompt: Sequence[int]
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: Sequence[str] = ()
    logprobs: int | None = None  # top alternatives to report per token; None: no logprobs
    media: Chunks | None = None
    lora: Mapping[LoraAdapter, float] | None = None  # None: the context's default adapters
    # The prompt's own tokens get logprobs too (echo): decoded whole, every row's logits read.
    prompt_logprobs: bool = False
    # Llama.evaluate: the raw logits of the prompt's tokens from this position on (the last
    # position: the last token's alone). None: none are kept.
    logits_from: int | None = None
    # Prompt positions to take checkpoints at too (sliding-window and recurrent models; KvState).
    checkpoint_at: tuple[int, ...] = ()
    # Line rules for code completion (lines.py): llama-server's n_indent and t_max_predict_ms.
    min_indent: int = 0
    stop_at_newline_after: float | None = None

    def check(self, n_ctx: int) -> None:
        check_field_types(self, skip={"prompt"})  # (tokens checked against the vocabulary)
        stop_strings(self.stop)
        check_line_rules(self.min_indent, self.stop_at_newline_after)
        if not self.prompt:
            raise InvalidParameterError("the prompt is empty (no tokens to decode)")
        if len(self.prompt) >= n_ctx:
            raise ContextOverflowError(
                f"the prompt has {len(self.prompt)} tokens; the context holds {n_ctx}",
                n_prompt_tokens=len(self.prompt), n_ctx=n_ctx,
            )  # fmt: skip
        if self.max_tokens is not None and self.max_tokens < 0:
            raise InvalidParameterError(f"max_tokens must be >= 0 or None, not {self.max_tokens}")
        if self.min_tokens < 0 or (
            self.max_tokens is not None and self.min_tokens > self.max_tokens
        ):
            raise InvalidParameterError(
                f"min_tokens {self.min_tokens} must be between 0 and max_tokens {self.max_tokens}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidParameterError(f"logprobs must be between 0 and 20, not {self.logprobs}")
        for position in self.checkpoint_at:
            if isinstance(position, bool) or not isinstance(position, int):
                raise InvalidParameterError(
                    f"checkpoint_at takes token positions, not {position!r}"
                )
            if not 0 < position < len(self.prompt):
                raise InvalidParameterError(
                    f"checkpoint_at {position} is not inside the prompt's {len(self.prompt)} tokens"
                )
        if self.prompt_logprobs and (self.logprobs is None or self.media is not None):
            raise InvalidParameterError(
                "log-probabilities of the prompt need logprobs= and a prompt of tokens, not media"
            )


class KvState:
    """The tokens one sequence of a context currently holds, to reuse a shared prompt prefix."""

    def __init__(self, context: Context, cache: PromptCache | None = None, seq_id: int = 0) -> None:
        self.context = context
        self.cache = cache
        self.seq_id = seq_id
        self.tokens: list[int] = []
        self.weights = context.weights_generation  # the adapters ``tokens`` were computed with
        # The memory's own changes known here (Context.memory_generation): any other (a user's
        # context.clear() or remove()) leaves ``tokens`` saying what the memory no longer holds.
        self.memory = context.memory_generation(seq_id)
        self.plan = LoraPlan(dict(context.lora_adapters))  # ... and which, by position
        # ... and all the memory depends on besides the tokens (Context.fingerprint); for a
        # loaded state, until a prompt finds the plan it stands for, the only thing known.
        self.computed_as = context.fingerprint(self.plan.adapters)
        self.plan_known = True
        self.checkpoints: list[StateCheckpoint] = []  # by n_tokens, each within ``tokens``
        self.batch = Batch(context.n_batch, seq_id + 1)
        # The generation these tokens belong to: only it may change the memory. A newer one
        # takes it over, a reset or a loaded state takes it from everyone.
        self.owner: object | None = None

    @property
    def max_batch(self) -> int:
        """The most tokens one decode takes."""
        return min(self.batch.capacity, self.context.max_decode)

    def snapshot(self, scope: str = "sequence") -> SavedState:
        if scope not in ("sequence", "context"):
            raise InvalidParameterError(f"scope must be 'sequence' or 'context', not {scope!r}")
        payload = self.context.state_view(self.seq_id if scope == "sequence" else None)
        model_id, n_ctx = self.context.model.identity, self.context.n_ctx
        # Changed by someone else: what it holds is not known (a load removes what it keeps).
        known = not self.memory_changed()
        tokens = tuple(self.tokens) if known else ()
        checkpoints = tuple(self.checkpoints) if scope == "sequence" and known else ()
        return SavedState(tokens, payload, model_id, n_ctx, scope, checkpoints, self.computed_as)

    def restore(self, state: SavedState) -> None:
        """Load a saved state (checked against this model and context). Its memory is reused
        only by prompts computed with what it was computed with: the same adapters and
        scales (or, for an aLoRA prompt, none up to its invocation), control vector and KV
        settings, which the state records."""
        if state.kv_fingerprint is None:
            raise StateError(
                "this state records no KV fingerprint (the adapters and settings its memory was "
                "computed with): saved by a llamacrab before state format 5, or built without "
                "one; save it again"
            )
        self._load(state)
        self.computed_as = state.kv_fingerprint
        self.plan_known = False

    def _load(self, state: SavedState) -> None:
        """Put the state into the memory; what it was computed with is the caller's to say."""
        if state.model_id != self.context.model.identity:
            raise StateError("this state was saved from a different model")
        # One sequence holds n_ctx_seq tokens (all of n_ctx but with parallel slots).
        n_ctx = self.context.n_ctx if state.scope == "context" else self.context.n_ctx_seq
        if len(state.tokens) >= n_ctx:
            where = "the context" if state.scope == "context" else "a sequence of this context"
            raise StateError(f"this state holds {len(state.tokens)} tokens; {where} {n_ctx}")
        if state.scope == "context" and state.n_ctx != self.context.n_ctx:
            raise StateError(
                f"a whole-context state from n_ctx {state.n_ctx} cannot load into "
                f"{self.context.n_ctx}"
            )
        self.owner = None
        self._truncate(0)  # first: interrupted from here on, less is known, never more
        try:
            seq_id = self.seq_id if state.scope == "sequence" else None
            self.context.load_state_bytes(state.payload, seq_id)
        except BaseException:
            self.forget() if state.scope == "sequence" else self.reset()
            raise
        self.checkpoints = list(state.checkpoints)
        self.tokens.extend(state.tokens)
        self.weights = self.context.weights_generation
        self._changed_here()

    def _computed_with(self, plan: LoraPlan) -> None:
        """The memory counts as computed with ``plan`` (and the present control vector)."""
        self.plan = plan
        self.computed_as = self.context.fingerprint(plan.adapters, plan.start)
        self.plan_known = True

    def _match_loaded(self, plan: LoraPlan) -> None:
        """A loaded state's memory stands for ``plan`` or the base model (``_loaded_plan``);
        else nothing of it is reusable."""
        found = self._loaded_plan(plan)
        if found is None:
            self._truncate(0)  # (prepare removes it from the memory)
        self._computed_with(plan if found is None else found)

    def _loaded_plan(self, plan: LoraPlan) -> LoraPlan | None:
        """What a loaded state's memory was computed with: ``plan``, or the base model (an
        aLoRA prompt reuses that up to its invocation); None: neither."""
        for candidate in (plan, LoraPlan()):
            if self.context.fingerprint(candidate.adapters, candidate.start) == self.computed_as:
                return candidate
        return None

    def plan_for(self, prompt: Sequence[int], lora: Mapping[LoraAdapter, float] | None) -> LoraPlan:
        """The adapters ``prompt`` is computed with, by position, with ``lora`` (None: the
        context's default set, which every sequence shares); InvalidParameterError for
        several aLoRA adapters. For an aLoRA adapter it searches the prompt: make it once
        per prompt."""
        return lora_plan(self.context.lora_adapters if lora is None else lora, prompt)

    def reusable(self, prompt: Sequence[int], plan: LoraPlan) -> int:
        """How many leading tokens of ``prompt`` this memory holds computed as the prompt
        would be with ``plan`` (``plan_for``'s), as ``prepare`` counts them before a prompt
        cache is asked: a slot holding a longer prefix under other adapters keeps none of it."""
        if self.stale():
            return 0
        held = self.plan if self.plan_known else self._loaded_plan(plan)
        if held is None:
            return 0
        return int(min(common_prefix(self.tokens, prompt), held.reusable(plan)))

    def _restore_from_cache(self, prompt: Sequence[int], plan: LoraPlan) -> None:
        if self.cache is None:
            return
        # An aLoRA request reuses the base model's KV of the prompt before its invocation.
        plans = [plan] if plan.base_until in (0, math.inf) else [plan, LoraPlan()]
        for candidate in plans:
            fingerprint = self.context.fingerprint(candidate.adapters, candidate.start)
            try:
                found = self.cache.longest_prefix(prompt, fingerprint)
            except Exception:  # a disk or database failure: a miss, not a failed generation
                log.warning("prompt cache lookup failed; treated as a miss", exc_info=True)
                return
            usable = common_prefix(self.tokens, prompt)
            usable = int(min(usable, self.plan.reusable(plan)))
            if found is None or min(found[0], candidate.reusable(plan)) <= usable:
                continue
            try:
                self._load(found[1])  # computed with ``candidate``: found by its fingerprint
            except StateError as error:  # e.g. a shared cache with states too long for it
                warnings.warn(f"prompt cache entry not used: {error}", stacklevel=4)
                continue
            self._computed_with(candidate)
            return

    def remember(self) -> None:
        """Store the current state in the prompt cache, if there is one. Not after media: their
        positions hold MEDIA_TOKEN, which cannot tell one image from another. A failure to save
        (disk full, database locked) is logged and the save skipped: the generation stands.
        Nor when the adapters changed since: the memory holds KV of the older weights."""
        if (
            self.cache is not None
            and self.tokens
            and not self.context.encoder_decoder  # its memory depends on the encoder's input
            and MEDIA_TOKEN not in self.tokens
            and not self.stale()
        ):
            try:
                self.cache.store(self.snapshot(), self.computed_as)
            except Exception:
                log.warning("prompt cache save failed; skipped", exc_info=True)

    def prepare(
        self, prompt: Sequence[int], plan: LoraPlan, reuse: bool = True, most: int | None = None
    ) -> int:
        """Drop what the new prompt does not share (tokens, and the adapters they were
        computed with: ``plan``, ``plan_for``'s); return how many prompt tokens to keep (none
        without ``reuse``: every prompt token is decoded again; at ``most`` that many, where
        the rows after them must be computed)."""
        if self.stale():
            self.forget()  # computed with adapters since replaced, or changed: none is reusable
        if not self.plan_known:
            self._match_loaded(plan)
        if reuse:
            self._restore_from_cache(prompt, plan)
        keep = common_prefix(self.tokens, prompt) if reuse else 0
        keep = int(min(keep, self.plan.reusable(plan)))
        keep = min(keep, len(prompt) - 1)  # the last prompt token is decoded again for its logits
        keep = keep if most is None else min(keep, most)
        # What the memory holds, not what ``tokens`` says: an exception landing between a
        # change to the memory and this bookkeeping (a Ctrl-C) leaves them apart, and
        # llama.cpp refuses a batch that does not follow the sequence's last position.
        held = self.context.positions(self.seq_id)
        end = 0 if held is None else held[1] + 1
        keep = min(keep, end)
        self._computed_with(plan)
        if keep < end and not self.context.remove(self.seq_id, keep, -1):
            keep = self._rewind(keep)
        self._changed_here()
        self._truncate(keep)
        return keep

    def _rewind(self, keep: int) -> int:
        """The memory cannot go on at ``keep`` (a windowed layer lost the window before it):
        go back to the newest checkpoint at or before it, or start over. How many tokens are
        left."""
        checkpoint = next((c for c in reversed(self.checkpoints) if c.n_tokens <= keep), None)
        if checkpoint is not None:
            n = checkpoint.n_tokens
            try:
                self.context.load_state_bytes(checkpoint.payload, self.seq_id, partial=True)
                # Its cells must end where it says (a state from elsewhere may lie): the next
                # token goes at n, and llama.cpp refuses a batch that does not follow them.
                held = self.context.positions(self.seq_id)
                if held is not None and held[1] == n - 1 and self.context.remove(self.seq_id, n):
                    return n
            except StateError:
                log.warning("a checkpoint was not usable; decoding the prompt again", exc_info=True)
        self.forget()
        return 0

    def stale(self) -> bool:
        """Whether ``tokens`` may no longer say what the memory holds: the adapters changed
        since they were computed, or someone else changed the memory (context.clear(), say)."""
        return self.weights != self.context.weights_generation or self.memory_changed()

    def held_tokens(self) -> list[int]:
        """A copy of ``tokens``, or none once someone else changed the memory (a user's
        context.clear(), say): what it holds then is not known, and no prompt reuses it."""
        return [] if self.memory_changed() else list(self.tokens)

    def memory_changed(self) -> bool:
        """Whether the memory was changed since the engine last did (Context's KV methods)."""
        return self.memory != self.context.memory_generation(self.seq_id)

    def _changed_here(self) -> None:
        """The engine changed the memory, and ``tokens`` says what it holds now."""
        self.memory = self.context.memory_generation(self.seq_id)

    def _truncate(self, keep: int) -> None:
        del self.tokens[keep:]
        self.checkpoints = [c for c in self.checkpoints if c.n_tokens <= keep]

    def checkpoint_positions(self, request: Request) -> tuple[int, ...]:
        """Where decoding the request's prompt (after what this sequence holds) stops for
        checkpoints, in order: only for sliding-window and recurrent models, only ahead, for a
        sliding-window one only where the sequence may outgrow the window (before that, the
        window holds every position), and none within MIN_CHECKPOINT_GAP tokens after
        another."""
        context = self.context
        end = len(request.prompt) - CHECKPOINT_BEFORE_END
        longest = len(request.prompt) + (
            context.n_ctx_seq if request.max_tokens is None else request.max_tokens
        )
        fits_window = not context.recurrent and longest <= context.n_swa
        if not context.needs_checkpoints or fits_window or context.params.ctx_checkpoints == 0:
            return ()
        wanted = sorted({*request.checkpoint_at, end - context.n_ubatch, end})
        taken: list[int] = []
        last = max((c.n_tokens for c in self.checkpoints), default=-MIN_CHECKPOINT_GAP)
        for position in wanted:
            if position > len(self.tokens) and position - last >= MIN_CHECKPOINT_GAP:
                taken.append(position)
                last = position
        return tuple(taken)

    def take_checkpoint(self) -> None:
        """Keep the windowed layers' cells as they are now (see ``StateCheckpoint``); one that
        llama.cpp cannot save is skipped: it only saves decoding later."""
        try:
            payload = self.context.state_view(self.seq_id, partial=True)
        except StateError:
            log.warning("a checkpoint could not be saved; skipped", exc_info=True)
            return
        here = len(self.tokens)
        self.checkpoints = [c for c in self.checkpoints if c.n_tokens < here]  # replaced if here
        self.checkpoints.append(StateCheckpoint(here, payload))
        del self.checkpoints[: max(0, len(self.checkpoints) - self.context.params.ctx_checkpoints)]

    def reset(self) -> None:
        """Clear the whole memory (embeddings reuse it with other sequences, too)."""
        self.context.clear()  # first: refused (a call in flight), it changes nothing
        self.owner = None
        self._truncate(0)
        self.weights = self.context.weights_generation
        self._changed_here()

    def lend(self) -> None:
        """The memory is about to hold other sequences (embedding batches): nothing in it is
        reusable any more, and no paused generation may go on with it (nor sample inside the
        graph: those batches read every output row)."""
        self.owner = None
        self._truncate(0)
        self.context.clear_graph_samplers()

    def forget(self) -> None:
        """Clear this sequence only; the other sequences of the context keep theirs."""
        self.context.remove(self.seq_id, 0, -1)
        self._truncate(0)
        self.weights = self.context.weights_generation
        self._changed_here()

    def decode_prompt(
        self,
        prompt: Sequence[int],
        keep: int,
        stopped: Callable[[], bool] | None = None,
        scores: PromptRows | None = None,
        checkpoints: Sequence[int] = (),
    ) -> bool:
        """Decode the prompt after ``keep`` in chunks (none crossing the position where the
        adapters start to apply, nor ``checkpoints``, where they are taken); False when
        ``stopped()`` is true before a chunk (what was decoded stays in memory, a prefix for
        the next prompt); a chunk armed after it turned true raises DecodeAbortedError.
        ``scores`` reads every row's logits after each chunk (chunks small enough for
        that)."""
        todo = np.asarray(prompt[keep:], dtype=np.int32)
        most = self.max_batch if scores is None else min(self.max_batch, scores.max_rows)
        start = 0
        while start < len(todo):
            if stopped is not None and stopped():
                return False
            end = min(start + most, len(todo))
            for boundary in (self.plan.start, *checkpoints):
                ahead = boundary - len(self.tokens)
                if 0 < ahead < end - start:
                    end = start + int(ahead)
            chunk = todo[start:end]
            position = len(self.tokens)
            self.batch.set(chunk, position, self.seq_id, end >= len(todo), scores is not None)
            self.decode_tracked(chunk.tolist(), stopped)
            if scores is not None:
                scores.read(self.context, position, len(chunk))
            if len(self.tokens) in checkpoints:
                self.take_checkpoint()
            start = end
        return True

    def encode_prompt(
        self,
        prompt: Sequence[int],
        lora: Mapping[LoraAdapter, float] | None,
        stopped: Callable[[], bool] | None,
    ) -> bool:
        """An encoder-decoder model's prompt (T5): the encoder reads all of it, then the
        decoder's memory starts over from the model's decoder start token. Nothing is reused:
        what the decoder held attended to another input. False as ``decode_prompt`` says."""
        start = self.context.model.decoder_start_token
        self.prepare([start], self.plan_for([start], lora), reuse=False)
        if stopped is not None and stopped():
            return False
        with Batch(len(prompt), self.seq_id + 1) as batch:
            batch.set(np.asarray(prompt, dtype=np.int32), 0, self.seq_id, logits_all=True)
            self.context.encode(batch, self.plan.at(0), stopped)
        return self.decode_prompt([start], 0, stopped)

    def decode_media(
        self,
        chunks: Chunks,
        lora: Mapping[LoraAdapter, float] | None = None,
        stopped: Callable[[], bool] | None = None,
    ) -> None:
        """Evaluate a multimodal prompt from the start of this sequence (no prefix reuse),
        with ``lora`` (None: the default adapters; an aLoRA adapter is not invoked);
        ``stopped`` as ``Projector.evaluate`` takes it."""
        self.forget()
        self._computed_with(lora_plan(self.context.lora_adapters if lora is None else lora, ()))
        self.context.use_lora(self.plan.adapters)
        try:
            n_past = chunks.projector.evaluate(self.context, chunks, 0, self.seq_id, stopped)
        except BaseException:
            self.forget()
            raise
        self.tokens.extend([MEDIA_TOKEN] * n_past)

    def decode_all(self, tokens: list[int]) -> None:
        """Decode tokens with logits for every one (speculative verification)."""
        tokens_array = np.asarray(tokens, dtype=np.int32)
        self.batch.set(tokens_array, len(self.tokens), self.seq_id, logits_all=True)
        self.decode_tracked(tokens)

    def drop_last(self, count: int) -> None:
        """Remove the last ``count`` tokens from the memory (rejected drafts)."""
        keep = len(self.tokens) - count
        known = not self.memory_changed()
        if not self.context.remove(self.seq_id, keep, -1):
            raise StateError("this model's memory cannot drop tokens: speculation is not possible")
        if known:  # else another change still shows
            self._changed_here()
        self._truncate(keep)

    def decode_one(self, token: int) -> None:
        self.batch.set_one(token, len(self.tokens), self.seq_id)
        self.decode_tracked([token])

    def decode_tracked(self, tokens: list[int], stopped: Callable[[], bool] | None = None) -> None:
        try:
            self.context.decode(self.batch, self.plan.at(len(self.tokens)), stopped)
        except BaseException:
            # A failed decode may leave part of the batch in memory. Refused while a Ctrl-C's
            # traceback keeps the interrupted call's hold alive (claims.py): the next prompt's
            # prepare() removes whatever the memory holds past its tokens anyway.
            with contextlib.suppress(ConcurrentUseError):
                self.reset()
            raise
        self.tokens.extend(tokens)


class Session:
    """One generation. A newer session on the same Llama supersedes it (it ends "cancelled");
    ``cancel()`` ends it from any thread, and so do passing its ``timeout`` (seconds) and
    setting the caller's ``external`` event (which may stop several sessions at once)."""

    def __init__(
        self, timeout: float | None = None, external: threading.Event | None = None
    ) -> None:
        if timeout is not None and not timeout > 0:  # NaN too: it would never pass
            raise InvalidParameterError(f"timeout must be > 0 seconds, not {timeout}")
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.external = external
        self.superseded = False
        self.cancelled = Flag()
        self.wake: Callable[[], None] | None = None  # tells a scheduler to look at it now
        self.reused = 0  # prompt tokens found in memory instead of decoded
        self.slot: int | None = None  # the sequence (parallel slot) that runs it, once one does
        self.prompt_started: float | None = None  # time.monotonic() when its prompt was begun
        # With Request.prompt_logprobs: (logprob, top alternatives) of prompt tokens 1, 2, ...
        self.prompt_logprobs: list[tuple[float, dict[str, float]]] = []
        # With Request.logits_from: the raw logits of those prompt tokens, a row each (None
        # until all of them were decoded).
        self.prompt_logits: np.ndarray | None = None
        # The end-of-generation token it ended on (of several, <end_of_turn> or <eos>), if any.
        self.end_token: int | None = None

    def cancel(self) -> None:
        self.cancelled.set()
        wake = self.wake  # read once: the engine may clear it meanwhile
        if wake is not None:
            wake()

    def stopped(self) -> bool:
        """Cancelled, superseded, or past its deadline."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.cancelled.set()
        if self.external is not None and self.external.is_set():
            self.cancelled.set()
        return self.superseded or self.cancelled.is_set()


def generate(
    kv: KvState,
    samplers: Samplers,
    request: Request,
    session: Session,
    lock: threading.RLock,
    drafter: Drafter | None = None,
    stats: SpeculativeStats | None = None,
) -> Iterator[Step]:
    """Yield Steps until one has a finish reason. Each step holds ``lock`` while it works in
    llama.cpp (never while it yields), so concurrent generations never interleave there."""
    request.check(kv.context.n_ctx)
    try:
        with lock:
            started = _start(kv, request, session, samplers)
        if not started:
            yield Step("", None, "cancelled")
            return
        stepper = _Stepper(kv, samplers, request, drafter, stats or SpeculativeStats())
        produced = 0
        while True:
            with lock:
                step = _step(kv, session, stepper, produced)
            produced += 1
            yield step
            if step.finish_reason is not None:
                return
    finally:
        # A context closed or busy meanwhile: its next decode drops a closed chain itself.
        with lock, contextlib.suppress(LlamaError):
            samplers.unbind()


def _start(kv: KvState, request: Request, session: Session, samplers: Samplers) -> bool:
    """Put the prompt in memory and take the memory over; False when the session stopped
    first. One superseded before it starts must not touch the memory: it is the newer one's.
    The samplers go into the compute graph (or out of it) before the prompt's last decode."""
    if session.stopped():
        return False
    session.slot = kv.seq_id
    samplers.bind(kv.context, kv.seq_id)
    return start_prompt(kv, request, session)


def start_prompt(kv: KvState, request: Request, session: Session) -> bool:
    """Decode the request's prompt into ``kv``'s memory (its media, an encoder-decoder's
    input), reading what the request asks of its rows; ``kv`` is then the session's. False when
    the session stopped first. The caller holds the lock that serializes the context's users."""
    kv.owner = None  # the memory changes now: the generation before may not touch it again
    session.prompt_started = time.monotonic()
    try:
        # A prompt's chunk (or its media's encode) may take seconds: cancel(), the timeout and
        # the caller's event abort the call in progress, not only the next one.
        with watched(kv.context, (session,)) as watch:
            session.wake = watch.poke
            if request.media is not None:
                kv.decode_media(request.media, request.lora, watch.stopped)
            elif kv.context.encoder_decoder:
                if not encode_request(kv, request, watch.stopped):
                    return False
            else:
                scores: PromptRows | None = None
                last = len(request.prompt) - 1
                if request.prompt_logprobs:
                    logprobs = PromptLogprobs(
                        request.prompt, request.logprobs or 0, kv.context.n_vocab
                    )
                    session.prompt_logprobs, scores = logprobs.values, logprobs
                elif request.logits_from is not None and request.logits_from < last:
                    scores = PromptLogits(
                        request.logits_from, len(request.prompt), kv.context.n_vocab
                    )
                plan = kv.plan_for(request.prompt, request.lora)
                reuse = not request.prompt_logprobs  # those rate every prompt token
                session.reused = kv.prepare(request.prompt, plan, reuse, request.logits_from)
                checkpoints = kv.checkpoint_positions(request)
                if not kv.decode_prompt(
                    request.prompt, session.reused, watch.stopped, scores, checkpoints
                ):
                    return False
                if request.logits_from == last:  # the last row, which every prompt returns
                    session.prompt_logits = kv.context.logits(-1).copy()[np.newaxis]
                elif isinstance(scores, PromptLogits) and scores.filled == len(request.prompt):
                    session.prompt_logits = scores.rows
    except DecodeAbortedError:
        return False
    finally:
        session.wake = None
    kv.owner = session
    return True


def encode_request(kv: KvState, request: Request, stopped: Callable[[], bool]) -> bool:
    """An encoder-decoder model's prompt (``KvState.encode_prompt``); False when ``stopped``
    first."""
    if request.prompt_logprobs:
        raise InvalidParameterError(
            "an encoder-decoder model's decoder does not rate the prompt (its encoder reads "
            "it): prompt logprobs need a decoder-only model"
        )
    return kv.encode_prompt(request.prompt, request.lora, stopped)


def _step(kv: KvState, session: Session, stepper: _Stepper, produced: int) -> Step:
    """The next step, under the lock. A generation that no longer owns the memory ends
    without touching it: the positions its drafts held may hold another generation's tokens.
    One whose adapters changed since its prompt ends too, and so does one whose memory was
    changed under it (context.clear(), say): its sequence is forgotten."""
    owner = kv.owner is session
    # What it would add next mixes two sets of weights, or follows what the memory lost.
    if not owner or kv.stale() or session.stopped():
        if owner and kv.memory_changed():
            kv.forget()  # what ``tokens`` says it holds is gone: nothing of it is reusable
        elif owner:
            stepper.settle()
        return Step(stepper.emitter.stops.flush(), None, "cancelled")
    if stepper.emitter.is_last(produced):
        stepper.settle()
        step = Step(stepper.emitter.rest(), None, "length")
    else:
        step = stepper.next(produced)
    if step.finish_reason not in (None, "cancelled"):
        kv.remember()  # before the last yield: a consumer may stop right after it
    return step


class Emitter:
    """Turns sampled tokens into a request's text: incremental detokenizing, stop strings,
    log-probabilities, end of generation. Shared by every generation loop."""

    def __init__(self, vocab: Vocab, request: Request) -> None:
        self.vocab, self.request = vocab, request
        self.decoder = vocab.decoder()
        self.stops = StopMatcher(request.stop)
        self.lines = LineRules(request.min_indent, request.stop_at_newline_after)

    def sample(self, context: Context, samplers: Samplers, index: int, produced: int) -> Step:
        """Sample from output ``index``; an end-of-generation token ends with "eos" (it is not
        output), as a complete grammar does on a vocabulary without one; a stop string, a
        Python sampler's EndGeneration, or a complete grammar where logit_bias bans every end
        token (llama-server's ignore_eos) with "stop"; a line rule (min_indent,
        stop_at_newline_after) with "length"."""
        request = self.request
        try:
            token = samplers.sample(
                context, end_allowed=produced >= request.min_tokens, index=index
            )
        except EndGeneration:  # a Python sampler's stop rule: this token is not output
            return Step(self.rest(), None, "stop")
        except GrammarComplete as complete:  # where an end token would be the only pick:
            # with none in the vocabulary "eos"; with every one banned none may end it, "stop".
            return Step(self.rest(), None, "stop" if complete.end_banned else "eos")
        logprob, top = None, None
        top_ids: tuple[int, ...] = ()
        top_bytes: tuple[bytes, ...] = ()
        if request.logprobs is not None:
            logprob, top, top_ids, top_bytes = token_logprobs(
                context, token, request.logprobs, index
            )
        if self.vocab.is_eog(token):
            return Step(self.rest(), None, "eos", end_token=token)
        text, ended = self.lines.token(self.stops.push(self.decoder.feed([token])))
        step = Step(text, token, None, logprob, top, top_ids=top_ids, top_bytes=top_bytes)
        if ended:  # a line rule: llama-server's "limit"
            if not self.stops.stopped:
                step.text += self.rest()  # what a partial stop string held back
            step.finish_reason = "length"
        elif self.stops.stopped:
            step.finish_reason, step.stop = "stop", self.stops.matched
        return step

    def rest(self) -> str:
        """Everything held back, at the end of a generation that no stop string ended."""
        text = self.stops.push(self.decoder.flush())
        return self.lines.cut(text if self.stops.stopped else text + self.stops.flush())

    def is_last(self, produced: int) -> bool:
        """Whether ``produced`` tokens reach max_tokens: nothing more is decoded."""
        return self.request.max_tokens is not None and produced >= self.request.max_tokens


class _Stepper:
    """Samples one token per call. After a decode of [token, draft...], the next samples read
    the outputs in order; a sample equal to the next draft needs no decode of its own."""

    def __init__(
        self,
        kv: KvState,
        samplers: Samplers,
        request: Request,
        drafter: Drafter | None,
        stats: SpeculativeStats,
    ) -> None:
        self.kv, self.samplers, self.request = kv, samplers, request
        self.drafter, self.stats = drafter, stats
        self.emitter = Emitter(kv.context.model.vocab, request)
        self.index = -1  # output of the last decode to sample from
        self.drafts: list[int] = []  # decoded after that output, not yet confirmed
        self.drafted = 0  # size of the current draft, for the drafter's feedback
        self.decode_seconds = 0.0  # of the last decode
        self.pending: int | None = None  # sampled and handed out, decoded by the next call

    def settle(self) -> None:
        """Forget unconfirmed drafts: out of the memory, and reported to the drafter."""
        if self.drafter is not None and self.drafted:
            accepted = self.drafted - len(self.drafts)
            self.drafter.feedback(self.drafted, accepted, self.decode_seconds)
            self.drafted = 0
        if self.drafts:
            self.kv.drop_last(len(self.drafts))
            self.drafts = []

    def next(self, produced: int) -> Step:
        # A token is handed out as soon as it is sampled; its decode waits for this call, so
        # the first token costs the prompt alone, as native streaming does.
        if self.pending is not None:
            sampled, self.pending = self.pending, None
            try:
                self._decode(sampled, produced - 1)
            except DecodeAbortedError:
                return Step(self.emitter.stops.flush(), None, "cancelled")
        step = self.emitter.sample(self.kv.context, self.samplers, self.index, produced)
        token = step.token
        if token is not None and self.drafts and self.drafts[0] == token:
            self.drafts.pop(0)  # a confirmed draft: already decoded
            self.stats.accepted += 1
            self.index += 1
            if step.finish_reason is not None:
                self.settle()
            return step
        self.settle()
        if token is None or step.finish_reason is not None or self.emitter.is_last(produced + 1):
            return step  # at max_tokens, "length" is reported by the next step
        if len(self.kv.tokens) + 1 >= self.kv.context.n_ctx:
            step.text += self.emitter.rest()
            step.finish_reason = "length"
            return step
        self.pending = token
        return step

    def _decode(self, token: int, produced: int) -> None:
        started = time.perf_counter()  # drafting counts too: a draft model is not free
        drafts: list[int] = []
        if self.drafter is not None:
            # The token and its drafts are decoded in one batch, within the context.
            room = min(self.kv.context.n_ctx - len(self.kv.tokens) - 2, self.kv.max_batch - 1)
            left = (
                room if self.request.max_tokens is None else self.request.max_tokens - produced - 1
            )
            limit = max(0, min(room, left))
            proposed = self.drafter.draft([*self.kv.tokens, token], limit)
            # A drafter of the user's may return anything: ids of the vocabulary, at most limit.
            drafts = self.kv.context.model.vocab.check_tokens(list(proposed)[:limit]).tolist()
        if drafts:
            self.kv.decode_all([token, *drafts])
            self.stats.drafted += len(drafts)
        else:
            self.kv.decode_one(token)
        self.decode_seconds = time.perf_counter() - started
        if self.drafter is not None and not drafts:
            self.drafter.plain(self.decode_seconds)
        self.drafts, self.drafted, self.index = drafts, len(drafts), 0
