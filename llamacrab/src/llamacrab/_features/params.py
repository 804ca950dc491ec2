"""Keyword options of ``Llama(...)`` and of a completion, sorted into their parameter objects."""

from __future__ import annotations

import dataclasses
from typing import Any

from llamacrab._exceptions import InvalidParameterError
from llamacrab._features.hub import HubOptions
from llamacrab._field_types import INT32_MAX, check_range
from llamacrab._native.context import ContextParams
from llamacrab._native.model import ModelParams
from llamacrab._native.sampler import SamplingOptions

_MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelParams)}
_CONTEXT_FIELDS = {f.name for f in dataclasses.fields(ContextParams)}
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingOptions)}
_HUB_FIELDS = {f.name for f in dataclasses.fields(HubOptions)}


def split_params(options: dict[str, Any]) -> tuple[ModelParams, ContextParams, HubOptions]:
    unknown = set(options) - _MODEL_FIELDS - _CONTEXT_FIELDS - _HUB_FIELDS
    if unknown:
        raise InvalidParameterError(f"unknown Llama parameters: {sorted(unknown)}")
    model = ModelParams(**{k: v for k, v in options.items() if k in _MODEL_FIELDS})
    context_options = {k: v for k, v in options.items() if k in _CONTEXT_FIELDS}
    if context_options.get("embeddings"):
        # Batched embeddings pack many texts as sequences of one shared memory.
        context_options = {"n_seq_max": 64, "kv_unified": True, **context_options}
    context = ContextParams(**context_options)
    hub = HubOptions(**{k: v for k, v in options.items() if k in _HUB_FIELDS})
    return model, context, hub


def with_slots(
    params: ContextParams | None, parallel: int | None, max_queue: int, speculative: object
) -> ContextParams | None:
    """Context parameters with room for ``parallel`` sequences."""
    check_range("max_queue", max_queue, 0, INT32_MAX)
    if parallel is None:
        return params
    check_range("parallel", parallel, 1, INT32_MAX)
    if speculative is not None:
        raise InvalidParameterError("speculative decoding needs a Llama with parallel=None")
    params = params or ContextParams()
    if params.embeddings:
        raise InvalidParameterError("parallel slots are for generation, not embeddings contexts")
    if params.n_seq_max not in (1, parallel):
        raise InvalidParameterError(f"n_seq_max {params.n_seq_max} != parallel {parallel}")
    return dataclasses.replace(params, n_seq_max=parallel)


def merge_sampling(
    sampling: SamplingOptions | None, options: dict[str, Any], seed: int | None
) -> SamplingOptions:
    """``sampling`` (or the defaults with the Llama's ``seed``) with keyword fields replaced."""
    unknown = set(options) - _SAMPLING_FIELDS
    if unknown:
        raise InvalidParameterError(f"unknown sampling options: {sorted(unknown)}")
    base = sampling or SamplingOptions(seed=seed)
    return dataclasses.replace(base, **options) if options else base
