"""The multi-model form (``--models FILE.toml`` or ``--models-dir DIR``): a ModelRegistry with
the server's defaults, the middleware that loads a request's model on demand and holds it in
use until the answer ends, and the routes that list, load and unload models."""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from typing import Any

from anyio import CapacityLimiter, to_thread
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.routing import Match, Router
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llamacrab import (
    PRESETS,
    ClosedHandleError,
    ConcurrentUseError,
    EntryStatus,
    InvalidParameterError,
    Llama,
    ModelBudgetError,
    ModelEntry,
    ModelLoadError,
    ModelRegistry,
    UnknownModelError,
)
from llamacrab._registry import Loaded
from llamacrab.server._errors import ApiError
from llamacrab.server._forward import forward
from llamacrab.server._guards import answer_early
from llamacrab.server._isolation import ChildModel, runs_isolated
from llamacrab.server._json_body import read_off_loop
from llamacrab.server._llama_kwargs import generation_kwargs, given, model_kwargs
from llamacrab.server._metrics import escape_label
from llamacrab.server._requested_model import requested_model
from llamacrab.server._schemas import ModelOut
from llamacrab.server._settings import ServerSettings

log = logging.getLogger("llamacrab.server")

# Routes that need a model of one kind; the others (tokenize, templates, ...) take any.
_EMBEDDINGS = {"/v1/embeddings", "/embeddings", "/embedding"}
_RERANK = {"/v1/rerank", "/v1/reranking", "/rerank", "/reranking"}
_GENERATION_ENDINGS = ("completions", "/completion", "/infill", "/responses", "/v1/messages")
# A model's requests waiting in threads at once: more than a child's slots and queue (64 by
# default) hold; past it only that model's requests wait for a thread.
_THREADS_PER_MODEL = 256
# A model's /models/load and /models/unload waiting at once: they wait for one load, and
# apart from its requests (a forced unload must not queue behind those it cancels).
_CONTROL_THREADS_PER_MODEL = 16
# Routes about models themselves: no model is loaded for them.
_MODEL_ROUTES = {
    "/v1/models",
    "/models",
    "/models/load",
    "/models/unload",
    "/health",
    "/v1/health",
    "/metrics",
}


# A stored response's routes: GET and DELETE of one, its input_items, its cancel (POST), not
# POST .../input_tokens. They name no model: server/_responses_children.py asks the loaded ones.
_STORED_RESPONSE = re.compile(r"(?:/v1)?/responses/[^/]+(?:/input_items|/cancel)?")


def _leases_no_model(scope: Scope) -> bool:
    """Whether ``scope``'s route needs no model: one about models, or a stored response's (a
    lookup never loads a model: ``?model=`` loaded one not loaded just to answer 404)."""
    path = scope["path"]
    if path in _MODEL_ROUTES or path.startswith("/v1/models/"):  # one model's card
        return True
    stored = _STORED_RESPONSE.fullmatch(path) is not None
    return stored and (scope.get("method") != "POST" or path.endswith("/cancel"))


def required_kind(path: str) -> str | None:
    """The kind of model ``path`` needs (generation, embeddings, rerank), None for any."""
    if path in _EMBEDDINGS:
        return "embeddings"
    if path in _RERANK:
        return "rerank"
    return "generation" if path.endswith(_GENERATION_ENDINGS) else None


def refusal(name: str, kind: str, wanted: str) -> ApiError:
    """400 for a model that cannot serve a route, naming why."""
    what = {"generation": "generate text", "embeddings": "compute embeddings",
            "rerank": "rerank documents"}  # fmt: skip
    return ApiError(400, f"model {name!r} is for {kind}: it cannot {what[wanted]} (this route "
                    f"needs a model for {wanted})", param="model",
                    code="model_not_capable")  # fmt: skip


def open_registry(settings: ServerSettings) -> ModelRegistry:
    """The registry of ``--models`` or ``--models-dir``, every entry given the serve flags
    (context, threads, GPU layers, KV types, slots, media policy, preset, ...) under its own."""
    limits: dict[str, Any] = {
        "max_loaded": settings.models_max, "memory_budget": settings.models_memory,
        "keep_alive": settings.keep_alive,
    }  # fmt: skip
    limits = {k: v for k, v in limits.items() if v is not None}
    if settings.models is not None:
        parsed = ModelRegistry.from_toml(settings.models, **limits)
        looked = f"--models {settings.models} names no model (no [models.NAME] table)"
    else:
        assert settings.models_dir is not None
        parsed = ModelRegistry.from_directory(settings.models_dir, **limits)
        looked = (f"--models-dir {settings.models_dir} holds no model (it looks for *.gguf "
                  "files in it and in its subfolders)")  # fmt: skip
    if not parsed.names():  # served, it would answer 404 to every request
        raise InvalidParameterError(f"{looked}: there is nothing to serve")
    written = {name: parsed.entry(name) for name in parsed.names()}
    entries = [_with_defaults(entry, settings) for entry in written.values()]
    limits = {"max_loaded": parsed.max_loaded, "memory_budget": parsed.memory_budget,
              "keep_alive": parsed.keep_alive}  # fmt: skip

    def load(entry: ModelEntry) -> Loaded:
        if not runs_isolated(entry):
            return _served_llama(entry)
        # The child puts the flags under the entry as written, as this process did.
        return ChildModel.start(written[entry.name], settings, on_death)

    def on_death(child: ChildModel, reason: str) -> None:
        registry.fail(child.name, child, reason)

    registry = ModelRegistry(entries, **limits, loader=load)
    return registry


def entry_registry(entry: ModelEntry, settings: ServerSettings) -> ModelRegistry:
    """The registry of an isolated entry's own process: that entry alone, loaded here."""
    return ModelRegistry([_with_defaults(entry, settings)], loader=_served_llama)


def _served_llama(entry: ModelEntry) -> Llama:
    llama = Llama(entry.model, **entry.llama_options())
    llama.supersede = False  # one slot: a client's request waits, never cancels another's
    return llama


def _with_defaults(entry: ModelEntry, settings: ServerSettings) -> ModelEntry:
    """``entry`` over the serve flags, as llama-server's router passes its flags to each
    child. Lowest first: ``--preset``, the flags given, the entry's preset, its options."""
    own = dict(entry.options)
    preset = own.pop("preset", None)
    flags = given(model_kwargs(settings))
    if settings.n_ctx is not None:
        flags["n_ctx"] = settings.n_ctx
    if entry.kind == "generation":
        flags.update(generation_kwargs(settings))
    elif entry.kind == "embeddings" and settings.pooling is not None:
        flags["pooling"] = settings.pooling
    flags = {k: v for k, v in flags.items() if v is not None}
    options = {**_under(settings.preset, flags), **_under(preset, own)}
    if entry.kind == "generation":
        # Speculative decoding runs on one slot (parallel=None), like --model-draft alone.
        if (own.get("draft_model") or own.get("prompt_lookup")) and "parallel" not in own:
            options["parallel"] = None
        options.setdefault("n_ctx", 4096 * (options["parallel"] or 1))
    return ModelEntry(entry.name, entry.model, options, entry.keep_alive, entry.pinned,
                      entry.isolate)  # fmt: skip


def _under(preset: str | None, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` over a preset's (both names were checked when parsed)."""
    return {**(PRESETS[preset].options if preset else {}), **options}


def load_pinned(registry: ModelRegistry) -> None:
    """Load the pinned entries in the background (a failure shows in their status; no room,
    which leaves an entry unloaded without an error, in the log)."""

    def load_all() -> None:
        for status in registry.entries():
            if status.pinned:
                try:
                    registry.start(status.name)
                except ModelBudgetError as error:
                    log.warning("pinned model %r not loaded: %s", status.name, error)
                except Exception:  # reported by /v1/models and /health
                    pass

    threading.Thread(target=load_all, name="llamacrab-load-pinned", daemon=True).start()


def status_json(status: EntryStatus) -> dict[str, Any]:
    """``status`` as llama-server's router lists it (``status.value``), plus llamacrab's."""
    out: dict[str, Any] = {"value": status.status, "in_use": status.in_use}
    if status.error is not None:
        out["failed"], out["error"] = True, status.error
    if status.estimate is not None:
        out["estimated_bytes"] = status.estimate.total
    return out


def model_json(status: EntryStatus, created: int, llama: Llama | None = None) -> dict[str, Any]:
    """An entry's card; with ``meta`` where ``llama`` is it, loaded in this process."""
    card = model_card(status.name, created, llama)
    return {**card, "kind": status.kind, "pinned": status.pinned, "status": status_json(status)}


def model_card(name: str, created: int, llama: Llama | None) -> dict[str, Any]:
    """A model as ``/v1/models`` lists it (``ModelOut``), with llama-server's ``aliases`` (the
    names it answers to) and, for a loaded model, its ``meta``: vocabulary, a slot's context
    and the training one, width, parameters, bytes and weights' type."""
    card = {**ModelOut.of(name, created).model_dump(), "aliases": [name]}
    if llama is not None:
        with contextlib.suppress(ClosedHandleError):  # unloaded meanwhile: as not loaded
            card["meta"] = _meta(llama)
    return card


def _meta(llama: Llama) -> dict[str, Any]:
    model, vocab = llama.model, llama.vocab
    return {"vocab_type": vocab.kind, "n_vocab": vocab.n_tokens,
            "n_ctx": llama.context.n_ctx_seq, "n_ctx_train": model.n_ctx_train,
            "n_embd": model.n_embd, "n_params": model.n_params, "size": model.size,
            "ftype": model.ftype}  # fmt: skip


def render_metrics(registry: ModelRegistry) -> str:
    """Per-model gauges for ``/metrics``."""
    rows = []
    for status in registry.entries():
        label = f'{{model="{escape_label(status.name)}"}}'
        rows.append((label, status))
    lines = []
    gauges: list[tuple[str, str, Callable[[EntryStatus], float]]] = [
        ("model_loaded", "1 while the model is loaded", lambda s: s.status == "loaded"),
        ("model_failed", "1 if the model's last load failed", lambda s: s.status == "failed"),
        ("model_in_use", "requests holding the model now", lambda s: s.in_use),
        ("model_estimated_bytes", "memory the model was estimated to take",
         lambda s: s.estimate.total if s.estimate else 0),
    ]  # fmt: skip
    for name, text, value in gauges:
        lines += [f"# HELP llamacrab_{name} {text}", f"# TYPE llamacrab_{name} gauge"]
        lines += [f"llamacrab_{name}{label} {float(value(s)):g}" for label, s in rows]
    return "\n".join(lines) + "\n"


def _per_model_threads(count: int) -> defaultdict[str, CapacityLimiter]:
    """Worker threads of each model's own, ``count`` each, apart from anyio's 40 that every
    sync route shares: 40 long requests to one model took them all, and a request to another,
    loaded model (or a /models/load) waited for one."""
    return defaultdict(partial(CapacityLimiter, count))


class ModelBody(BaseModel):
    model: str
    force: bool = False  # unload: cancel its running requests


def add_model_routes(app: FastAPI, registry: ModelRegistry, created: int) -> None:
    """``/models/load`` and ``/models/unload`` (llama-server's router routes), each waiting on
    threads of its model's own."""
    threads = _per_model_threads(_CONTROL_THREADS_PER_MODEL)

    @app.post("/models/load")
    async def load(body: ModelBody) -> JSONResponse:
        try:
            registry.entry(body.model)  # an unknown name is refused before it has threads
            await to_thread.run_sync(registry.start, body.model, limiter=threads[body.model])
        except (UnknownModelError, ModelBudgetError, ModelLoadError) as error:
            raise lease_error(error) from None
        return JSONResponse({"success": True, **model_json(registry.status(body.model), created)})

    @app.post("/models/unload")
    async def unload(body: ModelBody) -> JSONResponse:
        try:
            registry.entry(body.model)
            unloaded = await to_thread.run_sync(partial(registry.unload, body.model,
                                                        force=body.force),
                                                limiter=threads[body.model])  # fmt: skip
        except UnknownModelError as error:
            raise lease_error(error) from None
        except ConcurrentUseError as error:
            raise ApiError(409, f"{error}; pass force: true to cancel them", param="model",
                           code="model_in_use") from None  # fmt: skip
        status = model_json(registry.status(body.model), created)
        return JSONResponse({"success": True, "unloaded": unloaded, **status})


def lease_error(error: Exception) -> ApiError:
    """The answer for a model that cannot be had: unknown 404, no room 503 (500 when no room
    will come: the model alone exceeds the budget, or pinned models take it), failed 500."""
    if isinstance(error, UnknownModelError):
        return ApiError(404, str(error), param="model", code="model_not_found")
    if isinstance(error, ModelBudgetError) and error.permanent:  # a retry cannot help
        code = "model_too_large" if error.alone else "model_blocked_by_pinned"
        return ApiError(500, str(error), param="model", code=code)
    if isinstance(error, ModelBudgetError):
        return ApiError(503, str(error), param="model", code="model_busy")
    return ApiError(500, str(error), param="model", code="model_load_failed")


class ModelLeaseMiddleware:
    """Loads the model a request names (``model`` of its JSON or form body, else ``?model=``)
    before its route runs, and holds it in use until the whole answer, streamed or not, is
    sent: it is never unloaded under a request. An unknown name is 404; a model that cannot
    serve the route 400. Routes about models and a stored response's lease none, nor does a
    request that no route answers."""

    def __init__(
        self,
        app: ASGIApp,
        registry: ModelRegistry,
        router: Router,
        timeout: float = 600.0,
        free_paths: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.registry = registry
        self.router = router  # the app's: a request that no route answers leases no model
        self.free_paths = free_paths  # more routes that need no model (the API's docs)
        self.timeout = timeout  # seconds an isolated entry's process may keep a request silent
        # For what waits on a model: its load, an isolated entry's answer.
        self.threads = _per_model_threads(_THREADS_PER_MODEL)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or _leases_no_model(scope)
            or scope["path"] in self.free_paths
            or not self._routed(scope)
        ):
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        if scope.get("method") == "POST":
            while True:  # the body limit is checked outside this middleware
                message = await receive()
                messages.append(message)
                if message["type"] != "http.request" or not message.get("more_body"):
                    break
        body = b"".join(message.get("body", b"") for message in messages)
        name = await read_off_loop(body, lambda: requested_model(scope, body))
        names = self.registry.names()
        if name is None and len(names) == 1:
            name = names[0]  # the only model serves requests that name none
        if name is None or name not in self.registry:
            if name is not None and scope.get("method") == "POST":
                known = ", ".join(names)
                unknown = UnknownModelError(f"no model named {name!r} (registered: {known})")
                await answer_early(scope, send, lease_error(unknown))
                return
            await self.app(scope, _replay(messages, receive), send)
            return
        wanted = required_kind(scope["path"])
        kind = self.registry.entry(name).kind
        if wanted is not None and kind != wanted:
            await answer_early(scope, send, refusal(name, kind, wanted))
            return
        held: list[Loaded] = []  # set in the worker thread once the lease is taken
        threads = self.threads[name]

        def take() -> None:
            held.append(self.registry.lease(name))

        try:
            # A client gone while the model loads: the thread still finishes (and may take
            # the lease), then the cancellation arrives here; ``held`` says what to release.
            await to_thread.run_sync(take, limiter=threads)
            if isinstance(held[0], ChildModel):
                await forward(held[0], scope, body, receive, send, self.timeout, threads)
            else:
                await self.app(scope, _replay(messages, receive), send)
        except ApiError as error:  # the isolated entry's process could not answer
            await answer_early(scope, send, error)
        except (UnknownModelError, ModelBudgetError, ModelLoadError) as error:
            if held:
                raise
            await answer_early(scope, send, lease_error(error))
        finally:
            if held:
                self.registry.release(name)

    def _routed(self, scope: Scope) -> bool:
        """Whether a route answers ``scope`` (else the router does: 404, 405), so that a path
        no route has loads no model: ``/v1/embeddings/`` loaded a generation model to answer
        a redirect, skipping the route's kind check."""
        return any(route.matches(scope)[0] is Match.FULL for route in self.router.routes)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
