"""The Responses API's HTTP contract (OpenAI's ``/v1/responses``): input items, tools, text
format, and the response object. Unknown fields are ignored, as on the other routes; known
fields that would change the answer but are not supported are refused by name in
``_responses_wire``. Item, part and tool types not supported here parse as ``Unsupported`` so
that the refusal can name them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    field_validator,
)

from llamacrab.server._schemas import Lenient, LoraEntry

# OpenAI's bounds on metadata: 16 pairs, keys up to 64 characters, values up to 512 (a stored
# response keeps its metadata for an hour: unbounded, a client could fill memory with it).
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
    Field(max_length=16),
]


class Unsupported(BaseModel):
    """An item, content part or tool of a type this server does not run."""

    model_config = ConfigDict(extra="allow")
    type: str


def _by_type(known: tuple[str, ...], default: str | None = None) -> Callable[[Any], str | None]:
    """A discriminator on ``type``: one of ``known``, else "unsupported" (None: not an object,
    which pydantic reports)."""

    def tag(value: Any) -> str | None:
        if isinstance(value, dict):
            kind = value.get("type", default)
        elif isinstance(value, BaseModel):
            kind = getattr(value, "type", None)
        else:
            return None
        return kind if kind in known else "unsupported"

    return tag


# -- input ---------------------------------------------------------------------------------------


class TextPart(Lenient):
    type: Literal["input_text", "output_text"]
    text: str


class RefusalPart(Lenient):
    type: Literal["refusal"]
    refusal: str


class ImagePart(Lenient):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


ContentPart = Annotated[
    Annotated[TextPart, Tag("input_text")]
    | Annotated[TextPart, Tag("output_text")]
    | Annotated[RefusalPart, Tag("refusal")]
    | Annotated[ImagePart, Tag("input_image")]
    | Annotated[Unsupported, Tag("unsupported")],
    Discriminator(_by_type(("input_text", "output_text", "refusal", "input_image"))),
]


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class ItemBase(Lenient):
    """What an item keeps once its response is stored, for ``GET
    /v1/responses/{id}/input_items``: its id (the client's, else one given when stored) and
    its status."""

    id: str | None = None
    status: ItemStatus | None = None


class MessageItem(ItemBase):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(ItemBase):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(ItemBase):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


class ItemReference(Lenient):
    """An item of a stored response, by its id: the Vercel AI SDK sends earlier answers so
    while responses are stored (its default)."""

    type: Literal["item_reference"] = "item_reference"
    id: str


_ITEM_TYPES = ("message", "function_call", "function_call_output")
_ITEMS = (
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[Unsupported, Tag("unsupported")]
)
# A message may leave its type out ({"role": ..., "content": ...}).
InputItem = Annotated[_ITEMS, Discriminator(_by_type(_ITEM_TYPES, "message"))]
INPUT_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])
_request_item_type = _by_type((*_ITEM_TYPES, "item_reference"), "message")


def _reference_or_type(value: Any) -> str | None:
    """A bare ``{"id": ...}`` is a reference (the SDK's ItemReference may leave its type out);
    any other item without a type, a message."""
    if isinstance(value, dict) and value.keys() == {"id"}:
        return "item_reference"
    return _request_item_type(value)


# What a request's input may hold besides: references to stored items.
RequestItem = Annotated[
    _ITEMS | Annotated[ItemReference, Tag("item_reference")], Discriminator(_reference_or_type)
]


class FunctionTool(Lenient):
    """A function tool in the Responses API's flat shape."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[Unsupported, Tag("unsupported")],
    Discriminator(_by_type(("function",))),
]


class FunctionChoice(Lenient):
    type: Literal["function"]
    name: str


ToolChoice = Annotated[
    Annotated[FunctionChoice, Tag("function")] | Annotated[Unsupported, Tag("unsupported")],
    Discriminator(_by_type(("function",))),
]


class TextFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(Lenient):
    format: TextFormat = Field(default_factory=lambda: TextFormat.model_validate({}))
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(Lenient):
    """``effort`` reaches the chat template as llama-server passes it (see
    ``_wire.template_variables``); no reasoning summary is produced."""

    effort: str | None = None
    summary: str | None = None


class ResponseRequest(Lenient):
    model: str | None = None
    input: list[RequestItem] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    metadata: Metadata | None = None
    user: str | None = None
    lora: list[LoraEntry] | None = None  # llama-server's: this request's adapter scales
    # Fields refused unless unset (or at their default), named in the error.
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] | None = None
    context_management: list[dict[str, Any]] | None = None
    moderation: dict[str, Any] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _text_is_a_user_message(cls, value: Any) -> Any:
        if value is None:
            return []
        return [{"role": "user", "content": value}] if isinstance(value, str) else value


# -- the response --------------------------------------------------------------------------------


class OutputTextOut(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class MessageOut(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputTextOut]


class FunctionCallOut(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = Annotated[MessageOut | FunctionCallOut, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseErrorOut(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseErrorOut | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    text: dict[str, Any]
    store: bool
    metadata: Metadata
    user: str | None = None
    background: bool
    truncation: Literal["disabled"]
    reasoning: dict[str, Any]


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class InputItemList(BaseModel):
    """A page of a stored response's input items (their JSON: see ``_responses_items``)."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class InputTokens(BaseModel):
    object: Literal["response.input_tokens"] = "response.input_tokens"
    input_tokens: int
