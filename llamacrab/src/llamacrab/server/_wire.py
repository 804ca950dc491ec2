"""Translation between the HTTP contract and the Python API: request fields to keywords,
results to OpenAI JSON."""

from __future__ import annotations

import base64
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from llamacrab import build_info
from llamacrab._field_types import choice_seeds as seeds_of_choices
from llamacrab._types import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    Logprobs,
    ToolCall,
    Usage,
)
from llamacrab.server import _legacy_functions as legacy_functions
from llamacrab.server._errors import ApiError
from llamacrab.server._sampler_order import sampler_order
from llamacrab.server._schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationFields,
    UsageOut,
)
from llamacrab.server._settings import ServerSettings

_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "typical_p", "repeat_penalty",
             "presence_penalty", "frequency_penalty", "mirostat", "mirostat_tau", "mirostat_eta",
             "seed", "grammar", "min_tokens", "dynatemp_range", "dynatemp_exponent",
             "top_n_sigma", "xtc_probability", "xtc_threshold", "dry_multiplier", "dry_base",
             "dry_allowed_length", "dry_penalty_last_n")  # fmt: skip
_MAX_TOKENS_FIELDS = ("n_predict", "max_completion_tokens", "max_tokens")  # the first given wins


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's names: the end of a turn and a stop string are both "stop"."""
    return "stop" if reason == "eos" else reason


def generation_kwargs(
    body: GenerationFields, settings: ServerSettings, default_max: int | None = None
) -> dict[str, Any]:
    """Keywords for the Python API, with the server's caps applied (``default_max``: the
    tokens a request that names none gets; None: the server's limit). The penalties and DRY
    count the prompt's tokens, as llama-server's do; its ``n_indent`` and ``t_max_predict_ms``
    are ``min_indent`` and ``stop_at_newline_after`` (seconds). ``logit_bias``, ``ignore_eos``
    and ``json_schema`` need the model or take time: ``_llama_fields`` reads them."""
    kwargs: dict[str, Any] = {n: v for n in _SAMPLING if (v := getattr(body, n)) is not None}
    kwargs["penalize_prompt"] = True
    seed = _seed(body.seed)
    if seed is None:
        kwargs.pop("seed", None)
    else:
        kwargs["seed"] = seed
    if body.repeat_last_n is not None:
        kwargs["penalty_last_n"] = body.repeat_last_n
    if body.dry_sequence_breakers is not None:
        kwargs["dry_sequence_breakers"] = tuple(body.dry_sequence_breakers)
    if body.samplers is not None:
        kwargs.update(sampler_order(body.samplers))
    if body.stop is not None:
        stops = [body.stop] if isinstance(body.stop, str) else body.stop
        kwargs["stop"] = [stop for stop in stops if stop]  # llama-server skips empty ones
    kwargs["max_tokens"] = _max_tokens(body, settings.max_tokens_limit, default_max)
    if body.n_indent:
        kwargs["min_indent"] = body.n_indent
    if body.t_max_predict_ms > 0:
        kwargs["stop_at_newline_after"] = body.t_max_predict_ms / 1000
    if body.min_keep:
        raise ApiError(400, "min_keep is not supported: the samplers here keep no minimum of "
                       "candidates (send 0, or leave it out)", param="min_keep")  # fmt: skip
    if body.n > settings.max_n:
        raise ApiError(400, f"n {body.n} exceeds this server's limit of {settings.max_n}",
                       param="n")  # fmt: skip
    kwargs["timeout"] = settings.timeout
    return kwargs


def _seed(value: int | None) -> int | None:
    """A request's seed for llama.cpp: None (and llama-server's -1, "a random seed", which
    clients send) draws one. OpenAI's seed is an int64, llama.cpp's 32 bits: one seed of those
    for each value (never 2**32 - 1, which llama.cpp reads as "random")."""
    if value is None or value == -1:
        return None
    return value if 0 <= value < 2**32 else value % (2**32 - 1)


def choice_seeds(body: GenerationFields) -> list[int | None]:
    """The seeds of a request's ``n`` choices, as the library's ``n`` gives them (the seed,
    then one more for each choice after the first), so that streamed choices are the whole
    answer's: each draws its own where none is given."""
    return seeds_of_choices(_seed(body.seed), body.n)


def probability_count(body: GenerationFields, otherwise: int | None) -> int | None:
    """How many alternatives of each token are asked for: llama-server's ``n_probs`` where it
    is over 0 (as llama-server reads it on every route), else ``otherwise`` (the route's own
    field's)."""
    return body.n_probs if body.n_probs else otherwise


def _max_tokens(body: GenerationFields, limit: int, default: int | None) -> int:
    """The tokens a request may generate: the first of n_predict, max_completion_tokens and
    max_tokens it gives (llama-server's order; OpenAI deprecates max_tokens), -1 meaning no
    limit but the server's; none given, ``default``. A count past the server's limit is cut
    to it (llama-server stops at its context, OpenAI and Anthropic only refuse past the model's
    own limit; clients ask for 8192 to 32000 tokens): an answer that reaches it ends as any
    answer reaching its max_tokens does."""
    given = (getattr(body, name) for name in _MAX_TOKENS_FIELDS)
    wanted = next((value for value in given if value is not None), default)
    if wanted is None or wanted == -1:
        return limit
    return min(int(wanted), limit)


def logprobs_kwargs(body: GenerationFields, count: int | None) -> dict[str, Any]:
    """``logprobs``: each token's log-probability and its ``count`` likeliest alternatives
    (None: none asked for). llama-server's ``post_sampling_probs`` is refused with them: the
    probabilities given are those before sampling."""
    if count is None:
        return {}
    if body.post_sampling_probs:
        raise ApiError(400, "post_sampling_probs is not supported: the probabilities given "
                       "are those before sampling (leave it false)",
                       param="post_sampling_probs")  # fmt: skip
    return {"logprobs": count}


def completion_kwargs(body: CompletionRequest, settings: ServerSettings) -> dict[str, Any]:
    kwargs = generation_kwargs(body, settings, 16)
    if body.best_of is not None and body.best_of > settings.max_n:
        raise ApiError(400, f"best_of exceeds this server's limit of {settings.max_n}",
                       param="best_of")  # fmt: skip
    count = probability_count(body, body.logprobs)
    kwargs.update(echo=body.echo, **logprobs_kwargs(body, count))
    if not body.stream:
        kwargs.update(n=body.n, best_of=body.best_of)
    elif body.best_of not in (None, 1):
        raise ApiError(400, "best_of cannot be used with stream", param="best_of")
    return kwargs


def insertion(body: CompletionRequest, prompts: Sequence[str | list[int]]) -> str | None:
    """The text each answer goes before (OpenAI's ``suffix``): filled in the middle with the
    model's FIM tokens, as OpenAI inserts; None for a plain completion."""
    if not body.suffix:
        return None
    if not all(isinstance(prompt, str) for prompt in prompts):
        raise ApiError(400, "suffix needs a text prompt, not token ids", param="suffix")
    if body.echo:
        raise ApiError(400, "echo cannot be used with suffix", param="echo")
    return body.suffix


def completion_prompts(body: CompletionRequest, settings: ServerSettings) -> list[str | list[int]]:
    """The prompts of a request: text, token ids, or a list of such prompts (each answered
    with ``n`` choices; up to ``--max-n`` of them). An empty one is refused."""
    prompt = body.prompt
    single = isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], int))
    prompts = cast("list[str | list[int]]", [prompt] if single or not prompt else prompt)
    for i, one in enumerate(prompts):
        if not one:
            which = "the prompt" if len(prompts) == 1 else f"prompt {i}"
            raise ApiError(400, f"{which} is empty", param="prompt")
    check_prompt_count(len(prompts), settings)
    return prompts


def check_prompt_count(count: int, settings: ServerSettings) -> None:
    """A request may give up to ``--max-n`` prompts."""
    if count > settings.max_n:
        raise ApiError(400, f"{count} prompts exceed this server's limit of {settings.max_n} "
                       "a request", param="prompt")  # fmt: skip


def joined_completions(results: Sequence[Completion], n: int) -> Completion:
    """The completions of several prompts as one answer, as OpenAI gives it: prompt i's ``n``
    choices at indexes i * n to i * n + n - 1, the usage summed."""
    choices = tuple(dataclasses.replace(choice, index=i * n + choice.index)
                    for i, result in enumerate(results) for choice in result.choices)  # fmt: skip
    usage = _summed([result.usage for result in results])
    return dataclasses.replace(results[0], choices=choices, usage=usage)


def choices_usage(usages: Sequence[Usage], n: int) -> Usage:
    """The usage of an answer's choices from theirs (in index order, ``n`` to a prompt), as
    the library's ``n`` and ``joined_completions`` count it: each prompt once (its first
    choice's prompt and times), the completions of every choice."""
    return _summed([
        dataclasses.replace(usages[i], completion_tokens=sum(
            u.completion_tokens for u in usages[i:i + n]))
        for i in range(0, len(usages), n)
    ])  # fmt: skip


def _summed(usages: Sequence[Usage]) -> Usage:
    return Usage(*(sum(getattr(u, f.name) for u in usages) for f in dataclasses.fields(Usage)))


def chat_kwargs(body: ChatCompletionRequest, settings: ServerSettings) -> dict[str, Any]:
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if body.audio is not None or set(body.modalities or ()) - {"text"}:
        raise ApiError(400, "only text answers: modalities other than \"text\" and audio "
                       "are not supported", param="modalities")  # fmt: skip
    if body.web_search_options is not None:
        raise ApiError(400, "web search is not supported", param="web_search_options")
    if body.verbosity not in (None, "medium"):  # as /v1/responses refuses text.verbosity
        raise ApiError(400, f"verbosity {body.verbosity!r} is not supported", param="verbosity")
    kwargs = generation_kwargs(body, settings)
    if body.tools:
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    if body.tool_choice is not None:
        kwargs["tool_choice"] = body.tool_choice
    if body.functions:
        functions = [f.model_dump(exclude_none=True) for f in body.functions]
        kwargs["tools"] = legacy_functions.tools_of(functions, body.tools)
    if body.function_call is not None:
        kwargs["tool_choice"] = legacy_functions.tool_choice_of(body.function_call)
    response_format = _response_format(body)
    if response_format is not None:
        kwargs["response_format"] = response_format
    count = (body.top_logprobs or 0) if body.logprobs else probability_count(body, None)
    kwargs.update(logprobs_kwargs(body, count))
    if not body.stream:
        kwargs["n"] = body.n
    variables = template_variables(body.chat_template_kwargs, body.reasoning_effort)
    if variables:
        kwargs["chat_template_kwargs"] = variables
    return kwargs


def _response_format(body: ChatCompletionRequest) -> dict[str, Any] | None:
    """OpenAI's ``response_format``, or llama-server's ``json_schema`` as one where the format
    asks for no schema of its own ({} is any object)."""
    given = body.response_format
    if body.json_schema is None:
        return None if given is None else given.model_dump(by_alias=True, exclude_none=True)
    if body.grammar is not None:
        raise ApiError(400, "json_schema and grammar cannot be used together",
                       param="json_schema")  # fmt: skip
    if given is not None and (given.type == "json_schema" or given.schema_ is not None):
        return given.model_dump(by_alias=True, exclude_none=True)
    return {"type": "json_object", "schema": body.json_schema or {"type": "object"}}


def template_variables(
    given: dict[str, Any] | None, reasoning_effort: str | None
) -> dict[str, Any]:
    """chat_template_kwargs with OpenAI's reasoning_effort added as llama-server adds it: a
    variable for templates that read it (gpt-oss), "none" turning thinking off (Qwen 3's
    ``enable_thinking``). A template that reads neither is unchanged by them."""
    variables = dict(given or {})
    if reasoning_effort == "none":
        variables.pop("reasoning_effort", None)
        variables["enable_thinking"] = False
    elif reasoning_effort:
        variables["reasoning_effort"] = reasoning_effort
    return variables


def usage(value: Usage) -> dict[str, Any]:
    return UsageOut(
        prompt_tokens=value.prompt_tokens,
        completion_tokens=value.completion_tokens,
        total_tokens=value.total_tokens,
        prompt_tokens_details={"cached_tokens": value.cached_tokens},
    ).model_dump()


def timings(usage: Usage) -> dict[str, float]:
    """llama-server's ``timings`` of a finished generation, with its arithmetic: the first token
    comes with the prompt's last batch, so the generation's rates count the steps after it; a
    rate without a divisor is 0."""
    read, steps = usage.prompt_tokens - usage.cached_tokens, max(usage.completion_tokens - 1, 0)
    out: dict[str, float] = {"cache_n": usage.cached_tokens}
    for name, count, rated, seconds in (
        ("prompt", read, read, usage.prompt_seconds),
        ("predicted", usage.completion_tokens, steps, usage.generation_seconds),
    ):
        ms = seconds * 1000
        out |= {f"{name}_n": count, f"{name}_ms": ms,
                f"{name}_per_token_ms": ms / rated if rated else 0.0,
                f"{name}_per_second": rated / seconds if seconds > 0 else 0.0}  # fmt: skip
    return out


def _logprobs(value: Logprobs | None) -> dict[str, Any] | None:
    if value is None:
        return None
    return {
        "tokens": list(value.tokens),
        "token_logprobs": list(value.token_logprobs),
        "top_logprobs": list(value.top_logprobs),
        "text_offset": list(value.text_offset),
    }


def _chat_logprobs(value: Logprobs | None) -> dict[str, Any] | None:
    """OpenAI's chat shape: a list of tokens with their log-probability and alternatives."""
    if value is None:
        return None

    def entry(token: str, logprob: float | None, raw: bytes | None) -> dict[str, Any]:
        return {"token": token, "logprob": logprob,
                "bytes": list(token.encode() if raw is None else raw)}  # fmt: skip

    def alternatives(i: int) -> list[dict[str, Any]]:
        top = value.top_logprobs[i] or {}  # (None only for an echoed prompt's first token)
        raws = value.top_bytes[i] if i < len(value.top_bytes) else (None,) * len(top)
        return [entry(t, p, raw) for (t, p), raw in zip(top.items(), raws, strict=True)]

    content = [
        {**entry(token, logprob, value.token_bytes[i] if i < len(value.token_bytes) else None),
         "top_logprobs": alternatives(i)}
        for i, (token, logprob) in enumerate(zip(value.tokens, value.token_logprobs, strict=True))
    ]  # fmt: skip
    return {"content": content}


def _tool_calls(calls: Sequence[ToolCall], streamed: bool) -> list[dict[str, Any]]:
    out = []
    for i, call in enumerate(calls):
        function = {"name": call.name, "arguments": call.arguments}
        item: dict[str, Any] = {"id": call.id, "type": "function", "function": function}
        out.append({"index": i, **item} if streamed else item)
    return out


@functools.cache
def system_fingerprint() -> str:
    """What answered: llamacrab's version, llama.cpp's commit and the backend (OpenAI's
    ``system_fingerprint``; llama-server sends its build there)."""
    info = build_info()
    return f"llamacrab-{info.package_version}-{info.llama_cpp_commit[:8]}-{info.backend}"


def completion(result: Completion, model: str) -> dict[str, Any]:
    choices = [
        {"index": c.index, "text": c.text, "finish_reason": finish_reason(c.finish_reason),
         "logprobs": _logprobs(c.logprobs)}
        for c in result.choices
    ]  # fmt: skip
    return {"id": result.id, "object": "text_completion", "created": result.created,
            "model": model, "system_fingerprint": system_fingerprint(), "choices": choices,
            "usage": usage(result.usage), "timings": timings(result.usage)}  # fmt: skip


def kept_calls(calls: Sequence[ToolCall], parallel: bool) -> Sequence[ToolCall]:
    """parallel_tool_calls false: the first call only (a forced call is one call anyway)."""
    return calls if parallel else calls[:1]


def chat_completion(result: ChatCompletion, model: str, parallel: bool = True) -> dict[str, Any]:
    """``parallel``: the request's parallel_tool_calls."""
    choices = []
    for c in result.choices:
        message: dict[str, Any] = {"role": "assistant", "content": c.message.content}
        if c.message.tool_calls:
            calls = kept_calls(c.message.tool_calls, parallel)
            message["tool_calls"] = _tool_calls(calls, streamed=False)
        choices.append({"index": c.index, "message": message,
                        "logprobs": _chat_logprobs(c.logprobs),
                        "finish_reason": finish_reason(c.finish_reason)})  # fmt: skip
    return {"id": result.id, "object": "chat.completion", "created": result.created,
            "model": model, "system_fingerprint": system_fingerprint(), "choices": choices,
            "usage": usage(result.usage), "timings": timings(result.usage)}  # fmt: skip


def completion_chunk(chunk: CompletionChunk, model: str) -> dict[str, Any]:
    choice = {"index": chunk.index, "text": chunk.text, "logprobs": _logprobs(chunk.logprobs),
              "finish_reason": finish_reason(chunk.finish_reason)}  # fmt: skip
    return {"id": chunk.id, "object": "text_completion", "created": chunk.created,
            "model": model, "system_fingerprint": system_fingerprint(),
            "choices": [choice]}  # fmt: skip


def may_call_tools(kwargs: dict[str, Any]) -> bool:
    """Whether a chat request's answer may be tool calls (its ``chat_kwargs``)."""
    return bool(kwargs.get("tools")) and kwargs.get("tool_choice") != "none"


def chat_chunk(
    chunk: ChatCompletionChunk, model: str, parallel: bool = True, calls: bool = False
) -> list[dict[str, Any]]:
    """The events of one chunk, in OpenAI's shape: the first chunk opens with a delta of the
    role and empty content, or null content where the answer may be tool calls (``calls``:
    their text is held back; OpenAI's content of a tool-call answer is null, and SDKs add
    each delta's content to it); text, tool calls and log-probabilities come in deltas
    without a finish reason; the last chunk closes with an empty delta and the finish
    reason. Each event names the chunk's choice."""
    head = {"id": chunk.id, "object": "chat.completion.chunk", "created": chunk.created,
            "model": model, "system_fingerprint": system_fingerprint()}  # fmt: skip
    opening = None if calls else ""

    def event(delta: dict[str, Any], logprobs: Any = None, finish: str | None = None) -> Any:
        choice = {"index": chunk.index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish}  # fmt: skip
        return {**head, "choices": [choice]}

    events = []
    if chunk.delta.role:
        events.append(event({"role": chunk.delta.role, "content": opening}))
    delta: dict[str, Any] = {}
    if chunk.delta.content:
        delta["content"] = chunk.delta.content
    if chunk.delta.tool_calls:
        delta["tool_calls"] = _tool_calls(kept_calls(chunk.delta.tool_calls, parallel), True)
    logprobs = _chat_logprobs(chunk.logprobs)
    if delta or logprobs:
        events.append(event(delta or {"content": opening}, logprobs))
    if chunk.finish_reason is not None:
        events.append(event({}, finish=finish_reason(chunk.finish_reason)))
    return events


def embedding_inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[Any]:
    """The inputs of an embeddings request: texts, or token-id lists (one list of ids is one
    input). Empty is refused, as OpenAI does (an empty text too: it would embed a lone BOS)."""
    inputs = [value] if isinstance(value, str) else value
    if not inputs:
        raise ApiError(400, "input is empty: send a text, a list of texts or of token ids",
                       param="input")  # fmt: skip
    if all(isinstance(v, int) for v in inputs):
        return [inputs]
    for i, item in enumerate(inputs):
        if not item:
            kind = "text" if isinstance(item, str) else "list of token ids"
            raise ApiError(400, f"input {i} is an empty {kind}", param="input")
    return list(inputs)


def embedding(vector: np.ndarray, index: int, encoding: str) -> dict[str, Any]:
    values = np.asarray(vector, dtype=np.float32)
    data: list[float] | str
    if encoding == "base64":
        data = base64.b64encode(values.tobytes()).decode("ascii")
    else:
        data = values.tolist()
    return {"object": "embedding", "index": index, "embedding": data}
