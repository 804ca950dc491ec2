"""The exception hierarchy of llamacrab. Every error raised by the package is a LlamaError.

LlamaError
├── ClosedHandleError          a model, context or sampler was used after close()
├── ConcurrentUseError         a context was entered from two threads at once
├── NativeError                llama.cpp threw a C++ exception (caught by a shim)
├── ModelLoadError             llama.cpp could not load the model
│   └── InvalidModelError      (also ValueError) the file failed validation before loading
├── ContextError               llama.cpp could not create a context
├── DecodeError                llama_decode failed (.status its return code; 0: NaN logits)
│   └── DecodeAbortedError     the abort callback stopped it (see Context.cancel)
├── ContextOverflowError       (also ValueError) the tokens do not fit in the context
├── TokenizeError              (also ValueError) text or tokens rejected
├── GrammarError               (also ValueError) a grammar llama.cpp could not parse
├── HubError                   a model could not be resolved or fetched from the Hub
├── StateError                 (also ValueError) a saved state that cannot be loaded here
├── TemplateError              (also ValueError) a chat template that failed or was refused
├── QueueFullError             every parallel slot is busy and the waiting queue is full
├── ToolCallError              (also ValueError) a tool call whose arguments fail their schema
├── MediaError                 (also ValueError) an image or sound that cannot be used
├── UnknownModelError          (also LookupError) a registry has no entry of that name
├── ModelBudgetError           no room for a model within a registry's limits (.permanent)
├── RpcError                   a ggml RPC worker cannot be used or started (.endpoint)
│   ├── RpcUnavailableError    no connection, or no HELLO answer in time
│   └── RpcProtocolError       it answered, but not as this build's RPC protocol version
├── SysVersionError            (also ImportError) the installed llamacrab-sys is not supported
└── InvalidParameterError      (also ValueError) a parameter out of its range
"""

from __future__ import annotations

from typing import Any


class LlamaError(Exception):
    """Base class of every llamacrab error; never raised directly."""


class ClosedHandleError(LlamaError):
    """A native handle was used after it was closed (or its parent was)."""


class ForkedHandleError(ClosedHandleError):
    """A handle made before ``os.fork()`` was used in the child process: it is the parent's."""


class ConcurrentUseError(LlamaError):
    """A context is already in use by another thread."""


class NativeError(LlamaError):
    """llama.cpp raised a C++ exception; the shim turned it into this error."""

    def __init__(self, function: str, code: int, message: str) -> None:
        super().__init__(f"{function} failed in C++: {message or 'no message'} (code {code})")
        self.function = function
        self.code = code
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        # Its arguments, not its text: a multiprocessing worker's error is pickled back to the
        # parent, and one that cannot be made again there hung Pool.map for ever.
        return type(self), (self.function, self.code, self.message)


class ModelLoadError(LlamaError):
    """llama.cpp could not load a model file."""


class InvalidModelError(ModelLoadError, ValueError):
    """A model file is not a valid GGUF llama.cpp could load safely."""


class ContextError(LlamaError):
    """llama.cpp could not create a context."""


class DecodeError(LlamaError):
    """llama_decode returned an error ``status``, or (``status`` 0) computed NaN logits."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status

    def __reduce__(self) -> tuple[Any, ...]:  # as NativeError's
        return type(self), (str(self), self.status)


class DecodeAbortedError(DecodeError):
    """A decode was cancelled through the abort callback."""


class ContextOverflowError(LlamaError, ValueError):
    """More tokens than the context can hold: ``n_prompt_tokens`` of them where ``n_ctx`` fit
    (when known; llama-server reports both)."""

    def __init__(
        self, message: str, *, n_prompt_tokens: int | None = None, n_ctx: int | None = None
    ) -> None:
        super().__init__(message)
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx


class TokenizeError(LlamaError, ValueError):
    """Text or tokens that cannot be tokenized or detokenized."""


class GrammarError(LlamaError, ValueError):
    """A GBNF grammar llama.cpp rejected."""


class HubError(LlamaError):
    """A Hugging Face Hub model could not be resolved or downloaded."""


class StateError(LlamaError, ValueError):
    """A saved state that is corrupt, truncated, from another model or context size, or from
    a llamacrab before state format 5 (it records no KV fingerprint: save it again)."""


class TemplateError(LlamaError, ValueError):
    """A chat template that does not parse, fails, or tries something the sandbox refuses."""


class QueueFullError(LlamaError):
    """Every parallel slot is busy and the waiting queue is full: try again later."""


class ToolCallError(LlamaError, ValueError):
    """A tool call naming no known tool, or whose arguments do not match its schema."""


class MediaError(LlamaError, ValueError):
    """An image or sound that cannot be decoded, or that this projector cannot take."""


class UnknownModelError(LlamaError, LookupError):
    """A ModelRegistry has no entry of that name."""


class ModelBudgetError(LlamaError):
    """A model does not fit a registry's ``max_loaded`` or memory budget, and no loaded model
    can make room (each is in use or pinned, or the model ``alone`` exceeds the budget).
    ``permanent``: no room will come by waiting (the model ``alone`` is too large, or the
    pinned models leave none until one is unloaded on request)."""

    def __init__(self, message: str, *, alone: bool = False, permanent: bool = False) -> None:
        super().__init__(message)
        self.alone = alone  # never fits: unloading others cannot help
        self.permanent = permanent or alone


class InvalidParameterError(LlamaError, ValueError):
    """A parameter outside its valid range."""


class QuantizationError(LlamaError):
    """llama.cpp could not quantize a model (its reason in the message), or its process ended
    on a signal; nothing was written at the destination."""


class RpcError(LlamaError):
    """A ggml RPC worker cannot be used (or a worker could not be started); ``endpoint`` is its
    ``host:port`` where one is concerned."""

    def __init__(self, message: str, endpoint: str | None = None) -> None:
        super().__init__(message)
        self.endpoint = endpoint


class RpcUnavailableError(RpcError):
    """Nothing accepted the connection, or the worker gave no HELLO answer in time (it serves
    one client at a time: another process may be using it)."""


class RpcProtocolError(RpcError):
    """The peer answered, but not as an RPC worker of this build's protocol version."""


class SysVersionError(LlamaError, ImportError):
    """The installed llamacrab-sys (its version, or the llama.cpp commit it was built from) is
    not one this llamacrab supports; raised by ``import llamacrab``."""
