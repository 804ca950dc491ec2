"""The HTTP contract of llama-server's own routes, with its field names: ``/infill``,
``/apply-template``, ``/tokenize``, ``/detokenize``, ``/props``, ``/slots`` and OpenAI's
``/v1/audio/transcriptions`` (a multipart form, so its fields are not a model here). Fields a
client may send but llamacrab does not know are ignored, as on the OpenAI routes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from llamacrab.server._schemas import (
    ChatMessageIn,
    GenerationFields,
    Lenient,
    LlamaTimings,
    ToolDefinition,
)

# Context files one /infill request may carry (each is bounded by the body limit as well).
MAX_INFILL_FILES = 256


class InfillChunk(Lenient):
    """A file of the repository given as context: ``[FIM_SEP]filename\\ntext``."""

    filename: str = "tmp"  # llama-server's default name
    text: str


class NativeGeneration(GenerationFields):
    """The options of llama-server's own generation routes (``/completion``, ``/infill``)
    beyond those every generation route takes: ``return_tokens``, ``logprobs`` (``n_probs``'s
    other name), ``response_fields`` (paths such as ``generation_settings/n_predict``: the last
    answer holds their values alone); ``cache_prompt`` is accepted (llamacrab always reuses a
    cached prefix)."""

    seed: int | None = Field(None, ge=-1, lt=2**32)  # -1: random, as llama-server
    return_tokens: bool = False
    response_fields: list[str] = Field(default_factory=list)
    cache_prompt: bool = True
    logprobs: int | None = Field(None, ge=0, le=20)


class InfillRequest(NativeGeneration):
    """llama-server's ``/infill``: the prefix and suffix around the gap, other files of the
    repository, and ``/completion``'s sampling options."""

    input_prefix: str
    input_suffix: str
    input_extra: list[InfillChunk] = Field(default_factory=list, max_length=MAX_INFILL_FILES)
    prompt: str = ""  # text that continues the prefix (where llama-server's code puts it)


class PromptObject(Lenient):
    """llama-server's prompt as an object: ``prompt_string`` (text, or text and token ids
    mixed) and, for a model with a projector, ``multimodal_data``: images or sounds in base64,
    one media marker each in the text."""

    prompt_string: str | list[str | int]
    multimodal_data: list[str] | None = None


# llama-server's prompt shapes: text, token ids and text mixed, an object, or a list of such
# prompts.
Prompt = str | list[str | int] | PromptObject
Prompts = str | list[str | int] | PromptObject | list[str | list[str | int] | PromptObject]


class LlamaCompletionRequest(NativeGeneration):
    """llama-server's ``/completion``: ``prompt`` is text, token ids, or both mixed (special
    tokens parsed in its text, as llama-server does), a ``PromptObject``, or a list of such
    prompts (a list with no token id in it: each item is a prompt, each answered in turn)."""

    prompt: Prompts


class LlamaEmbeddingRequest(Lenient):
    """llama-server's ``/embedding``: ``content`` (or ``input``) read as ``/completion`` reads
    its prompt; ``embd_normalize`` -1 none, 0 to an int16 range, 2 Euclidean (its default),
    any other p the p-norm."""

    model: str | None = None
    content: Prompts | None = None
    input: Prompts | None = None
    embd_normalize: int = Field(2, ge=-1, le=2**31 - 1)


class ApplyTemplateRequest(Lenient):
    model: str | None = None
    messages: list[ChatMessageIn] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    add_generation_prompt: bool = True  # false: no opening of the answer's turn


class LlamaTokenizeRequest(Lenient):
    """llama-server's ``/tokenize``: its defaults differ from ``/extras/tokenize``'s (no BOS,
    special tokens parsed). ``content`` may mix text and token ids."""

    model: str | None = None
    content: str | list[str | int] = ""  # absent: no tokens, as llama-server answers
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class LlamaDetokenizeRequest(Lenient):
    model: str | None = None
    tokens: list[int] = Field(default_factory=list)


class SlotActionRequest(Lenient):
    filename: str | None = None


# -- responses -----------------------------------------------------------------------------------


class TokenPiece(BaseModel):
    id: int
    piece: str | list[int]  # the token's text, or its bytes where they are not UTF-8 alone


class LlamaTokenizeResponse(BaseModel):
    tokens: list[TokenPiece] | list[int]


class LlamaDetokenizeResponse(BaseModel):
    content: str


class ApplyTemplateResponse(BaseModel):
    prompt: str


class TokenProbability(BaseModel):
    id: int
    token: str
    bytes: list[int]
    logprob: float


class CompletionProbability(TokenProbability):
    top_logprobs: list[TokenProbability]


class LlamaCompletionResponse(BaseModel):
    """llama-server's ``/completion`` answer (``stop: true``); streamed, the same fields come in
    pieces and the last event has ``stop: true`` and the counts."""

    index: int = 0
    content: str
    tokens: list[int]
    id_slot: int = -1
    stop: bool = True
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    generation_settings: dict[str, Any]  # the sampling it ran with, as /props lists defaults
    prompt: str  # the prompt's tokens as text, special ones spelled out
    tokens_cached: int  # tokens the slot's memory holds after it (timings.cache_n: reused)
    has_new_line: bool
    truncated: bool = False
    stop_type: Literal["eos", "limit", "word", "none"]
    stopping_word: str = ""
    timings: LlamaTimings
    completion_probabilities: list[CompletionProbability] | None = None  # with n_probs


class GenerationSettingsOut(BaseModel):
    model_config = ConfigDict(extra="allow")

    n_ctx: int
    params: dict[str, Any]


class PropsResponse(BaseModel):
    model_config = ConfigDict(extra="allow")

    default_generation_settings: GenerationSettingsOut
    total_slots: int
    model_alias: str
    model_path: str
    chat_template: str
    modalities: dict[str, bool]
    build_info: str


class PropsUpdated(BaseModel):
    success: bool


class SlotOut(BaseModel):
    id: int
    id_task: int = -1
    n_ctx: int
    speculative: bool
    is_processing: bool
    n_prompt_tokens: int  # tokens the slot's memory holds


class SaveTimings(BaseModel):
    save_ms: float


class RestoreTimings(BaseModel):
    restore_ms: float


class SlotSaved(BaseModel):
    id_slot: int
    filename: str
    n_saved: int
    n_written: int
    timings: SaveTimings


class SlotRestored(BaseModel):
    id_slot: int
    filename: str
    n_restored: int
    n_read: int
    timings: RestoreTimings


class SlotErased(BaseModel):
    id_slot: int
    n_erased: int


class TranscriptionUsage(BaseModel):
    type: Literal["tokens"] = "tokens"
    input_tokens: int
    output_tokens: int
    total_tokens: int


class TranscriptionResponse(BaseModel):
    text: str
    usage: TranscriptionUsage
