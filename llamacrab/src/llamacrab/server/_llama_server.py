"""llama-server's own routes, where llamacrab has the engine for them, with llama-server's field
names: ``/completion`` and ``/infill`` (``_llama_completion.py``), ``/apply-template``,
``/tokenize`` and ``/detokenize``, ``/props``, ``/slots`` with save/restore of a slot's state,
and OpenAI's ``/v1/audio/transcriptions`` (with an audio projector). Each is a translation onto
the Python API: the same engine, limits, API keys, cancellation and metrics as the OpenAI
routes."""

from __future__ import annotations

import asyncio
import base64
import re
import time
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from fastapi import FastAPI, File, Form, UploadFile
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.requests import Request

from llamacrab import ConcurrentUseError, SavedState, SlotInfo, build_info
from llamacrab._llama import Llama
from llamacrab._types import ChatCompletionChunk, Usage
from llamacrab.server._errors import ApiError
from llamacrab.server._generation_settings import default_settings
from llamacrab.server._llama_completion import add_completion_routes, mixed_tokens
from llamacrab.server._llama_embedding import add_embedding_routes
from llamacrab.server._llama_server_schemas import (
    ApplyTemplateRequest,
    ApplyTemplateResponse,
    LlamaDetokenizeRequest,
    LlamaDetokenizeResponse,
    LlamaTokenizeRequest,
    LlamaTokenizeResponse,
    PropsResponse,
    PropsUpdated,
    SlotActionRequest,
    SlotErased,
    SlotOut,
    SlotRestored,
    SlotSaved,
    TranscriptionResponse,
)
from llamacrab.server._schemas import ChatCompletionRequest, ErrorResponse
from llamacrab.server._settings import ServerSettings
from llamacrab.server._state import ServerState
from llamacrab.server._streaming import ERRORS, complete, event, in_thread, sse_events
from llamacrab.server._wire import chat_kwargs, template_variables

# Slot files: a plain name in --slot-save-path, never a path.
_SLOT_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_PARTIAL = ".partial"  # SavedState.save writes NAME.<random>.partial, then renames it
_ASR_PROMPT = "Transcribe audio to text"  # llama-server's instruction
_TRANSCRIPT_FORMATS = ("json", "text")
# What Context.unmatchable names, with the flags that set it.
_RESTORE_MISMATCH = {
    "KV settings": "KV settings (--flash-attn, --cache-type-k/-v, --rope-*, --yarn-*, "
    "--parallel: a KV stream per slot)",
    "control vector": "control vectors (--control-vector*)",
    "LoRA files": "LoRA adapter files (--lora: one is not loaded here, moved or changed)",
}
_SLOT_ERRORS: dict[int | str, dict[str, Any]] = {
    **ERRORS, **{status: {"model": ErrorResponse} for status in (403, 409, 500, 501)}
}  # fmt: skip


def add_llama_server_routes(app: FastAPI, state: ServerState) -> None:
    """llama-server's routes (see the module's docstring)."""
    add_completion_routes(app, state)
    add_embedding_routes(app, state)
    _add_text_routes(app, state)
    _add_server_routes(app, state)
    _add_transcriptions(app, state)


# -- infill, templates and tokens ----------------------------------------------------------------


def _add_text_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/apply-template", response_model=ApplyTemplateResponse, responses=ERRORS)
    async def apply_template(body: ApplyTemplateRequest) -> Any:
        llama = state.ready(body.model)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        variables = template_variables(body.chat_template_kwargs, body.reasoning_effort)
        # A last assistant message is continued there, as llama-server does (a prefill).
        prompt = partial(llama.chat_prompt, messages, None, tools, variables,
                         add_generation_prompt=body.add_generation_prompt)  # fmt: skip
        return {"prompt": await in_thread(prompt)}

    @app.post("/tokenize", response_model=LlamaTokenizeResponse, responses=ERRORS)
    async def tokenize(body: LlamaTokenizeRequest) -> Any:
        llama = state.ready(body.model)
        tokens = await in_thread(mixed_tokens, llama, body.content, body.add_special,
                                 body.parse_special)  # fmt: skip
        # Built and encoded in a worker thread: an 8 MiB body is millions of tokens, which
        # took the event loop (every other request) for a minute and a half.
        if not body.with_pieces:
            return await in_thread(JSONResponse, {"tokens": tokens})
        return await in_thread(_tokens_with_pieces, llama, tokens)

    @app.post("/detokenize", response_model=LlamaDetokenizeResponse, responses=ERRORS)
    async def detokenize(body: LlamaDetokenizeRequest) -> Any:
        llama = state.ready(body.model)
        return {"content": await in_thread(_joined_pieces, llama, body.tokens)}


def _joined_pieces(llama: Llama, tokens: list[int]) -> str:
    """The tokens' pieces joined, as llama-server detokenizes: special tokens as their text,
    and a leading space kept (llama_detokenize drops the one a SentencePiece vocabulary adds)."""
    vocab = llama.vocab
    # Each distinct token looked up once: a million ids cost 10 s one by one.
    distinct, order = np.unique(vocab.check_tokens(tokens), return_inverse=True)
    pieces = [vocab.token_to_bytes(token, special=True) for token in distinct.tolist()]
    raw = b"".join([pieces[index] for index in order.ravel().tolist()])
    return raw.decode("utf-8", "replace")


def _tokens_with_pieces(llama: Llama, tokens: list[int]) -> JSONResponse:
    """/tokenize's answer with each token's piece, looked up once per distinct token."""
    pieces: dict[int, str | list[int]] = {}
    listed = []
    for token in tokens:
        piece = pieces.get(token)
        if piece is None:
            piece = pieces[token] = _piece(llama, token)
        listed.append({"id": token, "piece": piece})
    return JSONResponse({"tokens": listed})


def _piece(llama: Llama, token: int) -> str | list[int]:
    """A token's text, or its bytes when they are not UTF-8 on their own (as llama-server)."""
    raw = llama.vocab.token_to_bytes(token, special=True)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


# -- props and slots -----------------------------------------------------------------------------


def _add_server_routes(app: FastAPI, state: ServerState) -> None:
    settings = state.settings
    build = _build_info()
    slot_files = asyncio.Lock()  # one save or restore at a time: a name is written whole

    # ``model``: which model, where the server has several (as llama-server's router reads it).
    @app.get("/props", response_model=PropsResponse, responses=ERRORS)
    async def props(model: str | None = None) -> Any:
        # A template's capabilities are found by rendering it (once): not on the event loop.
        return await in_thread(_props, state.ready(model), settings, build,
                               state.model_name(model))  # fmt: skip

    @app.post("/props", response_model=PropsUpdated, responses=_SLOT_ERRORS)
    async def change_props(body: dict[str, Any] | None = None, model: str | None = None) -> Any:
        state.ready(model)
        if not settings.props:
            raise ApiError(403, "this server's properties are read-only: start it with --props "
                           "to allow POST /props", code="props_read_only")  # fmt: skip
        if body:
            raise ApiError(400, f"no property can be changed on this server (given: "
                           f"{', '.join(sorted(body))}); POST /props accepts {{}} only",
                           code="props_not_writable")  # fmt: skip
        return {"success": True}

    @app.get("/slots", response_model=list[SlotOut], responses=ERRORS)
    async def slots(fail_on_no_slot: bool = False, model: str | None = None) -> Any:
        llama = state.ready(model)
        out = [_slot(llama, slot) for slot in llama.slots()]
        if fail_on_no_slot and all(slot["is_processing"] for slot in out):
            raise ApiError(503, "no slot available", code="no_slot_available")
        return out

    @app.post("/slots/{id_slot}", response_model=SlotSaved | SlotRestored | SlotErased,
              responses=_SLOT_ERRORS)  # fmt: skip
    async def slot_action(
        id_slot: int,
        action: str | None = None,
        body: SlotActionRequest | None = None,
        model: str | None = None,
    ) -> Any:
        llama = state.generator(model)
        if settings.slot_save_path is None:
            raise ApiError(501, "this server does not save slots: start it with "
                           "--slot-save-path DIR", code="not_supported")  # fmt: skip
        if action not in ("save", "restore", "erase"):
            raise ApiError(400, "action must be save, restore or erase", param="action")
        n_slots = len(llama.slots())
        if not 0 <= id_slot < n_slots:
            raise ApiError(400, f"invalid slot id {id_slot}: this server has {n_slots} slot(s), "
                           f"0 to {n_slots - 1}", param="id_slot")  # fmt: skip
        try:
            if action == "erase":
                erased = await in_thread(partial(llama.reset, slot=id_slot))
                return {"id_slot": id_slot, "n_erased": erased}
            path = _slot_file(settings.slot_save_path, body.filename if body else None)
            async with slot_files:
                if action == "save":
                    return await _save(llama, id_slot, path)
                return await _restore(llama, id_slot, path)
        except ApiError as error:
            busy = error.__cause__
            if not isinstance(busy, ConcurrentUseError):
                raise
            # llama-server defers the action until the slot is idle; this server answers at
            # once, and the client retries (GET /slots tells which slots are idle).
            raise ApiError(409, str(busy), param="id_slot", code="slot_busy") from busy


def _build_info() -> str:
    info = build_info()
    return (f"llamacrab-{info.package_version}-llama.cpp-{info.llama_cpp_commit[:9]}-"
            f"{info.backend}")  # fmt: skip


def _props(llama: Llama, settings: ServerSettings, build: str, alias: str) -> dict[str, Any]:
    projector = llama.projector
    vocab = llama.vocab
    props = {
        "default_generation_settings": {
            "n_ctx": llama.context.n_ctx_seq, "params": default_settings(llama, settings),
        },
        "total_slots": len(llama.slots()),
        "model_alias": alias,
        "model_path": str(llama.model.path),
        "model_ftype": llama.model.ftype,
        "modalities": {"vision": bool(projector and projector.vision), "video": False,
                       "audio": bool(projector and projector.audio)},
        **_chat_template(llama),
        "bos_token": "" if vocab.bos is None else vocab.token_to_piece(vocab.bos, True),
        "eos_token": "" if vocab.eos is None else vocab.token_to_piece(vocab.eos, True),
        "build_info": build,
        "endpoint_slots": True,
        "endpoint_props": settings.props,
        "endpoint_metrics": True,
        "is_sleeping": False,
    }  # fmt: skip
    if projector is not None:
        props["media_marker"] = llama.media_marker
    return props


def _chat_template(llama: Llama) -> dict[str, Any]:
    """The chat template in use (a built-in format by its name, as llama-server shows one
    named by --chat-template) and, in llama-server's names, what we find it can present."""
    found = llama.chat_template_in_use()
    if found is None:
        return {"chat_template": ""}
    template, caps = found
    return {"chat_template": template, "chat_template_caps": {
        "supports_system_role": caps.system_role, "supports_tools": caps.tools,
        "supports_tool_calls": caps.tool_calls, "supports_object_arguments": caps.object_arguments,
    }}  # fmt: skip


def _slot(llama: Llama, slot: SlotInfo) -> dict[str, Any]:
    """A slot as llama-server lists it: its context, whether it generates now, and the tokens
    its memory holds (``n_prompt_tokens``: prompt and answer, as llama-server counts them)."""
    return {"id": slot.id, "id_task": -1, "n_ctx": slot.n_ctx,
            "speculative": llama.speculative is not None, "is_processing": slot.busy,
            "n_prompt_tokens": slot.n_tokens}  # fmt: skip


def _slot_file(directory: str, filename: str | None) -> Path:
    """``directory/filename`` for a plain file name: letters, digits, '.', '_' and '-', at most
    128, starting with a letter or digit, without '..'; never a path."""
    if not filename:
        raise ApiError(400, "filename is required", param="filename")
    if not _SLOT_FILE.fullmatch(filename) or ".." in filename or filename.endswith(_PARTIAL):
        raise ApiError(400, "invalid filename: a plain name of at most 128 letters, digits, '.', "
                       "'_' or '-', starting with a letter or digit, without '..' or a path",
                       param="filename", code="invalid_filename")  # fmt: skip
    path = Path(directory) / filename
    kind = _not_plain(path)
    if kind is not None:
        raise ApiError(400, f"{filename} is {kind}; slot files are plain files",
                       param="filename", code="invalid_filename")  # fmt: skip
    return path


def _not_plain(path: Path) -> str | None:
    """What ``path`` is where it is there but not a plain file: a save over a directory
    failed as a 500, a restore from it was a 404, one from a FIFO would hang."""
    if path.is_symlink():
        return "a symbolic link"
    if path.is_dir():
        return "a directory"
    if path.exists() and not path.is_file():
        return "a special file"
    return None


async def _save(llama: Llama, id_slot: int, path: Path) -> dict[str, Any]:
    started = time.perf_counter()
    saved: SavedState = await in_thread(partial(llama.save_state, slot=id_slot))
    try:
        await in_thread(saved.save, path)
        written = path.stat().st_size
    except OSError as error:
        raise ApiError(500, f"could not write {path.name}: {error.strerror}") from error
    return {"id_slot": id_slot, "filename": path.name, "n_saved": len(saved.tokens),
            "n_written": written,
            "timings": {"save_ms": (time.perf_counter() - started) * 1000}}  # fmt: skip


async def _restore(llama: Llama, id_slot: int, path: Path) -> dict[str, Any]:
    started = time.perf_counter()
    if not path.is_file():
        raise ApiError(404, f"no saved slot state named {path.name!r}", param="filename",
                       code="slot_file_not_found")  # fmt: skip
    try:
        read = path.stat().st_size
        saved: SavedState = await in_thread(SavedState.load, path)
    except OSError as error:
        raise ApiError(500, f"could not read {path.name}: {error.strerror}") from error
    _check_reusable(llama, saved, path.name)
    await in_thread(partial(llama.load_state, saved, slot=id_slot))
    return {"id_slot": id_slot, "filename": path.name, "n_restored": len(saved.tokens),
            "n_read": read,
            "timings": {"restore_ms": (time.perf_counter() - started) * 1000}}  # fmt: skip


def _check_reusable(llama: Llama, saved: SavedState, name: str) -> None:
    """400 for a state whose memory no request here can reuse (computed with KV settings, a
    control vector or LoRA files this server does not have): restored, it was dropped by the
    next prompt. Per-request LoRA scales are not a reason: a request may ask for them again.
    A state of another model, or one that records no fingerprint, is ``load_state``'s to
    refuse."""
    if saved.kv_fingerprint is None or saved.model_id != llama.model.identity:
        return
    differs = llama.context.unmatchable(saved.kv_fingerprint, llama.adapters)
    if differs:
        other = " and ".join(_RESTORE_MISMATCH[what] for what in differs)
        raise ApiError(400, f"the state in {name!r} was computed with other {other} than this "
                       "server's: no request here could reuse it", param="filename",
                       code="slot_state_mismatch")  # fmt: skip


# -- transcriptions ------------------------------------------------------------------------------


def _add_transcriptions(app: FastAPI, state: ServerState) -> None:
    settings = state.settings

    @app.post("/v1/audio/transcriptions", response_model=TranscriptionResponse,
              responses=ERRORS)  # fmt: skip
    async def transcriptions(
        client: Request,
        file: Annotated[UploadFile, File()],
        model: Annotated[str | None, Form()] = None,
        prompt: Annotated[str | None, Form()] = None,
        response_format: Annotated[str, Form()] = "json",
        language: Annotated[str | None, Form(max_length=64)] = None,
        temperature: Annotated[float | None, Form(ge=0)] = None,
        stream: Annotated[bool, Form()] = False,
    ) -> Any:
        # The form's model, else ?model= (the model the multi-model form leased for it).
        model = model or client.query_params.get("model")
        llama = state.generator(model)
        projector = llama.projector
        if projector is None or not projector.audio:
            raise _no_audio(state, model)
        if response_format not in _TRANSCRIPT_FORMATS:
            raise ApiError(400, f"response_format {response_format!r} is not supported (json, "
                           "text)", param="response_format")  # fmt: skip
        data = await file.read()
        if not data:
            raise ApiError(400, "the audio file is empty", param="file")
        messages = _transcription_messages(data, prompt, language)
        request = ChatCompletionRequest.model_validate(
            {"messages": messages, "temperature": temperature, "stream": stream}
        )
        kwargs = chat_kwargs(request, settings)
        if stream:
            chunks = await in_thread(partial(llama.stream_chat_completion, messages, **kwargs))
            return await sse_events(state, client, chunks, _transcript_events)
        generation = partial(llama.create_chat_completion, messages, **kwargs)
        result = await complete(state, client, generation)
        text = result.choices[0].message.content or ""
        if response_format == "text":
            return PlainTextResponse(text)
        return {"text": text, "usage": _transcript_usage(result.usage)}

    app.add_api_route("/audio/transcriptions", transcriptions, methods=["POST"],
                      response_model=TranscriptionResponse, responses=ERRORS,
                      include_in_schema=False)  # fmt: skip


def _no_audio(state: ServerState, model: str | None) -> ApiError:
    """400 for a model without an audio projector, naming it where the server has several."""
    if state.registry is None:
        who, how = "this server", "start it with --mmproj and a projector that takes audio"
    else:
        who, how = f"model {state.model_name(model)!r}", "give its entry an mmproj that takes audio"
    return ApiError(400, f"{who} cannot transcribe: it has no audio projector ({how})",
                    code="audio_not_supported")  # fmt: skip


def _transcription_messages(
    data: bytes, prompt: str | None, language: str | None
) -> list[dict[str, Any]]:
    """A user turn asking for the transcript, as llama-server builds it: the instruction (or
    the client's prompt), the language, then the sound."""
    text = prompt or _ASR_PROMPT
    if language:
        text += f" (language: {language})"
    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode()}}
    return [{"role": "user", "content": [{"type": "text", "text": text}, audio]}]


def _transcript_usage(usage: Usage | None) -> dict[str, Any]:
    usage = usage or Usage(0, 0)
    return {"type": "tokens", "input_tokens": usage.prompt_tokens,
            "output_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens}  # fmt: skip


async def _transcript_events(chunks: AsyncIterator[ChatCompletionChunk]) -> AsyncIterator[str]:
    """OpenAI's streamed transcript: ``transcript.text.delta`` events, then
    ``transcript.text.done`` with the whole text and the usage."""
    parts: list[str] = []
    try:
        async for chunk in chunks:
            if chunk.delta.content:
                parts.append(chunk.delta.content)
                yield event({"type": "transcript.text.delta", "delta": chunk.delta.content})
            if chunk.finish_reason is not None:
                yield event({"type": "transcript.text.done", "text": "".join(parts),
                             "usage": _transcript_usage(chunk.usage)})  # fmt: skip
    except ApiError as error:
        yield event(error.body())
    yield "data: [DONE]\n\n"
