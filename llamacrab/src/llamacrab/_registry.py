"""ModelRegistry: named models, each loaded on first use into a ``Llama`` of its own (its own
context and engine) and shared, within a count and a memory budget; idle ones unload after
their ``keep_alive``, and the least recently used unloaded to make room, never while in use and
never when pinned."""

from __future__ import annotations

import inspect
import logging
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Protocol

from llamacrab._engine.scheduler import Scheduler
from llamacrab._exceptions import (
    ConcurrentUseError,
    InvalidParameterError,
    LlamaError,
    ModelBudgetError,
    ModelLoadError,
    UnknownModelError,
)
from llamacrab._features.footprint import PARAM_FIELDS, estimate_llama
from llamacrab._features.llama_options import EXTRA_NAMES
from llamacrab._features.models_dir import scan_models_dir
from llamacrab._features.presets import with_preset
from llamacrab._field_types import INT32_MAX, check_field_types, check_range, is_number
from llamacrab._llama import Llama
from llamacrab._native.claims import POLL_SECONDS
from llamacrab._native.fork import reset_in_child
from llamacrab._native.gguf_memory import MemoryEstimate

Status = Literal["unloaded", "loading", "loaded", "failed"]
Kind = Literal["generation", "embeddings", "rerank"]
# Every keyword Llama(...) takes: its parameters, the parameter objects' fields, and the
# file-and-size options (adapters, control vectors, draft model, prompt cache).
_LLAMA_OPTIONS = (
    (set(inspect.signature(Llama.__init__).parameters) - {"self", "model_path"})
    | PARAM_FIELDS
    | EXTRA_NAMES
)

log = logging.getLogger("llamacrab")


class Loaded(Protocol):
    """What a loader makes of an entry: a ``Llama``, or what stands for one (the server's
    model in a process of its own). The registry only counts, cancels and closes it."""

    @property
    def scheduler(self) -> Scheduler | None: ...

    @property
    def busy(self) -> bool: ...

    def cancel(self) -> None: ...

    def close(self) -> None: ...


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def check_keep_alive(value: object, name: str) -> None:
    """None (never unloaded when idle) or a finite number of seconds >= 0."""
    if value is not None and not (is_number(value) and 0 <= value < math.inf):
        raise InvalidParameterError(f"{name} must be a number of seconds >= 0, not {value!r}")


def parse_size(value: int | str) -> int:
    """Bytes from an int or a text such as ``"6 GiB"``, ``"512MB"``, ``"800M"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.match(str(value))
    if match is None:
        raise InvalidParameterError(f"not a size: {value!r} (e.g. 6GiB, 512MB, 1000000)")
    number, unit, binary = match.groups()
    base = 1024 if binary or not unit else 1000
    return int(float(number) * base ** " KMGT".index(unit.upper() or " "))


@dataclass(frozen=True)
class ModelEntry:
    """A named model: a GGUF path or a Hub id (``org/repo``), the ``Llama`` keyword options to
    load it with (``preset`` among them), seconds idle before it unloads (``keep_alive``; None:
    the registry's), whether it is ``pinned`` (never unloaded but on request), and whether
    the server runs it in a process of its own (``isolate``; None: when it uses RPC workers)."""

    name: str
    model: str
    options: Mapping[str, Any] = field(default_factory=dict)
    keep_alive: float | None = None
    pinned: bool = False
    isolate: bool | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.model:
            raise InvalidParameterError("a model entry needs a name and a model")
        try:
            check_field_types(self, skip=("model",))  # a path object is taken too
        except InvalidParameterError as error:
            raise InvalidParameterError(f"model {self.name!r}: {error}") from None
        unknown = set(self.options) - _LLAMA_OPTIONS
        if unknown:
            raise InvalidParameterError(f"model {self.name!r}: unknown options {sorted(unknown)}")
        check_keep_alive(self.keep_alive, f"model {self.name!r}: keep_alive")
        self.llama_options()  # an unknown preset fails here, not at first use
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    def llama_options(self) -> dict[str, Any]:
        """The keyword options of its ``Llama``, its preset applied."""
        options = dict(self.options)
        return with_preset(options.pop("preset", None), options)

    @property
    def kind(self) -> Kind:
        """What it serves: text generation, embeddings or reranking (an embeddings context
        with rank pooling)."""
        options = self.llama_options()
        if not options.get("embeddings"):
            return "generation"
        return "rerank" if options.get("pooling") == "rank" else "embeddings"


@dataclass(frozen=True)
class EntryStatus:
    """One entry as ``entries()`` reports it. ``estimate``: the memory it was estimated to take
    at its last load; ``in_use``: requests holding it now; ``last_used``: a ``time.time()``."""

    name: str
    model: str
    kind: Kind
    status: Status
    error: str | None
    in_use: int
    pinned: bool
    keep_alive: float | None
    estimate: MemoryEstimate | None
    last_used: float | None


class _Slot:
    """An entry's mutable state, guarded by the registry's lock."""

    def __init__(self, entry: ModelEntry) -> None:
        self.entry = entry
        self.status: Status = "unloaded"
        self.llama: Loaded | None = None
        self.error: str | None = None
        self.crashed = False  # failed while loaded (not at load): the next use loads it again
        self.in_use = 0
        self.used = 0.0  # time.monotonic() of the last use
        self.used_wall: float | None = None
        self.estimate: MemoryEstimate | None = None

    def touch(self) -> None:
        self.used, self.used_wall = time.monotonic(), time.time()

    def idle(self) -> bool:
        """Loaded, and nothing uses it: no lease, no generation under way or waiting (one
        from ``get``, an unfinished stream, a busy or queued parallel slot)."""
        if self.status != "loaded" or self.in_use or self.llama is None:
            return False
        return not self.llama.busy

    def take(self) -> Loaded:
        """Detach the loaded model (closed by the caller, outside the lock)."""
        llama, self.llama, self.status = self.llama, None, "unloaded"
        assert llama is not None
        return llama


class _Detached:
    """One unload of a model not closed yet, counted apart from any other (a loader may give
    two entries the same object: each unload is closed and uncounted once)."""

    __slots__ = ("llama",)

    def __init__(self, llama: Loaded) -> None:
        self.llama = llama


class ModelRegistry:
    """Named models loaded on first use and shared.

    ``get(name)`` returns the entry's ``Llama``, loading it first if needed (other threads
    asking meanwhile wait for the same load); ``use(name)`` does so for the length of a
    ``with`` block and counts the model in use meanwhile, as the server does per request.
    Limits: ``max_loaded`` models and a ``memory_budget`` in bytes (or "6GiB"), checked against
    each model's estimate read from its GGUF before loading. To make room the least recently
    used model unloads, never one in use (a lease from ``use``/``acquire``, or a busy parallel
    slot) and never a pinned one; ``ModelBudgetError`` when none can (``permanent`` when the
    pinned models alone leave no room). An unloaded model counts until its close returns: a
    load that needs its room waits. An idle model unloads after ``keep_alive`` seconds (per
    entry, else the registry's; None: never).

    Unloading closes the ``Llama``: handles close children first and wait for a native call in
    flight, so a thread still holding the Llama gets ClosedHandleError, never a crash. A
    loaded object's ``close`` must not load from its own registry: a load that needs the room
    it frees waits for it.
    """

    def __init__(
        self,
        entries: Iterable[ModelEntry] = (),
        *,
        max_loaded: int | None = None,
        memory_budget: int | str | None = None,
        keep_alive: float | None = None,
        loader: Callable[[ModelEntry], Loaded] | None = None,
    ) -> None:
        check_range("max_loaded", max_loaded, 1, INT32_MAX)
        check_keep_alive(keep_alive, "keep_alive")
        self.max_loaded = max_loaded
        self.memory_budget = None if memory_budget is None else parse_size(memory_budget)
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise InvalidParameterError(f"memory_budget must be positive, not {memory_budget!r}")
        self.keep_alive = keep_alive
        self._loader: Callable[[ModelEntry], Loaded] = loader or (
            lambda entry: Llama(entry.model, **entry.llama_options())
        )
        # Entered as ``with self._mutex`` (the C lock: atomic), never through the Condition,
        # whose Python __enter__ a Ctrl-C can leave holding it; waits poll (claims.py).
        self._mutex = threading.RLock()
        self._lock = threading.Condition(self._mutex)
        reset_in_child(self._lock)
        self._slots: dict[str, _Slot] = {}
        # Unloaded models whose close has not returned: each still holds its memory (an
        # isolated entry's process serves on for up to 10 s), so each still counts.
        self._closing: dict[_Detached, MemoryEstimate | None] = {}
        self._closed = False
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        entries = list(entries)
        self._check_pinned([e.name for e in entries if e.pinned])  # naming all, not the first
        for entry in entries:
            self.add(entry)

    # -- entries -------------------------------------------------------------------------------

    def add(
        self,
        entry: ModelEntry | str,
        model: str | os.PathLike[str] | None = None,
        *,
        keep_alive: float | None = None,
        pinned: bool = False,
        **options: Any,
    ) -> ModelEntry:
        """Add ``entry``, or build one: ``add("chat", "gemma.gguf", n_ctx=2048, preset=...)``."""
        if not isinstance(entry, ModelEntry):
            if model is None:
                raise InvalidParameterError(f"model {entry!r}: no model path or repository")
            entry = ModelEntry(entry, os.fspath(model), options, keep_alive, pinned)
        with self._mutex:
            if entry.name in self._slots:
                raise InvalidParameterError(f"a model named {entry.name!r} is already registered")
            if entry.pinned:
                already = [name for name, s in self._slots.items() if s.entry.pinned]
                self._check_pinned([*already, entry.name])
            self._slots[entry.name] = _Slot(entry)
        self._start_reaper()
        return entry

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str], **overrides: Any) -> ModelRegistry:
        """A registry from a TOML file: top-level ``max_loaded``, ``memory_budget``,
        ``keep_alive``, and one ``[models.NAME]`` table per entry (``model`` plus ``Llama``
        options, ``preset``, ``keep_alive``, ``pinned``). Relative paths are read from the
        file's folder. ``overrides`` replace the top-level settings."""
        file = Path(path)
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover
            import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]
        try:
            data = tomllib.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
            raise InvalidParameterError(f"cannot read the model registry {file}: {error}") from None
        models = data.pop("models", {})
        unknown = set(data) - {"max_loaded", "memory_budget", "keep_alive"}
        if unknown or not isinstance(models, dict):
            raise InvalidParameterError(
                f"{file}: unknown settings {sorted(unknown)}; expected max_loaded, "
                "memory_budget, keep_alive and [models.NAME] tables"
            )
        entries = [_toml_entry(file.parent, name, table) for name, table in models.items()]
        return cls(entries, **{**data, **overrides})

    @classmethod
    def from_directory(cls, folder: str | os.PathLike[str], **kwargs: Any) -> ModelRegistry:
        """One entry per model in ``folder``: each GGUF (split parts as one, named without
        the part suffix; ``mmproj-NAME.gguf`` as NAME's projector; embedding and reranker
        models get their contexts). ``options`` keyword: options every entry starts from."""
        options = kwargs.pop("options", {})
        entries = [
            ModelEntry(found.name, str(found.path), {**found.options, **options})
            for found in scan_models_dir(Path(folder))
        ]
        return cls(entries, **kwargs)

    def names(self) -> list[str]:
        with self._mutex:
            return list(self._slots)

    def __contains__(self, name: object) -> bool:
        with self._mutex:
            return name in self._slots

    def entry(self, name: str) -> ModelEntry:
        with self._mutex:
            return self._slot(name).entry

    def loaded(self, name: str) -> Llama | None:
        """The entry's Llama if it is loaded now (never loads it)."""
        with self._mutex:
            slot = self._slot(name)
            return slot.llama if slot.status == "loaded" and isinstance(slot.llama, Llama) else None

    def loaded_models(self) -> list[Loaded]:
        """What the entries loaded now were loaded as, Llamas or not (never loads any): the
        server asks its isolated entries' processes for what they keep."""
        with self._mutex:
            slots = self._slots.values()
            return [s.llama for s in slots if s.status == "loaded" and s.llama is not None]

    def entries(self) -> list[EntryStatus]:
        """Every entry's status, in the order they were added."""
        with self._mutex:
            return [self._status(slot) for slot in self._slots.values()]

    def status(self, name: str) -> EntryStatus:
        with self._mutex:
            return self._status(self._slot(name))

    # -- loading and using ---------------------------------------------------------------------

    def get(self, name: str) -> Llama:
        """The entry's shared Llama, loaded first if needed. A model that failed to load raises
        ModelLoadError with the reason until ``load`` tries again."""
        return _llama(name, self._obtain(name, lease=False, retry=False))

    def load(self, name: str) -> Llama:
        """Load the entry now (again, if it failed); its Llama."""
        return _llama(name, self.start(name))

    def acquire(self, name: str) -> Llama:
        """``get``, counting the model in use (never unloaded to make room, nor when idle)
        until ``release(name)``."""
        return _llama(name, self.lease(name))

    def start(self, name: str) -> Loaded:
        """``load`` for any loader: what it made of the entry, a Llama or not."""
        return self._obtain(name, lease=False, retry=True)

    def lease(self, name: str) -> Loaded:
        """``acquire`` for any loader: what it made of the entry, in use until ``release``."""
        return self._obtain(name, lease=True, retry=False)

    def fail(self, name: str, loaded: Loaded, reason: str) -> bool:
        """Mark the entry failed because ``loaded``, its model, broke while loaded (a process
        of its own died): it is reported with ``reason``, and the next use loads it again.
        False when ``loaded`` is no longer the entry's model."""
        with self._mutex:
            slot = self._slot(name)
            if slot.llama is not loaded:
                return False
            slot.take()
            slot.status, slot.error, slot.crashed = "failed", reason, True
            self._lock.notify_all()
        return True

    def release(self, name: str) -> None:
        with self._mutex:
            slot = self._slot(name)
            if slot.in_use <= 0:
                raise InvalidParameterError(f"model {name!r} was not acquired")
            slot.in_use -= 1
            slot.touch()
            self._lock.notify_all()

    @contextmanager
    def use(self, name: str) -> Iterator[Llama]:
        """The entry's Llama, in use for the ``with`` block."""
        llama = self.acquire(name)
        try:
            yield llama
        finally:
            self.release(name)

    def unload(self, name: str, *, force: bool = False) -> bool:
        """Unload the entry (False if it was not loaded; a failed entry forgets its error).
        One in use raises ConcurrentUseError, unless ``force``: its generations are cancelled
        and their callers get ClosedHandleError."""
        with self._mutex:
            slot = self._slot(name)
            while slot.status == "loading":
                self._lock.wait(POLL_SECONDS)
            if slot.status != "loaded":
                slot.status, slot.error = "unloaded", None
                return False
            if not slot.idle() and not force:
                raise ConcurrentUseError(
                    f"model {name!r} is in use ({slot.in_use} leases"
                    f"{', generating' if slot.llama and slot.llama.busy else ''})"
                )
            detached = self._detach(slot)
        self._close([detached], cancel=True)
        return True

    def close(self) -> None:
        """Unload every model (cancelling what runs) and stop the keep-alive timer; returns
        once every model is closed, those other threads were closing too."""
        with self._mutex:
            self._closed = True
            self._stop.set()
            self._lock.notify_all()  # loads waiting for room give up
            while any(slot.status == "loading" for slot in self._slots.values()):
                self._lock.wait(POLL_SECONDS)
            loaded = [self._detach(s) for s in self._slots.values() if s.status == "loaded"]
        try:
            self._close(loaded, cancel=True)
        finally:  # one of them raising: the others' memory is free all the same on return
            with self._mutex:
                while self._closing:
                    self._lock.wait(POLL_SECONDS)
            if self._reaper is not None and self._reaper is not threading.current_thread():
                self._reaper.join(timeout=10)

    def __enter__(self) -> ModelRegistry:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------

    def _slot(self, name: str) -> _Slot:
        slot = self._slots.get(name)
        if slot is None:
            known = ", ".join(sorted(self._slots)) or "none"
            raise UnknownModelError(f"no model named {name!r} (registered: {known})")
        return slot

    def _check_pinned(self, pinned: list[str]) -> None:
        if self.max_loaded is not None and len(pinned) > self.max_loaded:
            raise InvalidParameterError(
                f"{len(pinned)} models are pinned ({', '.join(map(repr, pinned))}), more than "
                f"max_loaded {self.max_loaded}: they cannot all stay loaded"
            )

    def _status(self, slot: _Slot) -> EntryStatus:
        entry = slot.entry
        keep_alive = entry.keep_alive if entry.keep_alive is not None else self.keep_alive
        return EntryStatus(entry.name, entry.model, entry.kind, slot.status, slot.error,
                           slot.in_use, entry.pinned, keep_alive, slot.estimate,
                           slot.used_wall)  # fmt: skip

    def _obtain(self, name: str, *, lease: bool, retry: bool) -> Loaded:
        with self._mutex:
            slot = self._slot(name)
            while True:
                if self._closed:
                    raise ModelLoadError("the model registry is closed")
                if slot.status == "loaded" and slot.llama is not None:
                    slot.touch()
                    slot.in_use += lease
                    return slot.llama
                if slot.status == "loading":
                    self._lock.wait(POLL_SECONDS)
                    continue
                if slot.status == "failed" and not (retry or slot.crashed):
                    raise ModelLoadError(f"model {name!r} failed to load: {slot.error}")
                slot.status, slot.error, slot.crashed = "loading", None, False
                break
        try:
            llama = self._load(slot)
        except BaseException as error:
            with self._mutex:
                if isinstance(error, ModelBudgetError):
                    slot.status = "unloaded"  # no room now; another time there may be
                else:
                    slot.status, slot.error = "failed", _reason(name, error)
                self._lock.notify_all()
            if isinstance(error, LlamaError) and not isinstance(error, ModelBudgetError):
                # A bad file, a context or an option refused: the entry's failure to load,
                # named and worded as every later use reports it (a server answers
                # model_load_failed, never a bare 500, and the same message each time).
                raise ModelLoadError(f"model {name!r} failed to load: {slot.error}") from error
            raise
        with self._mutex:
            slot.llama, slot.status = llama, "loaded"
            slot.touch()
            slot.in_use += lease
            self._lock.notify_all()
            if not self._closed:
                return llama
            detached = self._detach(slot)
        self._close([detached])
        raise ModelLoadError("the model registry is closed")

    def _load(self, slot: _Slot) -> Loaded:
        entry = slot.entry
        estimate = estimate_llama(entry.model, entry.llama_options())
        while True:
            with self._mutex:
                slot.estimate = estimate
                victims = self._make_room(slot, estimate)
            if not victims:
                return self._loader(entry)
            try:
                self._close(victims)  # then their room is looked at again
            except Exception as error:  # theirs to report, not this load's: their room is free
                log.warning("an unloaded model failed to close: %s: %s",
                            type(error).__name__, error)  # fmt: skip

    def _make_room(self, slot: _Slot, estimate: MemoryEstimate) -> list[_Detached]:
        """Nothing once ``slot`` fits beside the models loaded, loading and closing; else the
        least recently used idle models, unloaded, that the caller closes to make room (called
        locked). Waits for the models closing when their room is what it lacks."""
        budget = self.memory_budget
        if budget is not None and estimate.total > budget:
            raise ModelBudgetError(
                f"model {slot.entry.name!r} needs about {_mib(estimate.total)}, more than the "
                f"whole memory budget of {_mib(budget)}",
                alone=True,
            )
        while True:
            if self._closed:
                raise ModelLoadError("the model registry is closed")
            others = [s for s in self._slots.values()
                      if s is not slot and s.status in ("loaded", "loading")]  # fmt: skip
            held = [s.estimate for s in others]
            if self._fits([*held, *self._closing.values()], estimate):
                return []
            pinned = [s for s in others if s.entry.pinned and s.status == "loaded"]
            if not self._fits([s.estimate for s in pinned], estimate):
                raise self._no_room(slot, estimate, pinned, permanent=True)
            if self._fits(held, estimate):
                self._lock.wait(POLL_SECONDS)  # woken as each close returns
                continue
            idle = sorted((s for s in others if s.idle() and not s.entry.pinned),
                          key=lambda s: s.used)  # fmt: skip
            if not self._fits([s.estimate for s in others if s not in idle], estimate):
                raise self._no_room(slot, estimate, others, permanent=False)
            victims: list[_Slot] = []
            while not self._fits([s.estimate for s in others if s not in victims], estimate):
                victims.append(idle[len(victims)])
            # The last, largest perhaps, may make room alone: spare those it does not need.
            for spared in victims[-2::-1]:
                kept = [s for s in victims if s is not spared]
                if self._fits([s.estimate for s in others if s not in kept], estimate):
                    victims = kept
            return [self._detach(victim) for victim in victims]

    def _fits(self, held: list[MemoryEstimate | None], estimate: MemoryEstimate) -> bool:
        """Whether a model of ``estimate`` fits beside models of the ``held`` estimates."""
        if self.max_loaded is not None and len(held) >= self.max_loaded:
            return False
        used = sum(e.total for e in held if e is not None)
        return self.memory_budget is None or used + estimate.total <= self.memory_budget

    def _no_room(self, slot: _Slot, estimate: MemoryEstimate, blocking: list[_Slot], *,
                 permanent: bool) -> ModelBudgetError:  # fmt: skip
        name = slot.entry.name
        if self.max_loaded is not None and len(blocking) >= self.max_loaded:
            why = f"{len(blocking)} of max_loaded {self.max_loaded} models are loaded"
        else:
            used = sum(s.estimate.total for s in blocking if s.estimate is not None)
            why = (f"{_mib(used)} of the {_mib(self.memory_budget or 0)} budget is taken and "
                   f"{name!r} needs about {_mib(estimate.total)}")  # fmt: skip
        if not permanent:
            return ModelBudgetError(f"no room for model {name!r}: {why}, and each of them is in "
                                    "use, loading or pinned")  # fmt: skip
        pinned = ", ".join(repr(s.entry.name) for s in blocking)
        return ModelBudgetError(f"no room for model {name!r} beside the pinned models {pinned}: "
                                f"{why}, and a pinned model is only unloaded on request",
                                permanent=True)  # fmt: skip

    def _detach(self, slot: _Slot) -> _Detached:
        """Unload ``slot``'s model (called locked); it counts until ``_close`` closes it."""
        detached = _Detached(slot.take())
        self._closing[detached] = slot.estimate
        return detached

    def _close(self, detached: list[_Detached], *, cancel: bool = False) -> None:
        """Close detached models outside the lock (a close waits for native calls in flight),
        every one even if one raises (the first error is raised after); with ``cancel``, each
        is cancelled before any closes (the last one's generations stop with the first's).
        Each stops counting as its close ends, raising or not: counted for ever, it would
        stall every load."""
        failure: BaseException | None = None
        try:
            for one in detached if cancel else ():
                try:
                    one.llama.cancel()
                except BaseException as error:
                    failure = failure or error
        finally:  # an interrupt between two cancels: every one is still closed and uncounted
            for one in detached:
                try:
                    one.llama.close()
                except BaseException as error:
                    failure = failure or error
                finally:
                    with self._mutex:
                        del self._closing[one]
                        self._lock.notify_all()
        if failure is not None:
            raise failure

    # -- keep-alive ----------------------------------------------------------------------------

    def _start_reaper(self) -> None:
        with self._mutex:
            wanted = self.keep_alive is not None or any(
                s.entry.keep_alive is not None for s in self._slots.values()
            )
            if not wanted or self._reaper is not None or self._closed:
                return
            reaper = threading.Thread(target=self._reap, name="llamacrab-keep-alive",
                                      daemon=True)  # fmt: skip
            self._reaper = reaper
        try:
            reaper.start()
        except RuntimeError as error:  # no thread to be had (a pids limit): try next time
            with self._mutex:
                self._reaper = None
            log.warning("keep_alive cannot unload idle models for now: %s", error)

    def _reap_interval(self) -> float:
        with self._mutex:
            times = [s.entry.keep_alive if s.entry.keep_alive is not None else self.keep_alive
                     for s in self._slots.values()]  # fmt: skip
        shortest = min((t for t in times if t is not None), default=4.0)
        return min(max(shortest / 4, 0.05), 1.0)

    def _reap(self) -> None:
        while not self._stop.wait(self._reap_interval()):
            now = time.monotonic()
            expired: list[_Detached] = []
            with self._mutex:
                for slot in self._slots.values():
                    entry = slot.entry
                    keep = entry.keep_alive if entry.keep_alive is not None else self.keep_alive
                    if (keep is not None and not entry.pinned and slot.idle()
                            and now - slot.used >= keep):  # fmt: skip
                        expired.append(self._detach(slot))
            self._close(expired)


def estimate_memory(
    model: str | os.PathLike[str], *, preset: str | None = None, **options: Any
) -> MemoryEstimate:
    """The memory ``Llama(model, preset=preset, **options)`` would take, read from the GGUF
    header without loading it: weights, KV memory for its context, compute buffers."""
    return estimate_llama(model, with_preset(preset, options))


def _llama(name: str, loaded: Loaded) -> Llama:
    if not isinstance(loaded, Llama):
        raise ModelLoadError(f"model {name!r} is not a Llama of this process (its loader made "
                             f"a {type(loaded).__name__})")  # fmt: skip
    return loaded


def _reason(name: str, error: BaseException) -> str:
    """Why ``name`` failed to load, said once: a plain ModelLoadError by its text (what "failed
    to load" says already), less the model's name an isolated entry's process starts it with;
    any other error by its type and text."""
    if type(error) is not ModelLoadError:
        return f"{type(error).__name__}: {error}"
    text = str(error)
    for prefix in (f"model {name!r} failed to load: ", f"model {name!r}: "):
        text = text.removeprefix(prefix)
    return text


def _mib(size: int) -> str:
    return f"{size / 2**20:.0f} MiB"


def _toml_entry(folder: Path, name: str, table: Any) -> ModelEntry:
    if not isinstance(table, dict) or not isinstance(table.get("model"), str):
        raise InvalidParameterError(f"[models.{name}] needs model = a GGUF path or org/repo")
    options = dict(table)
    model = options.pop("model")
    keep_alive, pinned = options.pop("keep_alive", None), options.pop("pinned", False)
    isolate = options.pop("isolate", None)
    for key in ("mmproj",):
        if isinstance(options.get(key), str):
            options[key] = _relative(folder, options[key])
    return ModelEntry(name, _relative(folder, model), options, keep_alive, pinned, isolate)


def _relative(folder: Path, path: str) -> str:
    """``path`` read from ``folder`` when it names a file there, else as given (org/repo)."""
    candidate = folder / path
    return str(candidate) if not Path(path).is_absolute() and candidate.exists() else path
