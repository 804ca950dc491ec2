"""Typed, OpenAI-shaped results of completion calls."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ToolCall:
    """One requested call: ``arguments`` is JSON text, as in the OpenAI API."""

    name: str
    arguments: str
    id: str = ""
    type: str = "function"


FinishReason = Literal["length", "eos", "stop", "cancelled", "tool_calls"]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens reused from the KV memory or a prompt cache
    # Wall time reading the prompt (from its start to the first token sampled), and after it
    # to the end (0.0 where nothing ran). Waiting for a slot is in neither.
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class ChatChoice:
    index: int
    message: ChatMessage
    finish_reason: FinishReason
    logprobs: Logprobs | None = None  # with logprobs=N: each token and its N alternatives
    stop_sequence: str | None = None  # the stop string that ended it (finish_reason "stop")


@dataclass(frozen=True)
class ChatCompletion:
    id: str
    created: int
    model: str
    choices: tuple[ChatChoice, ...]
    usage: Usage

    @property
    def text(self) -> str:
        """The content of the first choice's message."""
        return self.choices[0].message.content or ""


@dataclass(frozen=True)
class ChatDelta:
    role: str | None = None
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class ChatCompletionChunk:
    """One streamed piece; the first carries the role, the last ``finish_reason``/``usage``."""

    id: str
    created: int
    model: str
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: Logprobs | None = None
    stop_sequence: str | None = None  # on the last chunk: the stop string that ended it
    usage_so_far: Usage | None = None  # as CompletionChunk's


@dataclass(frozen=True)
class SlotInfo:
    """One generation slot of a Llama (``Llama.slots()``): whether it generates now, and how
    many tokens its memory holds (a prefix the next prompt may reuse)."""

    id: int
    busy: bool
    n_tokens: int
    n_ctx: int  # the most tokens the slot may hold


@dataclass(frozen=True)
class Classification:
    """One text's classes from a sequence classifier, most likely first: each label (see
    ``Model.classifier_labels``), the head's output for it (``scores``: logits, or
    probabilities where llama.cpp's graph ends in a softmax, as Qwen3 rerankers'), and its
    probability (a softmax over the outputs; a sigmoid for a head of one output)."""

    index: int
    labels: tuple[str, ...]
    scores: tuple[float, ...]
    probabilities: tuple[float, ...]

    @property
    def label(self) -> str:
        """The most likely label."""
        return self.labels[0]


@dataclass(frozen=True)
class RerankResult:
    """One document's relevance to the query; higher is more relevant."""

    index: int
    score: float
    document: str


@dataclass(frozen=True)
class Logprobs:
    """Per generated token: its text, log-probability and the most likely alternatives. An
    echoed prompt's first token has None for both (nothing before it predicts it), as
    OpenAI lists it: the values line up with the prompt's tokens."""

    tokens: tuple[str, ...]
    token_logprobs: tuple[float | None, ...]
    top_logprobs: tuple[dict[str, float] | None, ...]
    text_offset: tuple[int, ...]
    # Per generated token, the ids of its top_logprobs' tokens in their order (a prompt's
    # tokens, with echo, have none).
    top_ids: tuple[tuple[int, ...], ...] = ()
    # Per token, its bytes: ``tokens`` shows a byte that is part of a character split across
    # tokens escaped (``\\xf0``), these hold the byte itself (OpenAI's logprobs ``bytes``).
    token_bytes: tuple[bytes, ...] = ()
    # Per generated token, the bytes of its top_logprobs' tokens in their order.
    top_bytes: tuple[tuple[bytes, ...], ...] = ()

    @staticmethod
    def join(parts: Sequence[Logprobs]) -> Logprobs:
        """Concatenate the logprobs of consecutive chunks (offsets are already absolute)."""
        return Logprobs(
            tuple(t for p in parts for t in p.tokens),
            tuple(v for p in parts for v in p.token_logprobs),
            tuple(d for p in parts for d in p.top_logprobs),
            tuple(o for p in parts for o in p.text_offset),
            tuple(i for p in parts for i in p.top_ids),
            tuple(b for p in parts for b in p.token_bytes),
            tuple(b for p in parts for b in p.top_bytes),
        )


@dataclass(frozen=True)
class CompletionChoice:
    index: int
    text: str
    finish_reason: FinishReason
    tokens: tuple[int, ...]
    logprobs: Logprobs | None = None
    stop_sequence: str | None = None  # the stop string that ended it (finish_reason "stop")
    slot: int | None = None  # the parallel slot (context sequence) that generated it


@dataclass(frozen=True)
class Completion:
    id: str
    created: int
    model: str
    choices: tuple[CompletionChoice, ...]
    usage: Usage

    @property
    def text(self) -> str:
        """The text of the first choice."""
        return self.choices[0].text


@dataclass(frozen=True)
class CompletionChunk:
    """One streamed piece. ``finish_reason`` and ``usage`` are set on the last chunk only."""

    id: str
    created: int
    model: str
    index: int
    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    tokens: tuple[int, ...] = ()
    logprobs: Logprobs | None = None
    stop_sequence: str | None = None  # on the last chunk: the stop string that ended it
    # The parallel slot (context sequence) generating it; None before one took it.
    slot: int | None = None
    # The usage up to this chunk, on each chunk the generation made (the last one's is its
    # usage): tokens generated so far and the time since the first one (llama-server's
    # timings_per_token). None on an echoed prompt.
    usage_so_far: Usage | None = None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share. Here, the lowest layer, because every
    layer needs it: KV reuse, prompt caches, slot choice, and llama-cpp-python's
    ``Llama.longest_token_prefix``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
