"""llama-server's own embedding routes, ``/embedding`` and ``/embeddings``: ``content`` (or
``input``) read as its prompts are, and a list of ``{index, embedding}`` answered, where
``embedding`` holds one vector per token without pooling, else the pooled vector normalized as
``embd_normalize`` asks."""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi import FastAPI

from llamacrab._llama import Llama
from llamacrab.server._errors import ApiError
from llamacrab.server._llama_completion import prompt_tokens, split_prompts
from llamacrab.server._llama_server_schemas import LlamaEmbeddingRequest, Prompt, PromptObject
from llamacrab.server._state import ServerState
from llamacrab.server._streaming import ERRORS, in_thread


def add_embedding_routes(app: FastAPI, state: ServerState) -> None:
    async def embedding(body: LlamaEmbeddingRequest) -> Any:
        llama = state.embedder(body.model)
        field = "content" if body.content is not None else "input"
        content = body.content if body.content is not None else body.input
        if content is None:
            raise ApiError(400, '"input" or "content" must be provided', param="content")
        prompts = split_prompts(content, field)
        if any(isinstance(p, PromptObject) and p.multimodal_data is not None for p in prompts):
            raise ApiError(400, "embeddings take text and token ids, not multimodal_data",
                           param=field)  # fmt: skip
        with state.metrics.working_on():
            tokens, vectors = await in_thread(_embed, llama, prompts, body.embd_normalize)
        state.metrics.tokens(sum(map(len, tokens)), 0)
        return [{"index": i, "embedding": v} for i, v in enumerate(vectors)]

    for path in ("/embedding", "/embeddings"):  # llama-server's names for its own answer
        app.add_api_route(path, embedding, methods=["POST"], responses=ERRORS)


def _embed(
    llama: Llama, prompts: list[Prompt], norm: int
) -> tuple[list[list[int]], list[list[list[float]]]]:
    tokens = [prompt_tokens(llama, p) for p in prompts]
    if any(not t for t in tokens):  # a vocabulary that adds no BOS, and an empty text
        raise ApiError(400, "an input is empty", param="content")
    if llama.context.pooling == "none":
        return tokens, [rows.tolist() for rows in llama.embed_tokens(tokens)]
    pooled = np.asarray(llama.embed(tokens, normalize=False), dtype=np.float64)
    return tokens, [[_normalized(row, norm).tolist()] for row in pooled]


def _normalized(vector: np.ndarray, norm: int) -> np.ndarray:
    """llama.cpp's ``common_embd_normalize``: -1 none, 0 the largest magnitude to 32760 (an
    int16 range), 2 Euclidean, any other p the p-norm; a zero vector stays zero."""
    if norm == -1:
        total = 1.0
    elif norm == 0:
        total = float(np.abs(vector).max(initial=0.0)) / 32760.0
    else:
        with np.errstate(over="ignore"):  # a large p: inf, and so zeros, as llama.cpp gives
            total = float(np.sum(np.abs(vector) ** norm) ** (1.0 / norm))
    scale = 1.0 / total if total > 0 else 0.0
    return (vector * scale).astype(np.float32)
