"""The shapes of the dicts that llama-cpp-python's ``Llama`` returns and takes, as TypedDicts.

They follow the OpenAI API objects (completions, chat completions, embeddings) the way
llama-cpp-python presents them; ``llamacrab.compat`` builds its results with these keys. The
names match ``llama_cpp.llama_types`` so that annotations written against it keep working.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

JsonType = int | float | str | bool | list[Any] | dict[str, Any] | None

# ``cancelled``: a llamacrab extension, for a generation stopped by ``Llama.cancel()`` or by a
# newer call on the same thread.
FinishReason = Literal["stop", "length", "tool_calls", "function_call", "cancelled"]

# -- embeddings -------------------------------------------------------------------------------


class EmbeddingUsage(TypedDict):
    prompt_tokens: int
    total_tokens: int


class Embedding(TypedDict):
    index: int
    object: str  # "embedding"
    embedding: list[float] | list[list[float]]  # per token when the context does not pool


class CreateEmbeddingResponse(TypedDict):
    object: Literal["list"]
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


# -- text completions ---------------------------------------------------------------------------


class CompletionLogprobs(TypedDict):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(TypedDict):
    text: str
    index: int
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class CompletionUsage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _CompletionResponseBase(TypedDict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]


class CreateCompletionResponse(_CompletionResponseBase, total=False):
    usage: CompletionUsage  # absent from streamed chunks


# -- chat completions: responses ------------------------------------------------------------------


class ChatCompletionResponseFunctionCall(TypedDict):
    name: str
    arguments: str


class ChatCompletionMessageToolCallFunction(TypedDict):
    name: str
    arguments: str


class ChatCompletionMessageToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: ChatCompletionMessageToolCallFunction


ChatCompletionMessageToolCalls = list[ChatCompletionMessageToolCall]


class _ResponseMessageBase(TypedDict):
    role: Literal["assistant", "function"]
    content: str | None


class ChatCompletionResponseMessage(_ResponseMessageBase, total=False):
    tool_calls: ChatCompletionMessageToolCalls
    function_call: ChatCompletionResponseFunctionCall  # the first tool call, legacy form


class ChatCompletionTopLogprobToken(TypedDict):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatCompletionLogprobToken(ChatCompletionTopLogprobToken):
    top_logprobs: list[ChatCompletionTopLogprobToken]


class ChatCompletionLogprobs(TypedDict):
    content: list[ChatCompletionLogprobToken] | None
    refusal: list[ChatCompletionLogprobToken] | None


class ChatCompletionResponseChoice(TypedDict):
    index: int
    message: ChatCompletionResponseMessage
    logprobs: ChatCompletionLogprobs | None
    finish_reason: FinishReason | None


class CreateChatCompletionResponse(TypedDict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: CompletionUsage


class ChatCompletionMessageToolCallChunkFunction(TypedDict):
    name: str | None
    arguments: str


class ChatCompletionMessageToolCallChunk(TypedDict):
    index: int
    id: str | None
    type: Literal["function"]
    function: ChatCompletionMessageToolCallChunkFunction


class ChatCompletionStreamResponseDeltaEmpty(TypedDict):
    pass


class ChatCompletionStreamResponseDeltaFunctionCall(TypedDict):
    name: str
    arguments: str


class ChatCompletionStreamResponseDelta(TypedDict, total=False):
    content: str | None
    function_call: ChatCompletionStreamResponseDeltaFunctionCall | None
    tool_calls: list[ChatCompletionMessageToolCallChunk] | None
    role: Literal["system", "user", "assistant", "tool"] | None


class ChatCompletionStreamResponseChoice(TypedDict):
    index: int
    delta: ChatCompletionStreamResponseDelta | ChatCompletionStreamResponseDeltaEmpty
    finish_reason: FinishReason | None
    logprobs: ChatCompletionLogprobs | None


class CreateChatCompletionStreamResponse(TypedDict):
    id: str
    model: str
    object: Literal["chat.completion.chunk"]
    created: int
    choices: list[ChatCompletionStreamResponseChoice]


# -- chat completions: requests -------------------------------------------------------------------


class ChatCompletionFunction(TypedDict, total=False):
    name: str
    description: str
    parameters: dict[str, JsonType]


ChatCompletionFunctions = ChatCompletionFunction


class ChatCompletionFunctionCallOption(TypedDict):
    name: str


class ChatCompletionRequestResponseFormat(TypedDict, total=False):
    type: Literal["text", "json_object", "json_schema"]
    schema: JsonType  # with "json_object": constrain the answer to this JSON Schema
    json_schema: dict[str, JsonType]  # with "json_schema": {"schema": {...}}


class ChatCompletionRequestMessageContentPartText(TypedDict):
    type: Literal["text"]
    text: str


class ChatCompletionRequestMessageContentPartImageImageUrl(TypedDict, total=False):
    url: str
    detail: Literal["auto", "low", "high"]


class ChatCompletionRequestMessageContentPartImage(TypedDict):
    type: Literal["image_url"]
    image_url: str | ChatCompletionRequestMessageContentPartImageImageUrl


ChatCompletionRequestMessageContentPart = (
    ChatCompletionRequestMessageContentPartText | ChatCompletionRequestMessageContentPartImage
)


class ChatCompletionRequestSystemMessage(TypedDict):
    role: Literal["system"]
    content: str | None


class ChatCompletionRequestUserMessage(TypedDict):
    role: Literal["user"]
    content: str | list[ChatCompletionRequestMessageContentPart] | None


class ChatCompletionRequestAssistantMessageFunctionCall(TypedDict):
    name: str
    arguments: str


class _AssistantMessageBase(TypedDict):
    role: Literal["assistant"]
    content: str | None


class ChatCompletionRequestAssistantMessage(_AssistantMessageBase, total=False):
    tool_calls: ChatCompletionMessageToolCalls
    function_call: ChatCompletionRequestAssistantMessageFunctionCall


class ChatCompletionRequestToolMessage(TypedDict):
    role: Literal["tool"]
    content: str | None
    tool_call_id: str


class ChatCompletionRequestFunctionMessage(TypedDict):
    role: Literal["function"]
    content: str | None
    name: str


ChatCompletionRequestMessage = (
    ChatCompletionRequestSystemMessage
    | ChatCompletionRequestUserMessage
    | ChatCompletionRequestAssistantMessage
    | ChatCompletionRequestToolMessage
    | ChatCompletionRequestFunctionMessage
)


class ChatCompletionRequestFunctionCallOption(TypedDict):
    name: str


ChatCompletionRequestFunctionCall = (
    Literal["none", "auto"] | ChatCompletionRequestFunctionCallOption
)

ChatCompletionFunctionParameters = dict[str, JsonType]


class ChatCompletionToolFunction(TypedDict, total=False):
    name: str
    description: str
    parameters: ChatCompletionFunctionParameters


class ChatCompletionTool(TypedDict):
    type: Literal["function"]
    function: ChatCompletionToolFunction


class ChatCompletionNamedToolChoiceFunction(TypedDict):
    name: str


class ChatCompletionNamedToolChoice(TypedDict):
    type: Literal["function"]
    function: ChatCompletionNamedToolChoiceFunction


ChatCompletionToolChoiceOption = Literal["none", "auto", "required"] | ChatCompletionNamedToolChoice

# -- the other names llama-cpp-python gives the same shapes -------------------------------------

EmbeddingData = Embedding
CompletionChunk = CreateCompletionResponse
Completion = CreateCompletionResponse
CreateCompletionStreamResponse = CreateCompletionResponse
ChatCompletionMessage = ChatCompletionResponseMessage
ChatCompletionChoice = ChatCompletionResponseChoice
ChatCompletion = CreateChatCompletionResponse
ChatCompletionChunkDeltaEmpty = ChatCompletionStreamResponseDeltaEmpty
ChatCompletionChunkChoice = ChatCompletionStreamResponseChoice
ChatCompletionChunkDelta = ChatCompletionStreamResponseDelta
ChatCompletionChunk = CreateChatCompletionStreamResponse
ChatCompletionStreamResponse = CreateChatCompletionStreamResponse
ChatCompletionResponseFunction = ChatCompletionFunction
ChatCompletionFunctionCall = ChatCompletionResponseFunctionCall

__all__ = [
    "ChatCompletion",
    "ChatCompletionChoice",
    "ChatCompletionChunk",
    "ChatCompletionChunkChoice",
    "ChatCompletionChunkDelta",
    "ChatCompletionChunkDeltaEmpty",
    "ChatCompletionFunction",
    "ChatCompletionFunctionCall",
    "ChatCompletionFunctionCallOption",
    "ChatCompletionFunctionParameters",
    "ChatCompletionFunctions",
    "ChatCompletionLogprobToken",
    "ChatCompletionLogprobs",
    "ChatCompletionMessage",
    "ChatCompletionMessageToolCall",
    "ChatCompletionMessageToolCallChunk",
    "ChatCompletionMessageToolCallChunkFunction",
    "ChatCompletionMessageToolCallFunction",
    "ChatCompletionMessageToolCalls",
    "ChatCompletionNamedToolChoice",
    "ChatCompletionNamedToolChoiceFunction",
    "ChatCompletionRequestAssistantMessage",
    "ChatCompletionRequestAssistantMessageFunctionCall",
    "ChatCompletionRequestFunctionCall",
    "ChatCompletionRequestFunctionCallOption",
    "ChatCompletionRequestFunctionMessage",
    "ChatCompletionRequestMessage",
    "ChatCompletionRequestMessageContentPart",
    "ChatCompletionRequestMessageContentPartImage",
    "ChatCompletionRequestMessageContentPartImageImageUrl",
    "ChatCompletionRequestMessageContentPartText",
    "ChatCompletionRequestResponseFormat",
    "ChatCompletionRequestSystemMessage",
    "ChatCompletionRequestToolMessage",
    "ChatCompletionRequestUserMessage",
    "ChatCompletionResponseChoice",
    "ChatCompletionResponseFunction",
    "ChatCompletionResponseFunctionCall",
    "ChatCompletionResponseMessage",
    "ChatCompletionStreamResponse",
    "ChatCompletionStreamResponseChoice",
    "ChatCompletionStreamResponseDelta",
    "ChatCompletionStreamResponseDeltaEmpty",
    "ChatCompletionStreamResponseDeltaFunctionCall",
    "ChatCompletionTool",
    "ChatCompletionToolChoiceOption",
    "ChatCompletionToolFunction",
    "ChatCompletionTopLogprobToken",
    "Completion",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionLogprobs",
    "CompletionUsage",
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "CreateCompletionStreamResponse",
    "CreateEmbeddingResponse",
    "Embedding",
    "EmbeddingData",
    "EmbeddingUsage",
    "FinishReason",
    "JsonType",
]
