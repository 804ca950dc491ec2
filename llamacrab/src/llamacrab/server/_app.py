"""The FastAPI application: middleware, error handlers, and the OpenAI routes over one Llama
(its parallel slots do the batching). Route groups of other APIs live in modules of their own."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException
from starlette.requests import Request

from llamacrab import __version__
from llamacrab._exceptions import LlamaError
from llamacrab._llama import Llama
from llamacrab._registry import ModelRegistry
from llamacrab._types import ChatCompletion, ChatCompletionChunk
from llamacrab.server import _legacy_functions as legacy_functions
from llamacrab.server import _wire as wire
from llamacrab.server._anthropic import add_anthropic_routes
from llamacrab.server._cors import CorsMiddleware, cors_headers
from llamacrab.server._errors import (
    ApiError,
    error_response,
    from_llama_error,
    invalid_body,
    unknown_url,
)
from llamacrab.server._guards import (
    AuthMiddleware,
    BodyLimitMiddleware,
    MetricsMiddleware,
    content_type_problem,
)
from llamacrab.server._json_body import JsonBodyRoute
from llamacrab.server._llama_fields import completion_fields, token_kwargs
from llamacrab.server._llama_kwargs import llama_kwargs
from llamacrab.server._llama_server import add_llama_server_routes
from llamacrab.server._lora import add_lora_routes, request_lora
from llamacrab.server._models import (
    ModelLeaseMiddleware,
    add_model_routes,
    load_pinned,
    model_card,
    model_json,
    render_metrics,
    status_json,
)
from llamacrab.server._request_id import RequestIdMiddleware, id_headers
from llamacrab.server._requested_lora import RequestedLoraMiddleware
from llamacrab.server._responses import add_responses_routes
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
    ModelList,
    ModelOut,
    RerankRequest,
    RerankResponse,
    TokenizeRequest,
    TokenizeResponse,
    model_list,
)
from llamacrab.server._settings import ServerSettings
from llamacrab.server._state import ServerState
from llamacrab.server._streaming import ERRORS, complete, generate, in_thread


def create_app(
    settings: ServerSettings, llama: Llama | None = None, registry: ModelRegistry | None = None
) -> FastAPI:
    """The application. Without ``llama`` it loads ``settings.model`` in the background
    (``/health`` answers 503 until it is ready). ``registry``: serve it (the multi-model form)
    instead of the one ``--models`` / ``--models-dir`` name."""
    if not settings.multi_model and registry is None:
        llama_kwargs(settings)  # model flags that cannot work together fail at start
    state = ServerState(settings, llama, registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Each whole answer (a completion, embeddings) holds a worker thread while it waits for
        # the engine; a stream has a thread of its own (async_chunks).
        workers = max(32, 4 * settings.parallel + 8)
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(workers))
        if state.registry is not None:
            load_pinned(state.registry)
        elif state.llama is None:
            threading.Thread(target=state.load, name="llamacrab-load", daemon=True).start()
        yield
        state.close_models()

    # No redirect of /v1/embeddings/ to /v1/embeddings: a 404, as llama-server's exact paths
    # answer (a 307 re-sends a POST; answered after the model middleware, it also loaded the
    # model it named).
    app = FastAPI(title="llamacrab", version=__version__, lifespan=lifespan,
                  description="An OpenAI-compatible server over llama.cpp",
                  redirect_slashes=False)  # fmt: skip
    app.router.route_class = JsonBodyRoute  # every route added below
    app.state.llamacrab = state
    if state.registry is not None:  # innermost: after the key and body-size checks
        app.add_middleware(ModelLeaseMiddleware, registry=state.registry, router=app.router,
                           timeout=settings.timeout, free_paths=_docs_paths(app))  # fmt: skip
        add_model_routes(app, state.registry, state.created)
    app.add_middleware(RequestedLoraMiddleware)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes)
    if settings.api_keys:
        app.add_middleware(AuthMiddleware, keys=settings.api_keys,
                           open_paths=("/health", "/v1/health"))  # fmt: skip
    # Outside the key check: a browser's preflight carries no key; it is answered for any
    # origin.
    app.add_middleware(CorsMiddleware, origins=settings.cors_origins,
                       origin_regex=settings.cors_origin_regex)  # fmt: skip
    app.add_middleware(RequestIdMiddleware)  # outermost: on every answer, a preflight's too
    _install_error_handlers(app)
    _add_routes(app, state)
    add_responses_routes(app, state)
    add_anthropic_routes(app, state)
    add_llama_server_routes(app, state)
    add_lora_routes(app, state)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        # In the shape of the API the path belongs to: an unknown route under /v1/messages
        # (an Anthropic SDK's batches, say) answers as Anthropic does.
        return error_response(request.url.path, error)

    @app.exception_handler(LlamaError)
    async def llama_error(request: Request, error: LlamaError) -> JSONResponse:
        return await api_error(request, from_llama_error(error))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        unread = content_type_problem(request.headers, error.errors())
        if unread is not None:
            return await api_error(request, ApiError(400, unread))
        return await api_error(request, invalid_body(error.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        if error.status_code == 404 and "route" not in request.scope:  # the router's own
            return await api_error(request, unknown_url(request.method, request.url.path))
        detail = str(error.detail)
        if isinstance(error.__cause__, RecursionError):  # FastAPI's "error parsing the body"
            detail = ("the body's JSON nests deeper than this server reads (Python's parser "
                      "stops near 1,000 levels)")  # fmt: skip
        answer = await api_error(request, ApiError(error.status_code, detail))
        answer.headers.update(error.headers or {})  # a 405's Allow, which it must carry
        return answer

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        # A bug, not the client's fault; still an answer its SDK can read (the traceback
        # goes to the log: Starlette raises the error again once this has answered).
        internal = ApiError(500, f"internal server error: {type(error).__name__}: {error}")
        answer = await api_error(request, internal)
        answer.headers.update({**id_headers(request.scope), **cors_headers(request.scope)})
        return answer


def _docs_paths(app: FastAPI) -> frozenset[str]:
    """The paths of FastAPI's own pages (the OpenAPI schema, Swagger UI, ReDoc)."""
    paths = (app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url)
    return frozenset(path for path in paths if path)


def _add_routes(app: FastAPI, state: ServerState) -> None:
    settings = state.settings

    @app.get("/health", responses=ERRORS)
    async def health(model: str | None = None) -> JSONResponse:
        if state.registry is not None:
            return _models_health(state, model)
        if state.llama is not None:
            return JSONResponse({"status": "ok"})
        body = {"status": "error", "error": state.error} if state.error else {"status": "loading"}
        return JSONResponse(body, status_code=503)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> Any:
        registry = state.registry
        if registry is not None:  # every entry, with its status (llama-server's router)
            data = [model_json(s, state.created, registry.loaded(s.name))
                    for s in registry.entries()]  # fmt: skip
            return JSONResponse(model_list(data))
        return JSONResponse(model_list([model_card(settings.alias, state.created, state.llama)]))

    @app.get("/v1/models/{model_id:path}", response_model=ModelOut, responses=ERRORS)
    async def model(model_id: str) -> Any:
        """One model (OpenAI's and Anthropic's ``models.retrieve``): a listed one only."""
        if state.registry is not None:
            if model_id not in state.registry:
                raise ApiError(404, f"no model {model_id!r}: GET /v1/models lists them",
                               code="model_not_found")  # fmt: skip
            loaded = state.registry.loaded(model_id)
            return JSONResponse(model_json(state.registry.status(model_id), state.created, loaded))
        if model_id != settings.alias:
            raise ApiError(404, f"no model {model_id!r}: this server lists one, "
                           f"{settings.alias!r}", code="model_not_found")  # fmt: skip
        return JSONResponse(model_card(settings.alias, state.created, state.llama))

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> str:
        text = state.metrics.render(*state.slots())
        return text + render_metrics(state.registry) if state.registry is not None else text

    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
    async def completions(body: CompletionRequest, client: Request) -> Any:
        llama = state.generator(body.model)
        prompts = wire.completion_prompts(body, settings)
        kwargs = wire.completion_kwargs(body, settings)
        kwargs.update(await in_thread(completion_fields, body, llama))
        kwargs.update(request_lora(body.lora, llama))
        suffix = wire.insertion(body, prompts)
        if suffix is None:
            stream, create = llama.stream_completion, llama.create_completion
        else:  # the model's FIM tokens put the answer between the prompt and the suffix
            stream = partial(llama.stream_infill, suffix=suffix)
            create = partial(llama.create_infill, suffix=suffix)
        if len(prompts) > 1 and not body.stream:  # in turn within one --timeout
            deadline = time.monotonic() + settings.timeout
            results = [await complete(state, client, partial(create, p, **kwargs), deadline)
                       for p in prompts]  # fmt: skip
            alias = state.model_name(body.model)
            return wire.completion(wire.joined_completions(results, body.n), alias)
        return await generate(
            state, client, body, [partial(stream, p, **kwargs) for p in prompts],
            partial(create, prompts[0], **kwargs), wire.completion_chunk, wire.completion,
        )  # fmt: skip

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
    async def chat_completions(body: ChatCompletionRequest, client: Request) -> Any:
        llama = state.generator(body.model)
        kwargs = wire.chat_kwargs(body, settings)
        kwargs["add_generation_prompt"] = body.add_generation_prompt  # llama-server's field
        kwargs.update(await in_thread(token_kwargs, body, llama))
        kwargs.update(request_lora(body.lora, llama))
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        messages = legacy_functions.messages_of(messages)
        legacy = bool(body.functions)
        parallel = body.parallel_tool_calls is not False and not legacy
        calls = wire.may_call_tools(kwargs)

        def chunk(value: ChatCompletionChunk, model: str) -> list[dict[str, Any]]:
            shaped = wire.chat_chunk(value, model, parallel, calls)
            return legacy_functions.events(shaped) if legacy else shaped

        def answer(value: ChatCompletion, model: str) -> dict[str, Any]:
            shaped = wire.chat_completion(value, model, parallel)
            return legacy_functions.answer(shaped) if legacy else shaped

        return await generate(
            state, client, body, [partial(llama.stream_chat_completion, messages, **kwargs)],
            partial(llama.create_chat_completion, messages, **kwargs), chunk, answer,
        )  # fmt: skip

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=ERRORS)
    async def embeddings(body: EmbeddingRequest) -> Any:
        llama = state.embedder(body.model)
        width = llama.model.n_embd_out
        # The model's own width is what every answer has; a shorter vector is only meaningful
        # for models trained to be cut (OpenAI's text-embedding-3), which nothing here can tell.
        if body.dimensions is not None and body.dimensions != width:
            raise ApiError(400, f"this model's embeddings have {width} dimensions; dimensions "
                           "must be that or absent (this server does not shorten them)",
                           param="dimensions")  # fmt: skip
        if llama.context.pooling == "none":
            raise ApiError(400, "this model's embeddings are not pooled (pooling none), and "
                           "/v1/embeddings returns one vector per input: start the server with "
                           "--pooling mean, cls or last", code="pooling_none")  # fmt: skip
        # Texts or token ids (Llama.embed takes both; its annotation names texts only).
        inputs: Any = wire.embedding_inputs(body.input)
        with state.metrics.working_on():
            vectors = await in_thread(llama.embed, inputs)
        # Tokenizing is C work that can take seconds (llama.cpp's is quadratic in places): never
        # on the event loop, which every other request waits on.
        n_tokens = await in_thread(
            lambda: sum(len(llama.tokenize(t)) if isinstance(t, str) else len(t) for t in inputs)
        )
        state.metrics.tokens(n_tokens, 0)
        data = [wire.embedding(v, i, body.encoding_format) for i, v in enumerate(vectors)]
        usage = {"prompt_tokens": n_tokens, "completion_tokens": 0, "total_tokens": n_tokens}
        return {"object": "list", "data": data, "model": state.model_name(body.model),
                "usage": usage}  # fmt: skip

    @app.post("/v1/rerank", response_model=RerankResponse, responses=ERRORS)
    async def rerank(body: RerankRequest) -> Any:
        llama = state.reranker(body.model)
        # Jina/Cohere bodies name the texts "documents"; Hugging Face TEI's name them "texts"
        # and get TEI's answer: a list of {index, score[, text]} (as llama-server does).
        tei = body.documents is None and body.texts is not None
        documents = body.documents if body.documents is not None else body.texts or []
        if not documents:
            raise ApiError(400, "documents must be a non-empty list of texts", param="documents")
        with state.metrics.working_on():
            results = await in_thread(llama.rerank, body.query, documents, top_n=body.top_n)
        n_tokens = await in_thread(
            lambda: sum(len(llama.tokenize(body.query + d)) for d in documents)
        )
        state.metrics.tokens(n_tokens, 0)
        if tei:
            return JSONResponse([
                {"index": r.index, "score": r.score, **({"text": r.document} if body.return_text
                                                         else {})}
                for r in results
            ])  # fmt: skip
        out = [
            {"index": r.index, "relevance_score": r.score,
             "document": {"text": r.document} if body.return_documents else None}
            for r in results
        ]  # fmt: skip
        usage = {"prompt_tokens": n_tokens, "completion_tokens": 0, "total_tokens": n_tokens}
        return {"object": "list", "model": state.model_name(body.model), "results": out,
                "usage": usage}  # fmt: skip

    for alias in ("/v1/reranking", "/rerank", "/reranking"):
        app.add_api_route(alias, rerank, methods=["POST"], response_model=RerankResponse,
                          responses=ERRORS, include_in_schema=False)  # fmt: skip
    # The other names llama-server answers on.
    app.add_api_route("/v1/health", health, methods=["GET"], include_in_schema=False)
    # HEAD too, as llama-server answers it on its GET routes (a `curl -I` health check).
    for path in ("/health", "/v1/health"):
        app.add_api_route(path, health, methods=["HEAD"], include_in_schema=False)
    app.add_api_route("/models", models, methods=["GET"], response_model=ModelList,
                      include_in_schema=False)  # fmt: skip
    app.add_api_route("/chat/completions", chat_completions, methods=["POST"],
                      response_model=ChatCompletionResponse, responses=ERRORS,
                      include_in_schema=False)  # fmt: skip

    @app.post("/extras/tokenize", response_model=TokenizeResponse, responses=ERRORS)
    async def tokenize(body: TokenizeRequest) -> Any:
        llama = state.ready(body.model)
        tokens = await in_thread(llama.tokenize, body.input, body.add_special, body.parse_special)
        return {"tokens": tokens}

    @app.post("/extras/tokenize/count", response_model=CountResponse, responses=ERRORS)
    async def tokenize_count(body: TokenizeRequest) -> Any:
        llama = state.ready(body.model)
        tokens = await in_thread(llama.tokenize, body.input, body.add_special, body.parse_special)
        return {"count": len(tokens)}

    @app.post("/extras/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
    async def detokenize(body: DetokenizeRequest) -> Any:
        llama = state.ready(body.model)
        return {"text": await in_thread(llama.detokenize, body.tokens)}


def _models_health(state: ServerState, model: str | None) -> JSONResponse:
    """The multi-model form's health: every entry's status, or one (``?model=``): 200 when it
    is loaded or can load on demand, 503 while it loads or after its load failed."""
    assert state.registry is not None
    if model is None:
        models = {s.name: status_json(s) for s in state.registry.entries()}
        return JSONResponse({"status": "ok", "models": models})
    status = state.registry.status(state.model_name(model))
    body = {"status": "ok" if status.status in ("loaded", "unloaded") else status.status,
            "model": status.name, "model_status": status_json(status)}  # fmt: skip
    if status.error is not None:
        body["status"], body["error"] = "error", status.error
    return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)
