"""llamacrab: run large language models locally on top of llama.cpp, safely.

    from llamacrab import Llama
    with Llama("model.gguf", n_ctx=2048) as llm:
        print(llm.create_completion("Paris is the capital of", max_tokens=8).text)

Native objects are wrapped in handles that free themselves exactly once (children first); using
a closed handle raises ClosedHandleError. llama.cpp's log goes to the ``llamacrab`` logger.
"""

from llamacrab._adapter import LoraAdapter
from llamacrab._batch import Batch
from llamacrab._cache import DiskCache, PromptCache, RamCache
from llamacrab._chat_media import MediaPolicy
from llamacrab._context import Context, ContextParams
from llamacrab._custom_sampler import CustomSampler
from llamacrab._exceptions import (
    ClosedHandleError,
    ConcurrentUseError,
    ContextError,
    ContextOverflowError,
    DecodeAbortedError,
    DecodeError,
    GrammarError,
    HubError,
    InvalidModelError,
    InvalidParameterError,
    LlamaError,
    MediaError,
    ModelLoadError,
    NativeError,
    QueueFullError,
    StateError,
    TemplateError,
    TokenizeError,
    ToolCallError,
)
from llamacrab._hub import HubOptions, ResolvedModel, resolve
from llamacrab._json_schema import JSON_OBJECT_GRAMMAR, schema_to_grammar
from llamacrab._llama import Llama
from llamacrab._media import Audio, Image
from llamacrab._model import Model, ModelParams
from llamacrab._mtmd import Bitmap, Chunks, Projector
from llamacrab._sampler import SamplerChain, SamplingOptions
from llamacrab._speculative import DraftModel, PromptLookup, SpeculativeStats
from llamacrab._state import SavedState
from llamacrab._stream import Stream
from llamacrab._tool_calls import ToolCall, parse_tool_calls
from llamacrab._types import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessage,
    Completion,
    CompletionChoice,
    CompletionChunk,
    FinishReason,
    Logprobs,
    RerankResult,
    Usage,
)
from llamacrab._vocab import IncrementalDecoder, Vocab
from llamacrab_sys import BuildInfo, build_info

__version__ = "0.1.0"

__all__ = [
    "JSON_OBJECT_GRAMMAR",
    "Audio",
    "Batch",
    "Bitmap",
    "BuildInfo",
    "ChatChoice",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatDelta",
    "ChatMessage",
    "Chunks",
    "ClosedHandleError",
    "Completion",
    "CompletionChoice",
    "CompletionChunk",
    "ConcurrentUseError",
    "Context",
    "ContextError",
    "ContextOverflowError",
    "ContextParams",
    "CustomSampler",
    "DecodeAbortedError",
    "DecodeError",
    "DiskCache",
    "DraftModel",
    "FinishReason",
    "GrammarError",
    "HubError",
    "HubOptions",
    "Image",
    "IncrementalDecoder",
    "InvalidModelError",
    "InvalidParameterError",
    "Llama",
    "LlamaError",
    "Logprobs",
    "LoraAdapter",
    "MediaError",
    "MediaPolicy",
    "Model",
    "ModelLoadError",
    "ModelParams",
    "NativeError",
    "Projector",
    "PromptCache",
    "PromptLookup",
    "QueueFullError",
    "RamCache",
    "RerankResult",
    "ResolvedModel",
    "SamplerChain",
    "SamplingOptions",
    "SavedState",
    "SpeculativeStats",
    "StateError",
    "Stream",
    "TemplateError",
    "TokenizeError",
    "ToolCall",
    "ToolCallError",
    "Usage",
    "Vocab",
    "__version__",
    "build_info",
    "parse_tool_calls",
    "resolve",
    "schema_to_grammar",
]
