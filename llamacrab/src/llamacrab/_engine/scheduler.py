"""Parallel slots: one engine thread runs every generation of a context together. Each slot is a
sequence of the context with its own sampler chain and prompt prefix; each step decodes the next
token of every generating slot plus pending prompt chunks in one ``llama_decode`` (continuous
batching)."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from llamacrab._engine.cache import PromptCache
from llamacrab._engine.decode_watch import DecodeWatch, watched
from llamacrab._engine.generation import Emitter, KvState, Request, Session, Step, encode_request
from llamacrab._engine.logprobs import PromptLogprobs, prompt_rows_per_decode
from llamacrab._engine.lora import LoraPlan
from llamacrab._exceptions import (
    ClosedHandleError,
    ConcurrentUseError,
    ContextError,
    DecodeAbortedError,
    InvalidParameterError,
    LlamaError,
    QueueFullError,
    StateError,
)
from llamacrab._native.adapter import LoraAdapter
from llamacrab._native.batch import Batch
from llamacrab._native.context import Context
from llamacrab._native.fork import reset_in_child
from llamacrab._native.sampler import Samplers

# How long an idle engine waits for the next request of a burst, and for the whole burst.
GATHER_SECONDS = 0.003
GATHER_LIMIT = 0.010
# An idle engine looks at its queue this often even unnotified: a notification a Ctrl-C
# swallowed (it can land inside Condition.notify) delays a job by this, never for ever.
_IDLE_POLL_SECONDS = 0.5


@dataclass(eq=False)
class _Job:
    request: Request
    samplers: Samplers
    session: Session
    emitter: Emitter
    steps: queue.SimpleQueue[Step | BaseException] = field(default_factory=queue.SimpleQueue)
    todo: list[int] | None = None  # tokens to decode next; None until its slot is prepared
    index: int | None = None  # where the last batch holds its logits
    checkpoints: tuple[int, ...] = ()  # positions its prompt stops at for checkpoints
    # Its prompt's adapters by position, made once when it is admitted (the adapters cannot
    # change while it waits or runs); None: the request is refused when its slot prepares.
    plan: LoraPlan | None = None
    # With Request.prompt_logprobs: every row of its prompt chunks is read after their decode.
    scores: PromptLogprobs | None = None
    produced: int = 0

    def finish(self, last: Step | BaseException) -> None:
        """Hand over the last step (or the error); the engine owns the samplers, so it frees
        them (a consumer may leave while a step is still using them). The step goes out even
        when the close is refused (a garbage-collected stream's finalizer cancelling it while
        this thread is inside a sampler call): its client waited for ever, and so did the
        server's exit; the chain's own finalizer frees it later."""
        try:
            self.samplers.close()
        finally:
            self.steps.put(last)


class _Slot:
    def __init__(self, kv: KvState) -> None:
        self.kv = kv
        self.job: _Job | None = None


class Scheduler:
    """Runs the generations submitted to it on ``n_slots`` sequences of ``context``; at most
    ``max_queue`` more wait for a free slot (QueueFullError beyond that). ``lock`` is held while
    the engine works in llama.cpp, so other users of the context wait between steps. Whoever
    takes both takes ``lock`` before ``_mutex``."""

    def __init__(
        self,
        context: Context,
        lock: threading.RLock,
        n_slots: int,
        max_queue: int,
        cache: PromptCache | None = None,
    ) -> None:
        self.context, self.lock, self.max_queue = context, lock, max_queue
        self.limit = context.n_ctx_seq  # tokens one slot may hold
        self.slots = [_Slot(KvState(context, cache, i)) for i in range(n_slots)]
        self.batch = Batch(context.max_decode, n_slots)
        self.waiting: deque[_Job] = deque()
        self._unclosed: list[Samplers] = []  # of jobs ended off the engine thread (see below)
        self._turn = 0  # which slot's adapters the next batch uses first (round robin)
        # Entered as ``with self._mutex`` (the C lock: atomic), never through the Condition,
        # whose Python __enter__ a Ctrl-C can leave holding it; waits poll (claims.py).
        self._mutex = threading.RLock()
        self._cond = threading.Condition(self._mutex)
        reset_in_child(self._cond)
        self._closed = False
        # The decode (or image or sound encode) in flight, aborted when all of its jobs stop.
        self._watch: DecodeWatch | None = None
        context.add_weights_guard(self)
        self._thread = threading.Thread(target=self._run, name="llamacrab-engine", daemon=True)
        try:
            self._thread.start()
        except RuntimeError as error:  # no thread to be had (a pids limit): nothing started
            self.batch.close()
            raise ContextError(
                f"cannot start the engine thread of {n_slots} parallel slots: {error}"
            ) from None

    # -- what clients call ---------------------------------------------------------------------

    def submit(self, request: Request, samplers: Samplers, session: Session) -> Iterator[Step]:
        """Queue a generation; iterate the result for its steps. Closing the iterator early
        cancels it. Raises QueueFullError at once when the queue is full. Once queued, the
        engine owns ``samplers`` and closes them when the job ends."""
        request.check(self.limit)
        job = _Job(request, samplers, session, Emitter(self.context.model.vocab, request))
        if request.prompt_logprobs:
            job.scores = PromptLogprobs(request.prompt, request.logprobs or 0, self.context.n_vocab)
            session.prompt_logprobs = job.scores.values
        with self._mutex:
            if self._closed:
                raise ClosedHandleError("this Llama is closed")
            if len(self.waiting) >= self.max_queue:
                raise QueueFullError(
                    f"all {len(self.slots)} slots are busy and {len(self.waiting)} requests are "
                    "waiting (the queue limit)"
                )
            self.waiting.append(job)
            session.wake = self._wake
            self._cond.notify()
        return _results(job, self.context)

    @property
    def busy_slots(self) -> int:
        return sum(slot.job is not None for slot in self.slots)

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    def cancel_all(self) -> None:
        with self._mutex:
            for job in [*self.waiting, *(s.job for s in self.slots if s.job)]:
                job.session.cancelled.set()
            self._poke()  # the step in progress is theirs: it ends now
            self._cond.notify()

    def _check_slot(self, index: int) -> None:
        if not 0 <= index < len(self.slots):
            raise InvalidParameterError(
                f"slot {index} does not exist: this Llama has slots 0 to {len(self.slots) - 1}"
            )

    def describe(self) -> list[tuple[bool, int]]:
        """Each slot: whether it generates now, and how many tokens its memory holds."""
        with self._mutex:
            return [(slot.job is not None, len(slot.kv.held_tokens())) for slot in self.slots]

    def held_tokens(self, index: int) -> list[int]:
        """A copy of the tokens slot ``index``'s memory holds (a step may be under way)."""
        self._check_slot(index)
        with self._mutex:
            return self.slots[index].kv.held_tokens()

    @contextlib.contextmanager
    def idle_slot(self, index: int) -> Iterator[KvState]:
        """Slot ``index``'s memory, to save, load or clear while the other slots wait: no step
        runs and no job enters a slot until the block ends. A slot with a job (generating, or
        admitted and about to) raises ConcurrentUseError: its memory changes with each step."""
        self._check_slot(index)
        with self.lock, self._mutex:
            if self._closed:
                raise ClosedHandleError("this Llama is closed")
            if self.slots[index].job is not None:
                raise ConcurrentUseError(
                    f"slot {index} is generating: its state can be saved, loaded or erased "
                    "once it is idle"
                )
            yield self.slots[index].kv

    def forget(self) -> None:
        """Drop every slot's cached prompt; only while idle."""
        with self.lock, self._mutex:
            if self.waiting or self.busy_slots:
                raise StateError("generations are running on the parallel slots")
            for slot in self.slots:
                slot.kv.forget()

    @contextlib.contextmanager
    def weights_change(self) -> Iterator[None]:
        """Held while the context's adapters change (a WeightsGuard): refused while generations
        run or wait, as their KV would mix two sets of weights; new ones wait until it is done."""
        with self.lock:
            with self._mutex:
                if not self._closed and (self.waiting or self.busy_slots):
                    raise ConcurrentUseError(
                        "generations are running on the parallel slots: change the LoRA adapters "
                        "once they are done"
                    )
            yield

    def close(self) -> None:
        """Stop the engine thread (running generations raise ClosedHandleError). Idempotent."""
        if not self._thread.is_alive():  # stopped, or the parent's (a child of fork() has none)
            self._closed = True
            return
        with self._mutex:
            self._closed = True
            self._cond.notify()
        # The step in progress ends now (its generations raise ClosedHandleError anyway): a
        # prompt's decode or an image's encode may take seconds.
        self.context.cancel()
        if self._thread is not threading.current_thread():
            self._thread.join()

    # -- the engine thread ---------------------------------------------------------------------

    def _wake(self) -> None:
        """A session was cancelled: a waiting job ends here and now (the engine may be busy
        for a while); a running one at the engine's next step."""
        with self._mutex:
            self._drop_stopped_waiting()
            self._poke()
            self._cond.notify()

    def _poke(self) -> None:
        """Abort the decode or encode in flight if nobody waits for it any more (a long
        prompt, an image); a watch read just before it closed cancels nothing."""
        watch = self._watch
        if watch is not None:
            watch.poke()

    def _drop_stopped_waiting(self) -> None:
        """End the waiting jobs whose sessions stopped, each with its last step at once. Runs
        on the engine thread or on the one that cancelled (``_wake``): perhaps a finalizer the
        garbage collector ran anywhere, even inside this loop, whose nested call takes jobs of
        its list first; or inside a sampler call, where a close is refused: those samplers
        are closed at the engine's next look for work, or while it idles."""
        for job in [j for j in self.waiting if j.session.stopped()]:
            if job not in self.waiting:  # a nested call ended it
                continue
            self.waiting.remove(job)
            try:
                job.finish(Step("", None, "cancelled"))
            except ConcurrentUseError:
                self._unclosed.append(job.samplers)

    def _close_unclosed(self) -> None:
        """Close the samplers ``_drop_stopped_waiting`` could not, on the engine thread."""
        if not self._unclosed:  # nearly always: no list made per step
            return
        unclosed, self._unclosed = self._unclosed, []
        for samplers in unclosed:
            with contextlib.suppress(LlamaError):
                samplers.close()

    def _run(self) -> None:
        while True:
            with self._mutex:
                if not any(slot.job for slot in self.slots):
                    # (a job that ended its last step with a cancelled one's samplers left
                    # unclosed looks for work no more: they close here, idle)
                    self._close_unclosed()
                    while not self._closed and not self.waiting:
                        self._cond.wait(_IDLE_POLL_SECONDS)
                        self._close_unclosed()
                    self._gather()
                while not self._closed and not self._admit():
                    self._cond.wait(_IDLE_POLL_SECONDS)
                if self._closed:
                    break
            with self.lock:
                try:
                    self._step()
                except BaseException as error:  # a bug must not leave clients waiting forever
                    self._fail([s for s in self.slots if s.job], error)
        closed = ClosedHandleError("this Llama was closed during the generation")
        with self._mutex:  # a client leaving meanwhile takes its job out of the queue (_wake)
            waiting = list(self.waiting)
            self.waiting.clear()
        for job in waiting:
            job.finish(closed)
        self._fail([s for s in self.slots if s.job], closed)
        with self._mutex:
            self._close_unclosed()

    def _gather(self) -> None:
        """The engine was idle and a request came: wait while more keep coming, each within
        GATHER_SECONDS of the last (at most GATHER_LIMIT in all, and no longer than there are
        free slots for them). A burst's requests reach the engine a few ms apart (a server
        parses and tokenizes each on its own thread); started on the first alone, the others
        would wait a whole step (a prompt's decode) for their first token. Holds ``_mutex``."""
        deadline = time.monotonic() + GATHER_LIMIT
        while not self._closed and len(self.waiting) < len(self.slots):
            arrived = len(self.waiting)
            window = min(GATHER_SECONDS, deadline - time.monotonic())
            if window > 0:
                self._cond.wait(window)  # a submit, close or cancel notifies
            if len(self.waiting) == arrived:
                return  # none came within the window (a wake-up without one ends it too)

    def _admit(self) -> bool:
        """Move waiting jobs into free slots (the one holding the longest prefix of its prompt
        that it can reuse first: computed with its adapters; for prompt logprobs, which reuse
        nothing, the one holding the shortest); end cancelled waiting jobs.
        True when a slot has work."""
        self._drop_stopped_waiting()
        self._close_unclosed()
        free = [slot for slot in self.slots if slot.job is None]
        while self.waiting and free:
            job = self.waiting.popleft()
            prompt = job.request.prompt
            with contextlib.suppress(InvalidParameterError):  # raised again by _step's plan
                job.plan = free[0].kv.plan_for(prompt, job.request.lora)
            plan = job.plan
            # Prompt logprobs decode the whole prompt again: the slot that could reuse most of
            # it is left to a later request.
            pick = min if job.request.prompt_logprobs else max
            if plan is None:
                slot = free[0]
            else:
                slot = pick(free, key=lambda s: s.kv.reusable(prompt, plan))
            free.remove(slot)
            slot.job = job
            job.session.slot = slot.kv.seq_id
        return len(free) < len(self.slots)

    def _step(self) -> None:
        for slot in self.slots:
            job = slot.job
            if job is None:
                continue
            if job.todo is not None and slot.kv.memory_changed():  # a user's clear(), say
                slot.kv.forget()  # what it says it holds is gone
                self._end(slot, Step(job.emitter.stops.flush(), None, "cancelled"))
            elif job.session.stopped():
                self._end(slot, Step(job.emitter.stops.flush(), None, "cancelled"))
            elif job.todo is None and (
                job.request.media is not None or self.context.encoder_decoder
            ):
                job.session.prompt_started = time.monotonic()
                self._start_alone(slot)
            elif job.todo is None:
                job.session.prompt_started = time.monotonic()
                try:  # a failure here (a cache failure is a miss already) is this slot's alone
                    job.samplers.bind(self.context, slot.kv.seq_id)
                    plan = job.plan
                    if plan is None:  # refused: this raises why
                        plan = slot.kv.plan_for(job.request.prompt, job.request.lora)
                    # Prompt logprobs read every row's logits: nothing is reused (as on one slot).
                    keep = slot.kv.prepare(job.request.prompt, plan, reuse=job.scores is None)
                except Exception as error:
                    self._fail([slot], error)
                    continue
                job.session.reused = keep
                job.todo = list(job.request.prompt[keep:])
                job.checkpoints = slot.kv.checkpoint_positions(job.request)
        planned, lora = self._plan()
        if not planned:
            return
        # The jobs of this decode, fixed now: a job joining the next batch changes nothing of it.
        decoding = tuple(slot.job.session for slot, _ in planned if slot.job is not None)
        # A prompt's decode may take seconds: deadlines and events are looked at meanwhile.
        prompt = any(len(taken) > 1 for _, taken in planned)
        try:
            with watched(self.context, decoding, poll=prompt) as self._watch:
                # One stopped before the call was armed (which clears a cancel) is seen there.
                self.context.decode(self.batch, lora, self._watch.stopped)
        except DecodeAbortedError:
            self._aborted([slot for slot, _ in planned])
            return
        except Exception as error:
            self._fail([slot for slot, _ in planned], error)
            return
        finally:
            self._watch = None
        row = 0
        for slot, taken in planned:
            row += len(taken)
            if not self._read_prompt_logprobs(slot, row - len(taken), len(taken)):
                continue
            slot.kv.tokens.extend(taken)
            if slot.job is not None and len(slot.kv.tokens) in slot.job.checkpoints:
                slot.kv.take_checkpoint()
        for slot in self.slots:
            if slot.job is not None and slot.job.index is not None:
                self._sample(slot)

    def _read_prompt_logprobs(self, slot: _Slot, first_row: int, count: int) -> bool:
        """After a decode, before the next replaces its logits: the rows of a prompt chunk
        whose job asks for the prompt's logprobs. False when that failed (its job ended)."""
        scores = None if slot.job is None else slot.job.scores
        position = len(slot.kv.tokens)
        if scores is not None and position < len(scores.prompt):
            try:
                scores.read(self.context, position, count, first_row)
            except Exception as error:
                self._fail([slot], error)
                return False
        return True

    def _start_alone(self, slot: _Slot) -> None:
        """A multimodal prompt (libmtmd encodes and decodes it) or an encoder-decoder model's
        (its encoder reads it) is evaluated on its own, and its first token sampled before
        this step's batch replaces the last outputs."""
        job = slot.job
        assert job is not None
        request = job.request
        try:
            job.samplers.bind(self.context, slot.kv.seq_id)
            with watched(self.context, (job.session,)) as self._watch:
                if request.media is not None:
                    slot.kv.decode_media(request.media, request.lora, self._watch.stopped)
                elif not encode_request(slot.kv, request, self._watch.stopped):
                    raise DecodeAbortedError("stopped before its prompt was read", 2)
        except DecodeAbortedError:
            self._aborted([slot])
            return
        except Exception as error:
            self._fail([slot], error)
            return
        finally:
            self._watch = None
        job.todo, job.index = [], -1
        self._sample(slot)

    def _plan(self) -> tuple[list[tuple[_Slot, list[int]]], dict[LoraAdapter, float]]:
        """Fill the batch: next tokens first (one each), then prompt chunks while room is left.
        One batch applies one set of adapters: slots whose next tokens need another set
        (a per-request ``lora``, or an aLoRA prompt before its invocation) wait for a later
        step; the set that goes first rotates from slot to slot, so none starves. A prompt
        whose logprobs are asked for has every row of its chunk an output, and all such rows
        of a batch are bounded as one slot's decode bounds them (prompt_rows_per_decode)."""
        planned: list[tuple[_Slot, list[int]]] = []
        rows: list[tuple[list[int], int, int, bool, bool]] = []
        room = self.batch.capacity
        scored_room = prompt_rows_per_decode(self.context.n_vocab)  # rows read for logprobs
        busy = [(len(s.job.todo), s, s.job) for s in self.slots if s.job and s.job.todo]
        n = len(self.slots)
        order = [self.slots[(self._turn + i) % n] for i in range(n)]
        lead = next((s for s in order if s.job and s.job.todo), None)
        self._turn = (self._turn + 1) % n
        lora = {} if lead is None else lead.kv.plan.at(len(lead.kv.tokens))
        for _, slot, job in sorted(busy, key=lambda entry: entry[0]):
            assert job.todo is not None
            position, plan = len(slot.kv.tokens), slot.kv.plan
            if plan.at(position) != lora:
                continue
            limit = room
            if position < plan.start and plan.adapters:  # aLoRA: stop where it starts to apply
                limit = min(room, plan.start - position)
            ahead = [c - position for c in job.checkpoints if c > position]
            if ahead:
                limit = min(limit, ahead[0])
            # A prompt whose logprobs are asked for: every row an output, within the bound.
            scored = job.scores is not None and position < len(job.scores.prompt)
            if scored:
                if not scored_room:
                    continue  # the next batch takes it
                limit = min(limit, scored_room)
            taken, job.todo = job.todo[:limit], job.todo[limit:]
            if not taken:
                break
            room -= len(taken)
            scored_room -= len(taken) if scored else 0
            planned.append((slot, taken))
            rows.append((taken, len(slot.kv.tokens), slot.kv.seq_id, not job.todo, scored))
        if not rows:
            return planned, lora
        lengths = [len(r[0]) for r in rows]
        ends = np.cumsum(lengths)
        logits = np.zeros(int(ends[-1]), dtype=np.int8)
        for (slot, taken), (*_, wants, scored), end in zip(planned, rows, ends, strict=True):
            assert slot.job is not None
            slot.job.index = int(end) - 1 if wants else None
            logits[int(end) - (len(taken) if scored else 1) : int(end)] = wants or scored
        self.batch.set_rows(
            np.concatenate([np.asarray(r[0], dtype=np.int32) for r in rows]),
            np.concatenate([np.arange(r[1], r[1] + len(r[0])) for r in rows]),
            np.repeat([r[2] for r in rows], lengths),
            logits,
        )
        return planned, lora

    def _sample(self, slot: _Slot) -> None:
        job = slot.job
        assert job is not None and job.index is not None
        index, job.index = job.index, None
        emitter = job.emitter
        if emitter.is_last(job.produced):  # max_tokens=0: the prompt only
            self._end(slot, Step(emitter.rest(), None, "length"))
            return
        try:
            step = emitter.sample(self.context, job.samplers, index, job.produced)
        except Exception as error:
            self._fail([slot], error)
            return
        if step.token is not None:
            job.produced += 1
        if step.finish_reason is None and (
            emitter.is_last(job.produced) or len(slot.kv.tokens) + 1 >= self.limit
        ):
            step.text += emitter.rest()
            step.finish_reason = "length"
        if step.finish_reason is not None:
            self._end(slot, step)
        else:
            assert step.token is not None
            job.todo = [step.token]
            job.steps.put(step)

    def _end(self, slot: _Slot, step: Step) -> None:
        job = slot.job
        assert job is not None
        slot.job = None
        try:
            job.samplers.unbind()
            if step.finish_reason != "cancelled":
                slot.kv.remember()  # logs and skips a failing cache
        finally:
            job.finish(step)  # whatever happens, the client gets its last step

    def _aborted(self, slots: list[_Slot]) -> None:
        """The step's decode (or encode) was cancelled: by a close, and the engine then fails
        every job with ClosedHandleError, or for these slots' cancelled jobs."""
        for slot in slots:
            slot.kv.forget()  # part of the batch may be in memory
            if slot.job is not None and not self._closed:
                self._end(slot, Step(slot.job.emitter.stops.flush(), None, "cancelled"))

    def _fail(self, slots: list[_Slot], error: BaseException) -> None:
        for slot in slots:
            if slot.job is not None:
                with contextlib.suppress(LlamaError):  # e.g. a context already closed
                    slot.job.samplers.unbind()
                with contextlib.suppress(LlamaError):
                    slot.kv.forget()
                slot.job.finish(error)
                slot.job = None


def _results(job: _Job, context: Context) -> Iterator[Step]:
    try:
        while True:
            context.check_own()  # in a child of fork() no engine thread would ever answer
            item = job.steps.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return
    finally:
        job.session.cancel()  # stops the job if the consumer left early; harmless after its end
