"""llama-server's own generation routes: ``/completion`` (also ``/completions``) and ``/infill``,
with its field names and its answer (``content``, ``tokens``, ``stop_type``, counts), streamed
as ``data:`` events with ``stop: false`` and a last one with ``stop: true`` (no ``[DONE]``)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from functools import partial
from typing import Any, cast

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.requests import Request

from llamacrab import Chunks, InfillLimits, MediaPolicy, Vocab
from llamacrab._exceptions import MediaError
from llamacrab._llama import Llama
from llamacrab._types import CompletionChunk, Logprobs, Usage
from llamacrab.server._errors import ApiError
from llamacrab.server._generation_settings import used_settings
from llamacrab.server._llama_fields import completion_fields
from llamacrab.server._llama_server_schemas import (
    InfillRequest,
    LlamaCompletionRequest,
    LlamaCompletionResponse,
    NativeGeneration,
    Prompt,
    PromptObject,
    Prompts,
)
from llamacrab.server._lora import request_lora
from llamacrab.server._settings import ServerSettings
from llamacrab.server._state import ServerState
from llamacrab.server._streaming import ERRORS, complete, event, in_thread, sse_events
from llamacrab.server._wire import (
    check_prompt_count,
    generation_kwargs,
    logprobs_kwargs,
    probability_count,
    timings,
)

# llama-server's repository-level FIM layout names the repository and the current file so.
_FIM_REPO, _FIM_FILE = "myproject", "filename"
_STOP_TYPES = {"eos": "eos", "length": "limit", "stop": "word"}


def add_completion_routes(app: FastAPI, state: ServerState) -> None:
    settings = state.settings

    async def completion(body: LlamaCompletionRequest, client: Request) -> Any:
        llama = state.generator(body.model)
        prompts = split_prompts(body.prompt)
        check_prompt_count(len(prompts), settings)
        if len(prompts) > 1 and body.stream:
            raise ApiError(400, "several prompts are answered together, not streamed: stream "
                           "one prompt per request", param="prompt")  # fmt: skip
        kwargs = await in_thread(native_kwargs, body, llama, settings)
        deadline = time.monotonic() + settings.timeout  # one for all its prompts
        answers = []
        for index, prompt in enumerate(prompts):
            kwargs["prompt"] = await in_thread(prompt_input, llama, prompt)
            answers.append(await _answer(state, client, body, llama, kwargs, deadline, index))
        # As llama-server: one prompt, one object; several, a list in their order.
        if len(answers) == 1:
            return _unchecked(answers[0], body)
        return JSONResponse(answers)

    answer_model = LlamaCompletionResponse | list[LlamaCompletionResponse]
    for path in ("/completion", "/completions"):  # llama-server: "legacy" and current names
        app.add_api_route(path, completion, methods=["POST"], responses=ERRORS,
                          response_model=answer_model,
                          response_model_exclude_unset=True)  # fmt: skip

    @app.post("/infill", response_model=LlamaCompletionResponse, responses=ERRORS,
              response_model_exclude_unset=True)  # fmt: skip
    async def infill(body: InfillRequest, client: Request) -> Any:
        llama = state.generator(body.model)
        vocab = llama.vocab
        if body.input_extra and vocab.fim_middle is not None and vocab.fim_file_sep is None:
            raise ApiError(400, "input_extra needs a model with a FIM file-separator token; "
                           "this one has none", param="input_extra")  # fmt: skip
        kwargs = await in_thread(native_kwargs, body, llama, settings)
        kwargs["prompt"] = await in_thread(_infill_prompt, llama, body)
        return _unchecked(await _answer(state, client, body, llama, kwargs), body)


def _unchecked(answer: Any, body: NativeGeneration) -> Any:
    """An answer cut to ``response_fields`` as it is: the response model would drop its keys."""
    return JSONResponse(answer) if body.response_fields and not body.stream else answer


def _infill_prompt(llama: Llama, body: InfillRequest) -> list[int]:
    """The FIM prompt, whole when it fits a sequence's context; else cut as llama-server cuts
    every one: the prefix's end and the suffix's start within a batch (3:1), the repository
    context's end in the rest of the context. The batch is at most half the context, and the
    repository context gives up what still does not fit (llama-server's cut can overflow)."""
    files = [(chunk.filename, chunk.text) for chunk in body.input_extra]
    prefix = body.input_prefix + body.prompt
    prompt = partial(llama.infill_prompt, prefix, body.input_suffix, repo=_FIM_REPO,
                     files=files, file_name=_FIM_FILE)  # fmt: skip
    tokens = prompt()
    room = llama.context.n_ctx_seq
    if len(tokens) < room:
        return tokens
    n_prompt = len(llama.tokenize(body.prompt, add_special=False)) if body.prompt else 0
    batch = min(llama.context.n_batch, room // 2)
    limits = InfillLimits.llama_server(batch, room, n_prompt)
    tokens = prompt(limits=limits)
    excess = len(tokens) - (room - 1)  # one position left to generate into
    if excess > 0 and limits.context:
        tokens = prompt(limits=dataclasses.replace(limits, context=max(0, limits.context - excess)))
    return tokens


@dataclasses.dataclass(frozen=True)
class _Answering:
    """What the answer of one request needs besides its result."""

    alias: str
    n_ctx_seq: int  # a sequence's share of the context: a generation that fills it was cut
    vocab: Vocab | None  # with n_probs: to describe each token and its alternatives
    settings: dict[str, Any]  # the sampling it runs with, as llama-server lists it
    prompt: str  # its prompt's text, as llama-server shows it
    fields: Sequence[str]  # response_fields: the last answer's values at these paths alone
    timings_per_token: bool  # timings on every streamed event, not on the last alone


def only_fields(answer: dict[str, Any], fields: Sequence[str]) -> dict[str, Any]:
    """llama-server's ``response_fields``: the answer's values at these paths (keys joined by
    "/", e.g. ``generation_settings/n_predict``), each under its path; a path that leads
    nowhere is left out. None listed: the whole answer."""
    if not fields:
        return answer
    chosen = {}
    for path in fields:
        value: Any = answer
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            chosen[path] = value
    return chosen


async def _answer(state: ServerState, client: Request, body: NativeGeneration, llama: Llama,
                  kwargs: dict[str, Any], deadline: float | None = None,
                  index: int = 0) -> Any:  # fmt: skip
    """The completion of ``kwargs`` (its prompt as tokens, the request's ``index``-th),
    streamed or whole (by ``deadline``: see ``complete``)."""
    vocab = llama.vocab if kwargs.get("logprobs") is not None else None
    used = used_settings(llama, state.settings, kwargs, body)
    prompt = await in_thread(_prompt_text, llama, kwargs["prompt"])
    answering = _Answering(state.settings.alias, llama.context.n_ctx_seq, vocab, used, prompt,
                           body.response_fields, body.timings_per_token)  # fmt: skip
    if body.stream:
        chunks = await in_thread(partial(llama.stream_completion, **kwargs))
        return await sse_events(state, client, chunks, partial(native_events, answering))
    result = await complete(state, client, partial(llama.create_completion, **kwargs), deadline)
    choice = result.choices[0]
    tokens = choice.tokens if body.return_tokens else ()
    answer = native_answer(choice.text, tokens, choice.finish_reason, result.usage,
                           choice.stop_sequence, choice.slot, answering)  # fmt: skip
    answer["index"] = index
    if vocab is not None and choice.logprobs is not None:
        answer["completion_probabilities"] = probabilities(vocab, choice.tokens, choice.logprobs)
    return only_fields(answer, answering.fields)


def native_kwargs(body: NativeGeneration, llama: Llama, settings: ServerSettings) -> dict[str, Any]:
    """The Python API's keywords: the fields every generation route takes (``n_predict``, else
    ``max_tokens``: -1 means the server's limit; ``logit_bias``, ``ignore_eos``,
    ``json_schema``), ``lora``, and ``n_probs`` (or ``logprobs``). Run off the event loop: a
    schema's conversion takes time."""
    if body.n != 1:
        raise ApiError(400, "llama-server's routes return one completion: n must be 1",
                       param="n")  # fmt: skip
    kwargs = generation_kwargs(body, settings)
    kwargs.update(completion_fields(body, llama))
    kwargs.update(request_lora(body.lora, llama))
    kwargs.update(logprobs_kwargs(body, probability_count(body, body.logprobs) or None))
    return kwargs


def split_prompts(prompt: Prompts, field: str = "prompt") -> list[Prompt]:
    """The prompts of a request's ``field``, as llama-server reads them: a list holding a token
    id is one prompt (text and ids mixed); any other list is several. An empty one is refused."""
    if isinstance(prompt, str | PromptObject):
        prompts: list[Prompt] = [prompt]
    else:
        several = [] if any(isinstance(p, int) for p in prompt) else list(prompt)
        prompts = cast("list[Prompt]", several or [prompt])
    if any((p.prompt_string if isinstance(p, PromptObject) else p) == [] for p in prompts):
        raise ApiError(400, f"the {field} is empty", param=field)
    return prompts


def prompt_tokens(llama: Llama, prompt: Prompt) -> list[int]:
    """A prompt's tokens, as llama-server reads them: special tokens parsed, BOS before text
    that comes first (an object's ``multimodal_data`` aside)."""
    text = prompt.prompt_string if isinstance(prompt, PromptObject) else prompt
    return mixed_tokens(llama, text, True, True)


def prompt_input(llama: Llama, prompt: Prompt) -> list[int] | Chunks:
    """``prompt_tokens``, or for an object with ``multimodal_data`` chunks with its images and
    sounds, as llama-server makes them; on a model without a projector, the error every media
    request gets."""
    if not isinstance(prompt, PromptObject) or prompt.multimodal_data is None:
        return prompt_tokens(llama, prompt)
    marker = llama.media_marker  # no projector: refused before any media is decoded
    if not isinstance(prompt.prompt_string, str):
        raise ApiError(400, f"with multimodal_data, prompt_string is text (with {marker} for "
                       "each image or sound), not token ids", param="prompt")  # fmt: skip
    media = [_decoded(data, i, llama.media_policy) for i, data in enumerate(prompt.multimodal_data)]
    return llama.tokenize_media(prompt.prompt_string, media, True, True)


def _decoded(data: str, index: int, policy: MediaPolicy) -> bytes:
    """An item's bytes, within the size each medium may have (as a chat's media)."""
    try:
        return policy.decoded(data)
    except MediaError as error:
        raise ApiError(400, f"multimodal_data item {index}: {error}", param="prompt") from None


def mixed_tokens(
    llama: Llama, content: str | list[str | int], add_special: bool, parse_special: bool
) -> list[int]:
    """Text, token ids or both mixed, as llama-server reads a prompt or ``/tokenize`` content:
    special tokens added before the first element only when it is text (token ids are taken
    as they are)."""
    if isinstance(content, str):
        return llama.tokenize(content, add_special, parse_special)
    tokens: list[int] = []
    for i, part in enumerate(content):
        if isinstance(part, int):
            tokens.extend(llama.vocab.check_tokens([part]).tolist())
        else:
            tokens.extend(llama.tokenize(part, add_special and i == 0, parse_special))
    return tokens


def native_answer(
    text: str,
    tokens: Sequence[int],
    reason: str | None,
    usage: Usage | None,
    stop: str | None,
    slot: int | None,
    answering: _Answering,
) -> dict[str, Any]:
    """llama-server's last ``/completion`` answer (``stop: true``); ``truncated`` when the
    generation ran out of context (llama-server: one position short of it)."""
    usage = usage or Usage(0, 0)
    held = usage.prompt_tokens + usage.completion_tokens
    return {
        "index": 0, "content": text, "tokens": list(tokens), "id_slot": _slot_id(slot),
        "stop": True, "model": answering.alias, "tokens_predicted": usage.completion_tokens,
        "tokens_evaluated": usage.prompt_tokens, "generation_settings": answering.settings,
        "prompt": answering.prompt, "has_new_line": "\n" in text,
        "truncated": reason == "length" and held + 1 >= answering.n_ctx_seq,
        "stop_type": _STOP_TYPES.get(reason or "", "none"), "stopping_word": stop or "",
        "tokens_cached": _slot_tokens(usage, reason), "timings": timings(usage),
    }  # fmt: skip


def _slot_id(slot: int | None) -> int:
    return -1 if slot is None else slot  # -1: llama-server's "no slot" (none took it yet)


def _slot_tokens(usage: Usage, reason: str | None) -> int:
    """llama-server's ``tokens_cached``: the tokens the slot's memory holds after the
    generation, which a next prompt can reuse (its timings' ``cache_n`` counts what this one
    reused): the prompt and every token sampled but the last, which is never decoded; an end
    token is sampled though not counted."""
    sampled = usage.completion_tokens + (reason == "eos")
    return usage.prompt_tokens + max(sampled - 1, 0)


def _prompt_text(llama: Llama, prompt: list[int] | Chunks) -> str:
    """The prompt as llama-server shows it: its tokens as text, special ones spelled out
    (``<bos>``); images and sounds left out."""
    tokens = prompt.text_tokens() if isinstance(prompt, Chunks) else prompt
    return llama.detokenize(tokens, special=True)


async def native_events(
    answering: _Answering, chunks: AsyncIterator[CompletionChunk]
) -> AsyncIterator[str]:
    """llama-server's ``/completion`` stream: ``{content, tokens, stop: false}`` events, then
    one with ``stop: true``, the counts and no text (the text is all in the events before
    it, as llama-server sends it); no ``[DONE]``. With ``n_probs`` asked for, each event
    with tokens carries their ``completion_probabilities``; with ``timings_per_token``, each
    its ``timings`` so far."""
    predicted = 0
    try:
        async for chunk in chunks:
            predicted += len(chunk.tokens)
            if chunk.text or chunk.tokens:
                payload = {"index": 0, "content": chunk.text, "tokens": list(chunk.tokens),
                           "stop": False, "id_slot": _slot_id(chunk.slot),
                           "tokens_predicted": predicted}  # fmt: skip
                if answering.vocab is not None and chunk.logprobs is not None:
                    payload["completion_probabilities"] = probabilities(
                        answering.vocab, chunk.tokens, chunk.logprobs
                    )
                if answering.timings_per_token and chunk.usage_so_far is not None:
                    payload["timings"] = timings(chunk.usage_so_far)
                yield event(payload)
            if chunk.finish_reason is not None:
                last = native_answer("", (), chunk.finish_reason, chunk.usage,
                                     chunk.stop_sequence, chunk.slot, answering)  # fmt: skip
                yield event(only_fields(last, answering.fields))
    except ApiError as error:
        yield event(error.body())


def probabilities(vocab: Vocab, tokens: Sequence[int], logprobs: Logprobs) -> list[dict[str, Any]]:
    """llama-server's ``completion_probabilities``: each generated token and its ``n_probs``
    likeliest alternatives, by id, text (cut before a partial UTF-8 character), bytes and
    log-probability before sampling."""

    def entry(token: int, logprob: float | None) -> dict[str, Any]:
        raw = vocab.token_to_bytes(token, special=True)
        return {"id": token, "token": _whole_characters(raw), "bytes": list(raw),
                "logprob": logprob}  # fmt: skip

    return [
        {**entry(token, logprob),
         "top_logprobs": [entry(i, p) for i, p in zip(ids, (top or {}).values(), strict=True)]}
        for token, logprob, top, ids in zip(tokens, logprobs.token_logprobs,
                                            logprobs.top_logprobs, logprobs.top_ids, strict=True)
    ]  # fmt: skip


def _whole_characters(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return raw[: error.start].decode("utf-8")
