"""The HTTP contract: OpenAI-shaped request and response models (they make the OpenAPI
document). Fields a client may send but llamacrab does not know are ignored, as OpenAI's
own clients send newer fields than any server knows."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

# Stop strings are matched against every generated piece of text: bound how many and how long.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024


class NullIsAbsent(BaseModel):
    """Null for a field that has a default taken as that default (OpenAI's optional fields
    are nullable; llama-server reads null as absent; clients send null for unset fields)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in fields or fields[key].is_required()
        }


class Lenient(NullIsAbsent):
    """A request body as OpenAI's and llama-server's routes read it: unknown fields ignored."""

    model_config = ConfigDict(extra="ignore")


class StreamOptions(Lenient):
    include_usage: bool = False


class LoraEntry(BaseModel):
    """One LoRA adapter of the server (its id in GET /lora-adapters) and its scale."""

    id: int
    scale: float = Field(allow_inf_nan=False)


class GenerationFields(Lenient):
    """Fields shared by completions and chat completions (llama.cpp's samplers included)."""

    model: str | None = None
    # The most tokens to generate; -1: no limit but the server's (as llama-server reads it).
    # Of several given, n_predict wins, then max_completion_tokens (OpenAI's newer name).
    max_tokens: int | None = Field(None, ge=-1)
    max_completion_tokens: int | None = Field(None, ge=-1)
    n_predict: int | None = Field(None, ge=-1)  # llama-server's name
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    typical_p: float | None = Field(None, ge=0, le=1)
    repeat_penalty: float | None = Field(None, ge=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    mirostat: Literal[0, 1, 2] | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    # {"id": bias}, or llama-server's [[id or text, bias]]; text stands for its tokens, and a
    # bias of false bans them. A list's key is strictly one or the other (true is not id 1).
    logit_bias: (
        dict[str, float | bool] | list[tuple[StrictInt | StrictStr, float | bool]] | None
    ) = None
    lora: list[LoraEntry] | None = None  # this request's adapter scales (others: 0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # OpenAI's: an int64
    stop: str | list[str] | None = None
    min_tokens: int | None = Field(None, ge=0)
    grammar: str | None = None  # GBNF
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # llama-server's samplers, which it takes on every route (ranges: llamacrab's SamplingOptions)
    dynatemp_range: float | None = None
    dynatemp_exponent: float | None = None
    top_n_sigma: float | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    repeat_last_n: int | None = None  # penalty_last_n
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    # The chain's samplers in order: names (["top_k", "top_p", "infill"]) or one char each
    samplers: list[Annotated[str, Field(max_length=32)]] | str | None = Field(None, max_length=32)
    ignore_eos: bool = False  # every end-of-generation token banned
    # Generation constrained to a JSON Schema ({} is any object); a grammar given too wins.
    json_schema: dict[str, Any] | None = None
    # The likeliest tokens at each step, before sampling (OpenAI's logprobs, by another name)
    n_probs: int | None = Field(None, ge=0, le=20)
    post_sampling_probs: bool = False  # refused with n_probs: the probabilities are before
    min_keep: int = Field(0, ge=0)  # llama-server's; refused past 0 (no sampler here keeps any)
    # llama-server's rules for code completion, each ending the answer as its length limit
    # does: every line after the first indented by n_indent spaces or tabs or more (the first
    # that is not is cut after them), and a newline ending it once t_max_predict_ms have
    # passed since the first token (0 or -1: no limit).
    n_indent: int = Field(0, ge=0, le=2**31 - 1)
    t_max_predict_ms: int = Field(-1, ge=-1, lt=2**63)
    timings_per_token: bool = False  # llama-server's timings on every streamed event

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, not {len(strings)}")
        for text in strings:
            if len(text) > MAX_STOP_CHARS:
                raise ValueError(
                    f"each stop string may have at most {MAX_STOP_CHARS} characters, "
                    f"not {len(text)}"
                )
        return stop


class CompletionRequest(GenerationFields):
    prompt: str | list[int] | list[str | list[int]]  # one prompt, or several (OpenAI's batch)
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1)


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    function_call: dict[str, Any] | None = None  # deprecated: one call of an assistant


class FunctionDefinition(Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDefinition(Lenient):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class JsonSchemaFormat(Lenient):
    name: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # llama.cpp's json_object


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessageIn] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: an answer's first call only
    # Deprecated function calling (_legacy_functions): one call at most.
    functions: list[FunctionDefinition] | None = None
    function_call: Literal["none", "auto"] | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # llama-server's: template variables
    add_generation_prompt: bool = True  # llama-server's; false: the answer's turn is not opened
    # Refused unless unset: outputs this server cannot make (audio, web searches, verbosity).
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # "medium" only: no other length
    reasoning_effort: str | None = None  # as llama-server: a template variable ("none": off)


class EmbeddingRequest(Lenient):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


class RerankRequest(Lenient):
    model: str | None = None
    query: str
    documents: list[str] | None = None
    texts: list[str] | None = None  # Hugging Face TEI's name for the documents
    top_n: int | None = Field(None, ge=0)
    return_documents: bool = True
    return_text: bool = False  # TEI: each result carries its text


class TokenizeRequest(Lenient):
    model: str | None = None
    input: str
    add_special: bool = True
    parse_special: bool = False


class DetokenizeRequest(Lenient):
    model: str | None = None
    tokens: list[int]


# -- responses -----------------------------------------------------------------------------------


class UsageOut(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class LogprobsOut(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # null for an echoed prompt's first token, as OpenAI
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoiceOut(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: LogprobsOut | None = None


class LlamaTimings(BaseModel):
    """llama-server's ``timings``: the prompt's tokens read (past the cached ones) and the
    tokens generated, each with its wall time, per token and per second."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoiceOut]
    usage: UsageOut | None = None
    timings: LlamaTimings | None = None  # llama-server's extra field


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):  # (a streamed delta's calls have an "index" as well)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    function_call: FunctionCallOut | None = None  # deprecated function calling's one call


class TokenLogprobOut(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ContentLogprobOut(TokenLogprobOut):
    top_logprobs: list[TokenLogprobOut]


class ChatLogprobsOut(BaseModel):
    content: list[ContentLogprobOut]


class ChatChoiceOut(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: str
    logprobs: ChatLogprobsOut | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoiceOut]
    usage: UsageOut
    timings: LlamaTimings | None = None  # llama-server's extra field


class EmbeddingOut(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingOut]
    model: str
    usage: UsageOut


class RerankDocument(BaseModel):
    text: str


class RerankResultOut(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    object: Literal["list"] = "list"
    model: str
    results: list[RerankResultOut]
    usage: UsageOut


class ModelOut(BaseModel):
    """A model as OpenAI lists it, with the fields Anthropic's ``ModelInfo`` requires beside
    them: one list answers both SDKs' ``models.list()``."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llamacrab"
    type: Literal["model"] = "model"
    display_name: str
    created_at: str  # RFC 3339, of ``created``
    lifecycle: Literal["active"] = "active"

    @classmethod
    def of(cls, model_id: str, created: int) -> ModelOut:
        stamp = datetime.fromtimestamp(created, timezone.utc).isoformat().replace("+00:00", "Z")
        return cls(id=model_id, created=created, display_name=model_id, created_at=stamp)


class ModelList(BaseModel):
    """OpenAI's list, with Anthropic's page fields (one page: nothing more to fetch)."""

    object: Literal["list"] = "list"
    data: list[ModelOut]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


def model_list(data: list[dict[str, Any]]) -> dict[str, Any]:
    """``data`` (model cards) as ``ModelList`` shapes it."""
    ids = [card["id"] for card in data]
    return {"object": "list", "data": data, "first_id": ids[0] if ids else None,
            "last_id": ids[-1] if ids else None, "has_more": False}  # fmt: skip


class TokenizeResponse(BaseModel):
    tokens: list[int]


class CountResponse(BaseModel):
    count: int


class DetokenizeResponse(BaseModel):
    text: str


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
