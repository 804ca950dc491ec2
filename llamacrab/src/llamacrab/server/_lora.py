"""LoRA adapters over HTTP, as llama-server has them: ``GET /lora-adapters`` lists the adapters
loaded at start (``--lora``, ``--lora-scaled``; ids in that order) with their default scales,
``POST /lora-adapters`` sets the default scales (``[{"id": 0, "scale": 0.5}]``; an adapter
left out gets 0; scales under which the logits overflow are refused, the old ones kept), and a
request's ``lora`` field does the same for that request alone."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from llamacrab import ConcurrentUseError
from llamacrab._llama import Llama
from llamacrab.server._errors import ApiError
from llamacrab.server._requested_lora import ask_for
from llamacrab.server._schemas import LoraEntry
from llamacrab.server._state import ServerState
from llamacrab.server._streaming import ERRORS, in_thread


def request_lora(entries: list[LoraEntry] | None, llama: Llama) -> dict[str, Any]:
    """The ``lora=`` keyword for a request's ``lora`` field: listed adapters at their scales,
    the others off. Absent or empty: the default scales (nothing to pass)."""
    if not entries:
        return {}
    scales = _scales(entries, llama)
    defaults = llama.lora_adapters
    if any(scale != defaults.get(adapter, 0.0) for adapter, scale in scales.items()):
        ask_for({entry.id: entry.scale for entry in entries})  # an overflow is then the client's
    return {"lora": scales}


def _scales(entries: list[LoraEntry], llama: Llama) -> dict[Any, float]:
    adapters = llama.adapters
    scales = dict.fromkeys(adapters, 0.0)
    for entry in entries:
        if not 0 <= entry.id < len(adapters):
            raise ApiError(400, f"no LoRA adapter with id {entry.id} (this server has "
                           f"{len(adapters)})", param="lora")  # fmt: skip
        scales[adapters[entry.id]] = entry.scale
    return scales


def _try_out(llama: Llama, scales: dict[Any, float]) -> None:
    """Sample one token under ``scales`` (as one request's, the defaults untouched): logits
    that overflow raise the DecodeError a request's own scales would, before every later
    request fails under them."""
    llama.create_completion(llama.tokenize("Hello"), max_tokens=1, lora=scales, temperature=0.0)


def describe(llama: Llama) -> list[dict[str, Any]]:
    """llama-server's fields for each adapter."""
    defaults = llama.lora_adapters
    result = []
    for index, adapter in enumerate(llama.adapters):
        metadata = adapter.metadata
        entry: dict[str, Any] = {
            "id": index, "path": str(adapter.path), "scale": defaults.get(adapter, 0.0),
            "task_name": metadata.get("adapter.lora.task_name", ""),
            "prompt_prefix": metadata.get("adapter.lora.prompt_prefix", ""),
        }  # fmt: skip
        if adapter.alora_invocation_tokens:
            tokens = list(adapter.alora_invocation_tokens)
            entry["alora_invocation_string"] = llama.detokenize(tokens, special=True)
            entry["alora_invocation_tokens"] = tokens
        result.append(entry)
    return result


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/lora-adapters", responses=ERRORS)
    async def get_lora_adapters(model: str | None = None) -> list[dict[str, Any]]:
        return describe(state.generator(model))

    @app.post("/lora-adapters", responses=ERRORS)
    async def set_lora_adapters(body: list[LoraEntry], model: str | None = None) -> dict[str, Any]:
        llama = state.generator(model)
        scales = _scales(body, llama)
        if any(scales.values()):
            ask_for({entry.id: entry.scale for entry in body})  # an overflow is the client's
            await in_thread(_try_out, llama, scales)
        try:
            await in_thread(llama.set_lora_adapters, scales)
        except ApiError as error:
            if isinstance(error.__cause__, ConcurrentUseError):
                raise ApiError(409, str(error.__cause__), code="busy") from None
            raise
        return {"success": True}
