"""The server's state: the model it serves (loaded in the background), its load error, and
the counters."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from llamacrab import (
    InvalidParameterError,
    LlamaError,
    ModelRegistry,
    TemplateError,
    UnknownModelError,
)
from llamacrab._llama import Llama
from llamacrab.server._errors import ApiError
from llamacrab.server._isolation import stop_loading_children
from llamacrab.server._llama_kwargs import given, llama_kwargs
from llamacrab.server._metrics import Metrics
from llamacrab.server._models import lease_error, open_registry, refusal
from llamacrab.server._settings import ServerSettings

log = logging.getLogger("llamacrab.server")


_FACADE_OPTIONS = ("parallel", "max_queue", "chat_format", "mmproj", "media_policy",
                   "draft_model", "prompt_lookup", "draft_max", "draft_n_gpu_layers",
                   "prompt_cache", "prompt_cache_bytes", "lora", "control_vectors",
                   "control_vector_layers")  # fmt: skip


def open_llama(settings: ServerSettings) -> Llama:
    """The Llama the settings describe (a path or a Hub repository)."""
    options = llama_kwargs(settings)
    # Not model or context parameters: a preset does not replace them.
    extra = {k: options.pop(k) for k in _FACADE_OPTIONS if k in options}
    if settings.preset is not None:
        options = _under_flags(settings, options)
    llama = Llama(settings.model, **extra, **options)
    llama.supersede = False  # one slot (speculative decoding): requests wait their turn
    if settings.chat_template is not None and not (settings.embeddings or settings.reranking):
        try:  # a template that cannot render a greeting would fail every chat request
            llama.chat_prompt([{"role": "user", "content": "Hello"}])
        except TemplateError as error:
            llama.close()
            raise InvalidParameterError(
                f"--chat-template {_shown(settings.chat_template)} does not work with this "
                f"model: {error}"
            ) from None
    return llama


def _under_flags(settings: ServerSettings, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` over the settings' preset: the flags left at their defaults yield to it."""
    kept = given(options)
    if settings.n_ctx is None:
        kept.pop("n_ctx", None)
    return {**kept, "preset": settings.preset}


def _shown(template: str) -> str:
    return repr(template) if len(template) <= 60 else repr(template[:57] + "...")


class ServerState:
    """The model (loaded in the background), its load error, and the counters."""

    def __init__(self, settings: ServerSettings, llama: Llama | None,
                 registry: ModelRegistry | None = None) -> None:  # fmt: skip
        self.settings = settings
        self.llama = llama
        self._owns_llama = llama is None  # loaded here, so closed here
        self.error: str | None = None
        # Told when the model fails to load: ``serve`` stops then, as llama-server exits.
        self.on_load_failure: Callable[[], None] | None = None
        self.metrics = Metrics()
        self.created = int(time.time())
        # The multi-model form: models load on demand (ModelLeaseMiddleware), not here.
        if registry is None and settings.multi_model and llama is None:
            registry = open_registry(settings)
        self.registry = registry

    def load(self) -> None:
        try:
            self.llama = open_llama(self.settings)
            log.info("model %s ready", self.settings.alias)
        except Exception as error:  # reported by /health and every route
            self.error = f"{type(error).__name__}: {error}"
            log.error("the model failed to load: %s", self.error)
            if self.on_load_failure is not None:
                self.on_load_failure()

    def close_models(self) -> None:
        """Close the models this server opened (or the registry it serves): the server stops.
        A request still using one ends as one whose model closed (503 ``shutting_down``)."""
        if self.registry is not None:
            stop_loading_children()
            self.registry.close()
        elif self._owns_llama and self.llama is not None:
            self.llama.close()

    def ready(self, model: str | None) -> Llama:
        if self.registry is not None:
            return self._entry_llama(model, None)
        if self.llama is None:
            if self.error is not None:
                raise ApiError(503, f"the model failed to load: {self.error}", code="load_failed")
            raise ApiError(503, "the model is still loading", code="loading")
        return self.served(model, self.llama)

    def served(self, model: str | None, llama: Llama) -> Llama:
        """The Llama that answers for ``model``. A server of one model answers for any name:
        clients hard-code names (gpt-3.5-turbo, text-embedding-3-small), and llama-server
        and other local servers accept them all. A multi-model form would look the name up
        here and answer 404 (code model_not_found) for a name it does not serve."""
        return llama

    def model_name(self, model: str | None) -> str:
        """The entry a request names (without a name, the only entry if there is one)."""
        if self.registry is None:
            return self.settings.alias
        names = self.registry.names()
        if model is None:
            if len(names) == 1:
                return names[0]
            raise ApiError(400, f"this server serves several models: name one of "
                           f"{', '.join(names)} in model", param="model")  # fmt: skip
        if model not in names:
            raise lease_error(UnknownModelError(f"no model named {model!r} (registered: "
                                                f"{', '.join(names)})"))  # fmt: skip
        return model

    def _entry_llama(self, model: str | None, wanted: str | None) -> Llama:
        assert self.registry is not None
        name = self.model_name(model)
        kind = self.registry.entry(name).kind
        if wanted is not None and kind != wanted:
            raise refusal(name, kind, wanted)
        try:  # loaded already: the middleware holds it for the request
            return self.registry.get(name)
        except LlamaError as error:
            raise lease_error(error) from None

    def embedder(self, model: str | None) -> Llama:
        if self.registry is not None:
            return self._entry_llama(model, "embeddings")
        llama = self.ready(model)
        if not self.settings.embeddings:
            raise ApiError(400, "this server was not started with --embeddings")
        return llama

    def reranker(self, model: str | None) -> Llama:
        if self.registry is not None:
            return self._entry_llama(model, "rerank")
        llama = self.ready(model)
        if not self.settings.reranking:
            raise ApiError(400, "this server was not started with --reranking")
        return llama

    def generator(self, model: str | None) -> Llama:
        if self.registry is not None:
            return self._entry_llama(model, "generation")
        if self.settings.embeddings or self.settings.reranking:
            raise ApiError(400, "this server was started for embeddings or reranking; it does "
                           "not generate text")  # fmt: skip
        return self.ready(model)

    def slots(self) -> tuple[int, int, int]:
        llamas = [self.llama]
        if self.registry is not None:
            llamas = [self.registry.loaded(name) for name in self.registry.names()]
        schedulers = [llama.scheduler for llama in llamas if llama is not None and llama.scheduler]
        return (sum(len(s.slots) for s in schedulers), sum(s.busy_slots for s in schedulers),
                sum(s.queue_depth for s in schedulers))  # fmt: skip
