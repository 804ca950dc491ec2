"""The memory a ``Llama`` built from keyword options would take, estimated before loading."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from llamacrab._features.hub import HubOptions
from llamacrab._features.hub import resolve as resolve_model
from llamacrab._features.params import split_params, with_slots
from llamacrab._native.context import ContextParams
from llamacrab._native.gguf_memory import MemoryEstimate, estimate_memory
from llamacrab._native.model import ModelParams

PARAM_FIELDS = {
    f.name for kind in (ModelParams, ContextParams, HubOptions) for f in dataclasses.fields(kind)
}


def estimate_llama(model: str | os.PathLike[str], options: Mapping[str, Any]) -> MemoryEstimate:
    """The memory of ``Llama(model, **options)`` (a preset already applied): weights (with a
    projector), KV memory for its context and slots, compute buffers."""
    params, context, hub = split_params({k: v for k, v in options.items() if k in PARAM_FIELDS})
    slots = with_slots(context, options.get("parallel"), options.get("max_queue", 64), None)
    files = resolve_model(model, hub)
    projector = options.get("mmproj") or files.mmproj
    return estimate_memory(files.path, slots, projector, params.kv_overrides)
