"""llamacrab: run large language models locally on top of llama.cpp, safely.

    from llamacrab import Llama
    with Llama("model.gguf", n_ctx=2048) as llm:
        print(llm.create_completion("Paris is the capital of", max_tokens=8).text)

Native objects are wrapped in handles that free themselves exactly once (children first); using
a closed handle raises ClosedHandleError. llama.cpp's log goes to the ``llamacrab`` logger.
"""

# First: the CPUs this process may use, before llama.cpp's OpenMP can pin this thread.
from llamacrab import _startup_cpus  # noqa: F401  # isort: skip

from llamacrab._chat.builtin import builtin_names as chat_format_names
from llamacrab._chat.media_parts import MediaPolicy
from llamacrab._chat.tool_calls import parse_tool_calls
from llamacrab._engine.cache import DiskCache, PromptCache, RamCache
from llamacrab._engine.speculative import DraftModel, PromptLookup, SpeculativeStats
from llamacrab._engine.stream import Stream
from llamacrab._exceptions import (
    ClosedHandleError,
    ConcurrentUseError,
    ContextError,
    ContextOverflowError,
    DecodeAbortedError,
    DecodeError,
    ForkedHandleError,
    GrammarError,
    HubError,
    InvalidModelError,
    InvalidParameterError,
    LlamaError,
    MediaError,
    ModelBudgetError,
    ModelLoadError,
    NativeError,
    QuantizationError,
    QueueFullError,
    RpcError,
    RpcProtocolError,
    RpcUnavailableError,
    StateError,
    SysVersionError,
    TemplateError,
    TokenizeError,
    ToolCallError,
    UnknownModelError,
)
from llamacrab._features.hub import HubOptions, ResolvedModel, resolve
from llamacrab._features.infill import InfillLimits
from llamacrab._features.presets import PRESETS, Preset
from llamacrab._features.quantize import quantize, quantize_types
from llamacrab._features.rpc import RpcWorker, RpcWorkerOptions, local_devices
from llamacrab._features.rpc import probe as probe_rpc_worker
from llamacrab._features.rpc import run_worker as run_rpc_worker
from llamacrab._grammar.json_schema import JSON_OBJECT_GRAMMAR, schema_to_grammar
from llamacrab._llama import Llama
from llamacrab._native.adapter import LoraAdapter
from llamacrab._native.batch import Batch
from llamacrab._native.context import Context, ContextParams
from llamacrab._native.control_vector import ControlVector
from llamacrab._native.custom_sampler import CustomSampler, EndGeneration
from llamacrab._native.gguf_memory import MemoryEstimate
from llamacrab._native.media import Audio, Image
from llamacrab._native.model import Model, ModelParams
from llamacrab._native.mtmd import Bitmap, Chunks, Projector
from llamacrab._native.numa import init_numa
from llamacrab._native.sampler import SamplerChain, SamplingOptions
from llamacrab._native.state import SavedState, StateCheckpoint
from llamacrab._native.vocab import IncrementalDecoder, Vocab
from llamacrab._registry import EntryStatus, ModelEntry, ModelRegistry, estimate_memory
from llamacrab._types import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessage,
    Classification,
    Completion,
    CompletionChoice,
    CompletionChunk,
    FinishReason,
    Logprobs,
    RerankResult,
    SlotInfo,
    ToolCall,
    Usage,
)
from llamacrab_sys import BuildInfo, build_info

__version__ = "0.1.0"

__all__ = [
    "JSON_OBJECT_GRAMMAR",
    "PRESETS",
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
    "Classification",
    "ClosedHandleError",
    "Completion",
    "CompletionChoice",
    "CompletionChunk",
    "ConcurrentUseError",
    "Context",
    "ContextError",
    "ContextOverflowError",
    "ContextParams",
    "ControlVector",
    "CustomSampler",
    "DecodeAbortedError",
    "DecodeError",
    "DiskCache",
    "DraftModel",
    "EndGeneration",
    "EntryStatus",
    "FinishReason",
    "ForkedHandleError",
    "GrammarError",
    "HubError",
    "HubOptions",
    "Image",
    "IncrementalDecoder",
    "InfillLimits",
    "InvalidModelError",
    "InvalidParameterError",
    "Llama",
    "LlamaError",
    "Logprobs",
    "LoraAdapter",
    "MediaError",
    "MediaPolicy",
    "MemoryEstimate",
    "Model",
    "ModelBudgetError",
    "ModelEntry",
    "ModelLoadError",
    "ModelParams",
    "ModelRegistry",
    "NativeError",
    "Preset",
    "Projector",
    "PromptCache",
    "PromptLookup",
    "QuantizationError",
    "QueueFullError",
    "RamCache",
    "RerankResult",
    "ResolvedModel",
    "RpcError",
    "RpcProtocolError",
    "RpcUnavailableError",
    "RpcWorker",
    "RpcWorkerOptions",
    "SamplerChain",
    "SamplingOptions",
    "SavedState",
    "SlotInfo",
    "SpeculativeStats",
    "StateCheckpoint",
    "StateError",
    "Stream",
    "SysVersionError",
    "TemplateError",
    "TokenizeError",
    "ToolCall",
    "ToolCallError",
    "UnknownModelError",
    "Usage",
    "Vocab",
    "__version__",
    "build_info",
    "chat_format_names",
    "estimate_memory",
    "init_numa",
    "local_devices",
    "parse_tool_calls",
    "probe_rpc_worker",
    "quantize",
    "quantize_types",
    "resolve",
    "run_rpc_worker",
    "schema_to_grammar",
]
