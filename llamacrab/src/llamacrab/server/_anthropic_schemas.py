"""Anthropic's Messages API: request and response models (they make the OpenAPI document).

Unknown top-level fields are refused, as Anthropic refuses them: a field this server does not
know could change what the answer means. Content blocks ignore keys they do not know
(``cache_control``, ``citations``): those are hints, not meaning.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from llamacrab.server._schemas import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    Lenient,
    LoraEntry,
    NullIsAbsent,
)


class _Strict(NullIsAbsent):  # ("stream": null is no stream)
    model_config = ConfigDict(extra="forbid")


class TextBlock(Lenient):
    type: Literal["text"]
    text: str


class ImageSource(Lenient):
    type: str  # "base64" is served; "url" and "file" are refused (the server fetches nothing)
    media_type: str | None = None
    data: str | None = None


class ImageBlock(Lenient):
    type: Literal["image"]
    source: ImageSource


class DocumentSource(Lenient):
    type: str  # "text" is served; PDFs ("base64"), "url" and "content" are refused
    media_type: str | None = None
    data: str | None = None


class DocumentBlock(Lenient):
    type: Literal["document"]
    source: DocumentSource
    title: str | None = None
    context: str | None = None


class ToolUseBlock(Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ContentBlock] = ""
    is_error: bool = False


class ThinkingBlock(Lenient):
    """A thinking block of an earlier assistant turn (Anthropic drops them from the prompt)."""

    type: Literal["thinking", "redacted_thinking"]


class OtherBlock(Lenient):
    """Any other block (search results, server tools' blocks): refused by name."""

    type: str


_TAGS = {"text": "text", "image": "image", "document": "document", "tool_use": "tool_use",
         "tool_result": "tool_result", "thinking": "thinking",
         "redacted_thinking": "thinking"}  # fmt: skip


def _block_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _TAGS.get(kind, "other") if isinstance(kind, str) else "other"


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ImageBlock, Tag("image")]
    | Annotated[DocumentBlock, Tag("document")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[OtherBlock, Tag("other")],
    Discriminator(_block_tag),
]
ToolResultBlock.model_rebuild()


class MessageIn(Lenient):
    role: Literal["user", "assistant", "system"]  # system: an instruction among the turns
    content: str | list[ContentBlock]


class ToolIn(Lenient):
    type: str | None = None  # "custom" or absent: a client tool; anything else is a server tool
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    defer_loading: bool = False  # only tool search loads a deferred tool: refused


class ToolChoiceIn(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(Lenient):
    type: str  # only "disabled" is served: the model has no extended thinking
    budget_tokens: int | None = None


class OutputFormat(Lenient):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Lenient):
    format: OutputFormat | None = None
    effort: str | None = None  # guides thinking, which this server does not do: ignored


class CountTokensRequest(_Strict):
    """The prompt's fields: what ``/v1/messages/count_tokens`` counts."""

    model: str
    messages: list[MessageIn] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoiceIn | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Accepted and ignored: they change where or how fast an answer is made, not what it is
    # (prompts are cached here without being asked).
    cache_control: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    speed: str | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


# Stop strings are matched against every generated piece: the OpenAI routes' bounds apply.
StopSequence = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=0)  # required, as Anthropic requires it; 0 only reads the prompt
    stop_sequences: list[StopSequence] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    lora: list[LoraEntry] | None = None  # llama-server's: this request's adapter scales
    thread: dict[str, Any] | None = None  # stored server-side threads: refused (see wire)


# -- responses -----------------------------------------------------------------------------------


class TextBlockOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlockOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class UsageOut(BaseModel):
    input_tokens: int  # not read from the prompt cache
    output_tokens: int
    cache_read_input_tokens: int


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[TextBlockOut | ToolUseBlockOut]
    model: str
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use",
                         "model_context_window_exceeded"]  # fmt: skip
    stop_sequence: str | None
    usage: UsageOut


class CountTokensResponse(BaseModel):
    input_tokens: int


class ErrorBodyOut(BaseModel):
    type: str
    message: str


class ErrorOut(BaseModel):
    type: Literal["error"] = "error"
    error: ErrorBodyOut
