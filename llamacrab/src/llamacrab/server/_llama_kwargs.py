"""``llamacrab serve``'s model flags as ``Llama`` keyword arguments: one mapping, used for the
served model, and in the multi-model form for every registry entry (``model_kwargs`` for any
kind, ``generation_kwargs`` for models that generate).

Every value is plain (numbers, strings, paths, tuples), so the same keywords can come from a
file: ``Llama(path, **llama_kwargs(settings))``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from llamacrab import InvalidParameterError, MediaPolicy
from llamacrab.server._settings import ServerSettings

MIB = 1 << 20


def llama_kwargs(settings: ServerSettings) -> dict[str, Any]:
    """The ``Llama`` keywords ``settings`` ask for (None values left out): model and context
    parameters, the Hub, slots, adapters and control vectors, speculative decoding, the prompt
    cache. Raises InvalidParameterError for values that cannot work together."""
    options = model_kwargs(settings)
    options.update(filename=settings.hf_filename, revision=settings.hf_revision,
                   mmproj=settings.hf_mmproj or None)  # fmt: skip
    options.update(_adapter_options(settings))
    generating = not (settings.embeddings or settings.reranking)
    if not generating:
        adapters = (settings.lora, settings.lora_scaled, settings.control_vectors,
                    settings.control_vectors_scaled)  # fmt: skip
        if settings.model_draft or settings.lookup_ngram or any(adapters):
            raise InvalidParameterError(
                "--model-draft, --lookup-ngram, --lora and --control-vector are for generation, "
                "not --embeddings or --reranking"
            )
        pooling = "rank" if settings.reranking else settings.pooling
        options.update(embeddings=True, pooling=pooling, n_ctx=settings.n_ctx)
    else:
        options["n_ctx"] = settings.n_ctx or 4096 * settings.parallel
        options.update(generation_kwargs(settings))
        if settings.mmproj:  # a projector file; else --hf-mmproj's choice stands
            options["mmproj"] = settings.mmproj
        options["mmproj_probe"] = not settings.no_mmproj_probe
    return {k: v for k, v in options.items() if v is not None}


def model_kwargs(settings: ServerSettings) -> dict[str, Any]:
    """The flags any model takes, whatever it serves (None: not given): batch sizes, threads,
    GPU layers, flash attention, KV types, rope, RPC workers, Hub access, the warm-up."""
    return {
        "n_batch": settings.n_batch, "n_ubatch": settings.n_ubatch,
        "n_threads": settings.n_threads, "n_gpu_layers": settings.n_gpu_layers,
        "flash_attn": settings.flash_attn, "token": settings.hf_token,
        "cache_dir": settings.hf_cache_dir, "endpoint": settings.hf_endpoint,
        "offline": settings.hf_offline,
        "type_k": settings.cache_type_k, "type_v": settings.cache_type_v,
        "rope_scaling": settings.rope_scaling, "rope_freq_base": settings.rope_freq_base,
        "rope_freq_scale": settings.rope_freq_scale, "yarn_orig_ctx": settings.yarn_orig_ctx,
        "yarn_ext_factor": settings.yarn_ext_factor,
        "rpc_servers": settings.rpc_servers or None, "warmup": not settings.no_warmup,
    }  # fmt: skip


def generation_kwargs(settings: ServerSettings) -> dict[str, Any]:
    """The flags of a model that generates: slots and queue, chat format, the media policy,
    speculative decoding and the prompt cache."""
    # Clients send media inline (data: URLs): they cannot make the server read its files or
    # fetch URLs.
    policy = MediaPolicy(local_files=False, remote=False, max_media=settings.max_media,
                         max_bytes=settings.max_body_bytes)  # fmt: skip
    options: dict[str, Any] = {
        "parallel": settings.parallel, "max_queue": settings.max_queue,
        "chat_format": settings.chat_template, "media_policy": policy,
        "graph_sampling": settings.graph_sampling, "ctx_checkpoints": settings.ctx_checkpoints,
    }  # fmt: skip
    options.update(_speculative_options(settings))
    options.update(_cache_options(settings))
    return options


def given(options: Mapping[str, Any]) -> dict[str, Any]:
    """The ``options`` whose flags were given: neither None nor the flag's default value."""
    defaults = {f.name: f.default for f in dataclasses.fields(ServerSettings)}
    return {k: v for k, v in options.items() if v is not None and defaults.get(k) != v}


def _scaled(items: tuple[str, ...], flag: str) -> list[tuple[str, float]]:
    """FILE:SCALE items (each may hold several, comma-separated, as llama-server takes them)."""
    result = []
    for item in (part for entry in items for part in entry.split(",") if part.strip()):
        path, sep, scale = item.strip().rpartition(":")
        try:
            if not sep or not path:
                raise ValueError
            result.append((path, float(scale)))
        except ValueError:
            raise InvalidParameterError(f"{flag} takes FILE:SCALE, not {item!r}") from None
    return result


def _plain(items: tuple[str, ...]) -> list[tuple[str, float]]:
    return [(p.strip(), 1.0) for entry in items for p in entry.split(",") if p.strip()]


def _adapter_options(settings: ServerSettings) -> dict[str, Any]:
    lora = _plain(settings.lora) + _scaled(settings.lora_scaled, "--lora-scaled")
    vectors = _plain(settings.control_vectors) + _scaled(
        settings.control_vectors_scaled, "--control-vector-scaled"
    )
    layers = settings.control_vector_layer_range
    if layers is not None and not vectors:
        raise InvalidParameterError("--control-vector-layer-range needs --control-vector")
    return {"lora": tuple(lora) or None, "control_vectors": tuple(vectors) or None,
            "control_vector_layers": tuple(layers) if layers is not None else None}  # fmt: skip


def _speculative_options(settings: ServerSettings) -> dict[str, Any]:
    if settings.model_draft is None and settings.lookup_ngram is None:
        if settings.draft_max is not None or settings.n_gpu_layers_draft is not None:
            raise InvalidParameterError("--draft-max needs --model-draft or --lookup-ngram")
        return {}
    if settings.model_draft is not None and settings.lookup_ngram is not None:
        raise InvalidParameterError("choose --model-draft or --lookup-ngram, not both")
    if settings.parallel != 1:
        raise InvalidParameterError(
            "speculative decoding (--model-draft, --lookup-ngram) runs on one slot: "
            "use --parallel 1"
        )
    return {"parallel": None, "draft_model": settings.model_draft,
            "prompt_lookup": settings.lookup_ngram, "draft_max": settings.draft_max,
            "draft_n_gpu_layers": settings.n_gpu_layers_draft}  # fmt: skip


def _cache_options(settings: ServerSettings) -> dict[str, Any]:
    ram, disk, size = settings.cache_ram, settings.cache_disk, settings.cache_disk_size
    if ram is not None and disk is not None:
        raise InvalidParameterError("choose --cache-ram or --cache-disk, not both")
    if size is not None and disk is None:
        raise InvalidParameterError("--cache-disk-size needs --cache-disk")
    if disk is not None:
        return {"prompt_cache": disk, "prompt_cache_bytes": None if size is None else size * MIB}
    if ram is None or ram == 0:  # as llama-server: 0 turns the cache off
        return {}
    # -1: no limit (as llama-server's --cache-ram -1); a RamCache needs a number: 1 TiB.
    return {"prompt_cache": "ram", "prompt_cache_bytes": (1 << 40) if ram < 0 else ram * MIB}
