"""llama-cpp-python's API on llamacrab: a drop-in ``Llama`` for code written for ``llama_cpp``.

    from llamacrab.compat import Llama          # instead of: from llama_cpp import Llama
    llm = Llama(model_path="model.gguf", n_ctx=2048)
    print(llm("Q: Name the planets. A:", max_tokens=32)["choices"][0]["text"])

Or leave the code as it is and alias the module (only where no real llama-cpp-python is
installed): ``llamacrab.compat.install()`` before it imports ``llama_cpp``, or run it with
``python -m llamacrab.compat script.py``. Results are llama-cpp-python's dicts (shapes in
``llamacrab.compat.llama_types``); generation runs in llamacrab's engine. Keywords llamacrab
cannot honour raise UnsupportedParameterError, unknown ones TypeError: nothing is ignored.
"""

from __future__ import annotations

from llamacrab import __version__ as _llamacrab_version
from llamacrab.compat._constants import (
    GGML_TYPE_BF16,
    GGML_TYPE_F16,
    GGML_TYPE_F32,
    GGML_TYPE_Q4_0,
    GGML_TYPE_Q4_1,
    GGML_TYPE_Q5_0,
    GGML_TYPE_Q5_1,
    GGML_TYPE_Q8_0,
    LLAMA_ATTENTION_TYPE_CAUSAL,
    LLAMA_ATTENTION_TYPE_NON_CAUSAL,
    LLAMA_ATTENTION_TYPE_UNSPECIFIED,
    LLAMA_DEFAULT_SEED,
    LLAMA_FLASH_ATTN_TYPE_AUTO,
    LLAMA_FLASH_ATTN_TYPE_DISABLED,
    LLAMA_FLASH_ATTN_TYPE_ENABLED,
    LLAMA_POOLING_TYPE_CLS,
    LLAMA_POOLING_TYPE_LAST,
    LLAMA_POOLING_TYPE_MEAN,
    LLAMA_POOLING_TYPE_NONE,
    LLAMA_POOLING_TYPE_RANK,
    LLAMA_POOLING_TYPE_UNSPECIFIED,
    LLAMA_ROPE_SCALING_TYPE_LINEAR,
    LLAMA_ROPE_SCALING_TYPE_LONGROPE,
    LLAMA_ROPE_SCALING_TYPE_NONE,
    LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED,
    LLAMA_ROPE_SCALING_TYPE_YARN,
    LLAMA_SPLIT_MODE_LAYER,
    LLAMA_SPLIT_MODE_NONE,
    LLAMA_SPLIT_MODE_ROW,
)
from llamacrab.compat._errors import UnsupportedParameterError
from llamacrab.compat._shim import install, installed, uninstall
from llamacrab.compat.llama import (
    Llama,
    LlamaState,
    LlamaTokenizer,
    LogitsProcessor,
    LogitsProcessorList,
    MinTokensLogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
)
from llamacrab.compat.llama_cache import (
    BaseLlamaCache,
    LlamaCache,
    LlamaDiskCache,
    LlamaRAMCache,
)
from llamacrab.compat.llama_grammar import LlamaGrammar
from llamacrab.compat.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding
from llamacrab.compat.llama_types import *  # noqa: F403  (as llama_cpp exports them)
from llamacrab.compat.llama_types import __all__ as _types

# The llama-cpp-python API level this follows, and the llamacrab underneath.
__version__ = f"0.3.36+llamacrab{_llamacrab_version}"

__all__ = [
    "GGML_TYPE_BF16",
    "GGML_TYPE_F16",
    "GGML_TYPE_F32",
    "GGML_TYPE_Q4_0",
    "GGML_TYPE_Q4_1",
    "GGML_TYPE_Q5_0",
    "GGML_TYPE_Q5_1",
    "GGML_TYPE_Q8_0",
    "LLAMA_ATTENTION_TYPE_CAUSAL",
    "LLAMA_ATTENTION_TYPE_NON_CAUSAL",
    "LLAMA_ATTENTION_TYPE_UNSPECIFIED",
    "LLAMA_DEFAULT_SEED",
    "LLAMA_FLASH_ATTN_TYPE_AUTO",
    "LLAMA_FLASH_ATTN_TYPE_DISABLED",
    "LLAMA_FLASH_ATTN_TYPE_ENABLED",
    "LLAMA_POOLING_TYPE_CLS",
    "LLAMA_POOLING_TYPE_LAST",
    "LLAMA_POOLING_TYPE_MEAN",
    "LLAMA_POOLING_TYPE_NONE",
    "LLAMA_POOLING_TYPE_RANK",
    "LLAMA_POOLING_TYPE_UNSPECIFIED",
    "LLAMA_ROPE_SCALING_TYPE_LINEAR",
    "LLAMA_ROPE_SCALING_TYPE_LONGROPE",
    "LLAMA_ROPE_SCALING_TYPE_NONE",
    "LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED",
    "LLAMA_ROPE_SCALING_TYPE_YARN",
    "LLAMA_SPLIT_MODE_LAYER",
    "LLAMA_SPLIT_MODE_NONE",
    "LLAMA_SPLIT_MODE_ROW",
    "BaseLlamaCache",
    "Llama",
    "LlamaCache",
    "LlamaDiskCache",
    "LlamaDraftModel",
    "LlamaGrammar",
    "LlamaPromptLookupDecoding",
    "LlamaRAMCache",
    "LlamaState",
    "LlamaTokenizer",
    "LogitsProcessor",
    "LogitsProcessorList",
    "MinTokensLogitsProcessor",
    "StoppingCriteria",
    "StoppingCriteriaList",
    "UnsupportedParameterError",
    "__version__",
    "install",
    "installed",
    "uninstall",
    *_types,
]
