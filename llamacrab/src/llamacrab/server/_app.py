"""The FastAPI application: routes over one Llama (its parallel slots do the batching)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import Request

from llamacrab import MediaPolicy, Stream, __version__
from llamacrab._exceptions import LlamaError
from llamacrab._llama import Llama
from llamacrab._types import ChatCompletion, ChatCompletionChunk, Completion, CompletionChunk
from llamacrab.server import _wire as wire
from llamacrab.server._errors import ApiError, from_llama_error
from llamacrab.server._guards import AuthMiddleware, BodyLimitMiddleware, MetricsMiddleware
from llamacrab.server._metrics import Metrics
from llamacrab.server._schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    CountResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    GenerationFields,
    ModelList,
    RerankRequest,
    RerankResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from llamacrab.server._settings import ServerSettings

log = logging.getLogger("llamacrab.server")
_Chunk = TypeVar("_Chunk", CompletionChunk, ChatCompletionChunk)
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 503, 504)
}


def open_llama(settings: ServerSettings) -> Llama:
    """The Llama the settings describe (a path or a Hub repository)."""
    options: dict[str, Any] = {
        "n_batch": settings.n_batch, "n_ubatch": settings.n_ubatch,
        "n_threads": settings.n_threads, "n_gpu_layers": settings.n_gpu_layers,
        "flash_attn": settings.flash_attn, "filename": settings.hf_filename,
        "revision": settings.hf_revision, "token": settings.hf_token,
        "cache_dir": settings.hf_cache_dir, "endpoint": settings.hf_endpoint,
        "offline": settings.hf_offline, "mmproj": settings.hf_mmproj or None,
    }  # fmt: skip
    if settings.embeddings or settings.reranking:
        pooling = "rank" if settings.reranking else settings.pooling
        options.update(embeddings=True, pooling=pooling, n_ctx=settings.n_ctx)
        extra: dict[str, Any] = {}
    else:
        options["n_ctx"] = settings.n_ctx or 4096 * settings.parallel
        # Clients send media inline (data: URLs): they cannot make the server read its files
        # or fetch URLs.
        policy = MediaPolicy(local_files=False, remote=False, max_media=settings.max_media,
                             max_bytes=settings.max_body_bytes)  # fmt: skip
        extra = {"parallel": settings.parallel, "max_queue": settings.max_queue,
                 "chat_format": settings.chat_template, "mmproj": settings.mmproj,
                 "media_policy": policy}  # fmt: skip
    given = {k: v for k, v in options.items() if v is not None}
    return Llama(settings.model, **extra, **given)


class ServerState:
    """The model (loaded in the background), its load error, and the counters."""

    def __init__(self, settings: ServerSettings, llama: Llama | None) -> None:
        self.settings = settings
        self.llama = llama
        self.error: str | None = None
        self.metrics = Metrics()
        self.created = int(time.time())

    def load(self) -> None:
        try:
            self.llama = open_llama(self.settings)
            log.info("model %s ready", self.settings.alias)
        except Exception as error:  # reported by /health and every route
            self.error = f"{type(error).__name__}: {error}"
            log.error("the model failed to load: %s", self.error)

    def ready(self, model: str | None) -> Llama:
        if self.llama is None:
            if self.error is not None:
                raise ApiError(503, f"the model failed to load: {self.error}", code="load_failed")
            raise ApiError(503, "the model is still loading", code="loading")
        if model is not None and model not in (self.settings.alias, self.settings.model):
            raise ApiError(404, f"model {model!r} is not served here; this server serves "
                           f"{self.settings.alias!r}", param="model",
                           code="model_not_found")  # fmt: skip
        return self.llama

    def generator(self, model: str | None) -> Llama:
        if self.settings.embeddings or self.settings.reranking:
            raise ApiError(400, "this server was started for embeddings or reranking; it does "
                           "not generate text")  # fmt: skip
        return self.ready(model)

    def slots(self) -> tuple[int, int, int]:
        scheduler = self.llama.scheduler if self.llama is not None else None
        if scheduler is None:
            return 0, 0, 0
        return len(scheduler.slots), scheduler.busy_slots, scheduler.queue_depth


async def _in_thread(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return await asyncio.to_thread(function, *args, **kwargs)
    except LlamaError as error:
        raise from_llama_error(error) from error


def _event(payload: object) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _sse(
    state: ServerState,
    stream: Stream[_Chunk],
    encode: Callable[[_Chunk], dict[str, Any]],
    include_usage: bool,
) -> StreamingResponse:
    """Server-sent events from a stream. The first chunk is awaited before answering, so an
    error there (a full queue, a bad grammar) gets its proper status."""
    chunks = aiter(stream)
    try:
        first = await anext(chunks)
    except LlamaError as error:
        raise from_llama_error(error) from error

    async def events() -> AsyncIterator[str]:
        chunk = first
        try:
            while True:
                if chunk.finish_reason == "cancelled":
                    timeout = state.settings.timeout
                    yield _event(ApiError(504, f"the request ran past {timeout} s").body())
                    break
                yield _event(encode(chunk))
                if chunk.finish_reason is not None:
                    if chunk.usage is not None:
                        usage = chunk.usage
                        state.metrics.tokens(usage.prompt_tokens, usage.completion_tokens)
                        if include_usage:
                            yield _event({**encode(chunk), "choices": [],
                                          "usage": wire.usage(usage)})  # fmt: skip
                    break
                chunk = await anext(chunks)
        except LlamaError as error:
            yield _event(from_llama_error(error).body())
        finally:
            with anyio.CancelScope(shield=True):  # a client that left: free its slot now
                await chunks.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})  # fmt: skip


async def _generate(
    state: ServerState,
    client: Request,
    body: GenerationFields,
    stream: Callable[[], Stream[_Chunk]],
    create: Callable[..., Completion | ChatCompletion],
    chunk_json: Callable[[_Chunk, str], dict[str, Any]],
    result_json: Callable[[Any, str], dict[str, Any]],
) -> Any:
    """A streamed (SSE) or whole answer to a completion or chat request."""
    alias = state.settings.alias
    if body.stream:
        include = bool(body.stream_options and body.stream_options.include_usage)
        chunks = await _in_thread(stream)
        return await _sse(state, chunks, lambda chunk: chunk_json(chunk, alias), include)
    result = await _until_disconnected(client, create)
    if any(choice.finish_reason == "cancelled" for choice in result.choices):
        raise ApiError(504, f"the request ran past {state.settings.timeout} s", code="timeout")
    state.metrics.tokens(result.usage.prompt_tokens, result.usage.completion_tokens)
    return result_json(result, alias)


async def _until_disconnected(
    client: Request, create: Callable[..., Completion | ChatCompletion]
) -> Completion | ChatCompletion:
    """A whole completion, stopped early (and its slot freed) if the client goes away."""
    cancel = threading.Event()
    task = asyncio.ensure_future(_in_thread(create, cancel=cancel))
    while not (await asyncio.wait([task], timeout=0.25))[0]:
        if not cancel.is_set() and await client.is_disconnected():
            cancel.set()  # the generation ends "cancelled" within a step
    return task.result()  # type: ignore[no-any-return]


def create_app(settings: ServerSettings, llama: Llama | None = None) -> FastAPI:
    """The application. Without ``llama`` it loads ``settings.model`` in the background
    (``/health`` answers 503 until it is ready)."""
    state = ServerState(settings, llama)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Each streaming client holds a worker thread while it waits for a token.
        workers = max(32, 4 * settings.parallel + 8)
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(workers))
        if state.llama is None:
            threading.Thread(target=state.load, name="llamacrab-load", daemon=True).start()
        yield
        if llama is None and state.llama is not None:
            state.llama.close()

    app = FastAPI(title="llamacrab", version=__version__, lifespan=lifespan,
                  description="An OpenAI-compatible server over llama.cpp")  # fmt: skip
    app.state.llamacrab = state
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes)
    if settings.api_keys:
        app.add_middleware(AuthMiddleware, keys=settings.api_keys, open_paths=("/health",))
    if settings.cors_origins:  # outermost: preflight requests carry no key
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                           allow_methods=["*"], allow_headers=["*"])  # fmt: skip
    _install_error_handlers(app)
    _add_routes(app, state)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(LlamaError)
    async def llama_error(request: Request, error: LlamaError) -> JSONResponse:
        return await api_error(request, from_llama_error(error))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = [
            f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}"
            for e in error.errors()
        ]
        return await api_error(request, ApiError(400, "; ".join(problems)))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return await api_error(request, ApiError(error.status_code, str(error.detail)))


def _add_routes(app: FastAPI, state: ServerState) -> None:
    settings = state.settings

    @app.get("/health", responses=_ERRORS)
    async def health() -> JSONResponse:
        if state.llama is not None:
            return JSONResponse({"status": "ok"})
        body = {"status": "error", "error": state.error} if state.error else {"status": "loading"}
        return JSONResponse(body, status_code=503)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> dict[str, Any]:
        model = {"id": settings.alias, "object": "model", "created": state.created,
                 "owned_by": "llamacrab"}  # fmt: skip
        return {"object": "list", "data": [model]}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> str:
        return state.metrics.render(*state.slots())

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(body: CompletionRequest, client: Request) -> Any:
        llama = state.generator(body.model)
        prompt, kwargs = wire.completion_prompt(body), wire.completion_kwargs(body, settings)
        return await _generate(
            state, client, body, partial(llama.stream_completion, prompt, **kwargs),
            partial(llama.create_completion, prompt, **kwargs),
            wire.completion_chunk, wire.completion,
        )  # fmt: skip

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, client: Request) -> Any:
        llama = state.generator(body.model)
        kwargs = wire.chat_kwargs(body, settings)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        return await _generate(
            state, client, body, partial(llama.stream_chat_completion, messages, **kwargs),
            partial(llama.create_chat_completion, messages, **kwargs),
            wire.chat_chunk, wire.chat_completion,
        )  # fmt: skip

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERRORS)
    async def embeddings(body: EmbeddingRequest) -> Any:
        llama = state.ready(body.model)
        if not settings.embeddings:
            raise ApiError(400, "this server was not started with --embeddings")
        if body.dimensions is not None:
            raise ApiError(400, "dimensions is not supported", param="dimensions")
        texts = [body.input] if isinstance(body.input, str) else body.input
        if not all(isinstance(t, str) for t in texts):
            raise ApiError(400, "send input as text (token arrays are not supported)",
                           param="input")  # fmt: skip
        vectors = await _in_thread(llama.embed, texts)
        n_tokens = sum(len(llama.tokenize(str(t))) for t in texts)
        data = [wire.embedding(v, i, body.encoding_format) for i, v in enumerate(vectors)]
        usage = {"prompt_tokens": n_tokens, "completion_tokens": 0, "total_tokens": n_tokens}
        return {"object": "list", "data": data, "model": settings.alias, "usage": usage}

    @app.post("/v1/rerank", response_model=RerankResponse, responses=_ERRORS)
    async def rerank(body: RerankRequest) -> Any:
        llama = state.ready(body.model)
        if not settings.reranking:
            raise ApiError(400, "this server was not started with --reranking")
        results = await _in_thread(llama.rerank, body.query, body.documents, top_n=body.top_n)
        out = [
            {"index": r.index, "relevance_score": r.score,
             "document": {"text": r.document} if body.return_documents else None}
            for r in results
        ]  # fmt: skip
        n_tokens = sum(len(llama.tokenize(body.query + d)) for d in body.documents)
        usage = {"prompt_tokens": n_tokens, "completion_tokens": 0, "total_tokens": n_tokens}
        return {"object": "list", "model": settings.alias, "results": out, "usage": usage}

    for alias in ("/v1/reranking", "/rerank", "/reranking"):
        app.add_api_route(alias, rerank, methods=["POST"], response_model=RerankResponse,
                          responses=_ERRORS, include_in_schema=False)  # fmt: skip

    @app.post("/extras/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> Any:
        llama = state.ready(body.model)
        return {"tokens": llama.tokenize(body.input, body.add_special, body.parse_special)}

    @app.post("/extras/tokenize/count", response_model=CountResponse, responses=_ERRORS)
    async def tokenize_count(body: TokenizeRequest) -> Any:
        llama = state.ready(body.model)
        return {"count": len(llama.tokenize(body.input, body.add_special, body.parse_special))}

    @app.post("/extras/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> Any:
        llama = state.ready(body.model)
        return {"text": llama.detokenize(body.tokens)}
