"""Server settings: command-line flags, each also read from a ``LLAMACRAB_*`` variable.

Kept free of the web stack so ``llamacrab serve --help`` works without the ``server`` extra.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llamacrab._exceptions import InvalidParameterError

FLASH_ATTN = ("auto", "on", "off")
GRAPH_SAMPLING = ("auto", "on", "off")
POOLING = ("none", "mean", "cls", "last", "rank")


@dataclass(frozen=True)
class ServerSettings:
    """Everything ``llamacrab serve`` takes; see ``add_arguments`` for what each means."""

    model: str
    model_alias: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    n_ctx: int | None = None  # the whole context; None: 4096 per slot
    n_batch: int = 2048
    n_ubatch: int = 512
    n_threads: int | None = None
    n_gpu_layers: int | None = None
    numa: str | None = None  # NUMA placement of the CPU threads, for the whole process
    rpc_servers: tuple[str, ...] = ()  # ggml RPC workers (host:port) to offload layers to
    flash_attn: str = "auto"
    graph_sampling: str = "auto"  # samplers inside the compute graph where the chain fits
    ctx_checkpoints: int = 3  # per slot, of a sliding-window model's windowed layers
    no_warmup: bool = False  # skip the decode at load that spares the first request its cost
    parallel: int = 1
    embeddings: bool = False
    reranking: bool = False
    pooling: str | None = None
    chat_template: str | None = None
    mmproj: str | None = None  # a multimodal projector: images and audio in chat messages
    no_mmproj_probe: bool = False  # load it without trying it in a child process first
    max_media: int = 8  # images/sounds per request
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    cors_origins: tuple[str, ...] = ()
    cors_origin_regex: str | None = None  # origins matching it are allowed too
    insecure: bool = False
    max_body_bytes: int = 8 * 1024 * 1024
    max_tokens_limit: int = 4096  # cap on a request's max_tokens
    max_n: int = 8  # cap on a request's n, best_of and prompts
    max_queue: int = 64  # requests waiting for a slot before 503
    timeout: float = 600.0  # seconds a request may run
    shutdown_timeout: float = 5.0  # seconds requests in flight get after SIGTERM / Ctrl-C
    max_stored_responses: int = 256  # Responses API: kept for previous_response_id (0: none)
    stored_response_ttl: float = 3600.0  # Responses API: seconds a stored response is kept
    max_stored_response_bytes: int = 256 << 20  # Responses API: JSON the stored ones hold
    props: bool = False  # allow POST /props (llama-server's --props)
    slot_save_path: str | None = None  # directory of POST /slots/{id} save/restore files
    hf_filename: str | None = None
    hf_revision: str | None = None
    hf_token: str | None = field(default=None, repr=False)
    hf_cache_dir: str | None = None
    hf_endpoint: str | None = None
    hf_offline: bool | None = None
    hf_mmproj: bool = False  # fetch the Hub repository's projector too
    preset: str | None = None  # a named preset (low-ram, balanced, max-gpu) under the flags
    models: str | None = None  # multi-model form: a registry TOML file ...
    models_dir: str | None = None  # ... or a folder of GGUF files
    models_max: int | None = None  # models loaded at once (least recently used unload first)
    models_memory: str | None = None  # memory budget of the loaded models ("6GiB")
    keep_alive: float | None = None  # seconds an idle model stays loaded
    # Adapters, control vectors, speculative decoding, prompt cache, KV types, rope: the
    # Llama keywords they become are llama_kwargs's (server/_llama_kwargs.py).
    lora: tuple[str, ...] = ()  # adapter files (scale 1); ids 0, 1, ... in this order
    lora_scaled: tuple[str, ...] = ()  # FILE:SCALE, after the --lora ones
    control_vectors: tuple[str, ...] = ()
    control_vectors_scaled: tuple[str, ...] = ()  # FILE:SCALE
    control_vector_layer_range: tuple[int, int] | None = None  # first, last (inclusive)
    model_draft: str | None = None
    draft_max: int | None = None
    n_gpu_layers_draft: int | None = None
    lookup_ngram: int | None = None  # prompt lookup (n-gram drafting) up to this n-gram
    cache_ram: int | None = None  # MiB; -1 no limit, 0 off
    cache_disk: str | None = None  # a directory
    cache_disk_size: int | None = None  # MiB
    cache_type_k: str | None = None
    cache_type_v: str | None = None
    rope_scaling: str | None = None
    rope_freq_base: float | None = None
    rope_freq_scale: float | None = None
    yarn_orig_ctx: int | None = None
    yarn_ext_factor: float | None = None

    def __post_init__(self) -> None:
        servers = tuple(
            s.strip() for item in self.rpc_servers for s in item.split(",") if s.strip()
        )
        object.__setattr__(self, "rpc_servers", servers)
        if self.flash_attn not in FLASH_ATTN:
            raise InvalidParameterError(f"flash_attn must be one of {FLASH_ATTN}")
        if self.graph_sampling not in GRAPH_SAMPLING:
            raise InvalidParameterError(f"graph_sampling must be one of {GRAPH_SAMPLING}")
        if self.pooling is not None and self.pooling not in POOLING:
            raise InvalidParameterError(f"unknown pooling {self.pooling!r}; one of {POOLING}")
        for name in (
            "port",
            "parallel",
            "max_body_bytes",
            "max_tokens_limit",
            "max_n",
            "max_media",
        ):
            if getattr(self, name) < 1:
                raise InvalidParameterError(f"{name} must be >= 1")
        if self.port > 65535:  # uvicorn took 99999 as 99999 % 65536 and said 99999
            raise InvalidParameterError(f"port must be 1-65535, not {self.port}")
        # NaN failed every request; past ~1e10 s a deadline left the range of timestamps.
        if not 0 < self.timeout <= MAX_TIMEOUT or self.max_queue < 0:
            raise InvalidParameterError(
                f"timeout must be > 0 and at most {MAX_TIMEOUT:g} s (not {self.timeout}), and "
                "max_queue >= 0"
            )
        if any(not key.strip() for key in self.api_keys):
            # An empty key matched an empty x-api-key header: anyone was let in.
            raise InvalidParameterError("an API key is empty or blank: give real keys")
        if not 0 <= self.shutdown_timeout < math.inf:
            raise InvalidParameterError(
                f"shutdown_timeout must be a number of seconds >= 0, not {self.shutdown_timeout}"
            )
        if min(self.max_stored_responses, self.max_stored_response_bytes) < 0 or not (
            self.stored_response_ttl > 0
        ):
            raise InvalidParameterError(
                "max_stored_responses and max_stored_response_bytes must be >= 0 and "
                "stored_response_ttl > 0"
            )
        _check_models(self)
        if self.embeddings and self.reranking:
            raise InvalidParameterError("choose --embeddings or --reranking, not both")
        if self.chat_template is not None:
            _check_chat_template(self.chat_template)
        if self.cors_origin_regex is not None:
            try:
                re.compile(self.cors_origin_regex)
            except re.error as error:
                raise InvalidParameterError(
                    f"--cors-origin-regex does not compile: {error}"
                ) from None
        if self.slot_save_path is not None and not Path(self.slot_save_path).is_dir():
            raise InvalidParameterError(
                f"slot_save_path {self.slot_save_path!r} is not an existing directory"
            )
        if self.control_vector_layer_range is not None:
            object.__setattr__(
                self, "control_vector_layer_range", tuple(self.control_vector_layer_range)
            )

    @property
    def multi_model(self) -> bool:
        """Serving a registry of models (``--models`` / ``--models-dir``), not one model."""
        return self.models is not None or self.models_dir is not None

    @property
    def alias(self) -> str:
        """The model id clients use: the alias, else the file name or the repository id."""
        if self.model_alias:
            return self.model_alias
        return Path(self.model).name if Path(self.model).exists() else self.model

    def check_exposure(self) -> None:
        """Refuse to listen beyond this machine without an API key (unless ``insecure``)."""
        if self.api_keys or self.insecure or _is_loopback(self.host):
            return
        raise InvalidParameterError(
            f"refusing to listen on {self.host} without an API key: pass --api-key (or "
            "LLAMACRAB_API_KEY), or --insecure to serve it unprotected"
        )


MAX_TIMEOUT = 1e7  # seconds a request may run at most: about four months


# Flags naming one model's files (an adapter, vector, projector or draft model fits one
# architecture; a name or a Hub file one model): in the multi-model form they go on an entry.
_ONE_MODEL = {"mmproj": "mmproj", "hf_filename": "filename",
              "hf_revision": "revision", "hf_mmproj": "mmproj", "lora": "lora",
              "lora_scaled": "lora", "control_vectors": "control_vectors",
              "control_vectors_scaled": "control_vectors",
              "control_vector_layer_range": "control_vector_layers",
              "model_draft": "draft_model", "n_gpu_layers_draft": "draft_n_gpu_layers"}  # fmt: skip


def _check_models(settings: ServerSettings) -> None:
    if settings.multi_model:
        _check_shared_flags(settings)
    if settings.models is not None and settings.models_dir is not None:
        raise InvalidParameterError("choose --models or --models-dir, not both")
    if settings.multi_model and settings.model:
        raise InvalidParameterError("pass MODEL, or --models / --models-dir, not both")
    if settings.multi_model and (settings.embeddings or settings.reranking):
        raise InvalidParameterError(
            "--embeddings / --reranking choose one model's kind: in a registry file set "
            "embeddings = true (and pooling = 'rank') on the entry; --models-dir recognises "
            "embedding and reranker models from their files"
        )
    if settings.models_max is not None and settings.models_max < 1:
        raise InvalidParameterError("models_max must be >= 1")
    if settings.keep_alive is not None and not 0 <= settings.keep_alive < math.inf:  # NaN too
        raise InvalidParameterError(f"keep_alive must be >= 0 seconds, not {settings.keep_alive}")
    if settings.preset is not None:
        from llamacrab import PRESETS  # the native library: only when a preset is given

        if settings.preset not in PRESETS:
            raise InvalidParameterError(
                f"unknown --preset {settings.preset!r}; one of {', '.join(PRESETS)}"
            )


def _check_shared_flags(settings: ServerSettings) -> None:
    """The multi-model form applies the model flags to every entry: refuse those that name
    one model's files, each with the entry option that takes it."""
    named = [f for f in _ONE_MODEL if _is_set(getattr(settings, f))]
    if named:
        flags = ", ".join(_flag(_SINGULAR.get(f, f)) for f in named)
        options = ", ".join(dict.fromkeys(_ONE_MODEL[f] for f in named))
        raise InvalidParameterError(
            f"{flags}: with --models / --models-dir the model flags apply to every model, and "
            f"these name one model's files; set {options} on its entry in the --models TOML "
            "file instead"
        )
    if settings.model_alias is not None:
        raise InvalidParameterError(
            "--model-alias: with --models / --models-dir each model's id is its entry's name"
        )
    if settings.pooling == "rank":
        raise InvalidParameterError(
            "--pooling rank would make every embedding model a reranker: set pooling = 'rank' "
            "on the reranker's entry in the --models TOML file"
        )


def _is_set(value: object) -> bool:
    return value is not None and value is not False and value != ()


def _check_chat_template(template: str) -> None:
    """A built-in format's name, a GGUF template variant or a Jinja template: an unknown name
    would fail every chat request, so it fails at start. (Whether a variant exists and a Jinja
    template renders is checked when the model loads.)"""
    if "{{" in template or "{%" in template or template.startswith("tokenizer.chat_template."):
        return
    from llamacrab import chat_format_names  # the native library: only when a name is given

    known = chat_format_names()
    if template not in known:
        raise InvalidParameterError(
            f"unknown --chat-template {template!r}: use a built-in format ({', '.join(known)}), "
            "tokenizer.chat_template.NAME (a template in the GGUF), or a Jinja template"
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env_name(name: str) -> str:
    # LLAMACRAB_RPC is llamacrab-sys's build switch: --rpc reads LLAMACRAB_RPC_SERVERS.
    return "LLAMACRAB_RPC_SERVERS" if name == "rpc" else "LLAMACRAB_" + name.upper()


def _boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def _pair(text: str) -> int:
    """The type of a flag taking two integers (START END)."""
    return int(text)


# name, type (bool: a switch; list: repeatable), help; defaults come from ServerSettings.
_OPTIONS: list[tuple[str, Callable[[str], Any] | type, str]] = [
    ("model_alias", str, "the model id clients send and /v1/models lists"),
    ("host", str, "address to listen on (default 127.0.0.1)"),
    ("port", int, "port to listen on (default 8080)"),
    ("n_ctx", int, "context size in tokens, shared by the slots (default 4096 per slot)"),
    ("n_batch", int, "tokens per llama_decode (default 2048)"),
    ("n_ubatch", int, "physical batch size (default 512)"),
    ("n_threads", int, "CPU threads (default: one per physical core this process may use)"),
    ("n_gpu_layers", int, "layers to offload to a GPU"),
    ("rpc", list, "ggml RPC workers host:port to offload layers to (comma-separated or repeated)"),
    ("flash_attn", str, f"flash attention: {', '.join(FLASH_ATTN)} (default auto)"),
    ("numa", str, "NUMA placement of CPU threads: distribute, isolate, numactl (default none)"),
    (
        "graph_sampling",
        str,
        f"sample inside the compute graph: {', '.join(GRAPH_SAMPLING)} "
        "(default auto: on where the output layer runs off the CPU)",
    ),
    (
        "ctx_checkpoints",
        int,
        "checkpoints per slot of a sliding-window model's windowed layers, to reuse a prompt "
        "prefix the window has passed (default 3; 0: none)",
    ),
    (
        "no_warmup",
        bool,
        "skip the warm-up decode at load (llama-server's flag; by default the first request "
        "does not pay for faulting the weights in)",
    ),
    ("parallel", int, "slots: requests generated concurrently (default 1)"),
    ("embeddings", bool, "serve /v1/embeddings (an embedding model) instead of generation"),
    ("reranking", bool, "serve /v1/rerank (a reranker model) instead of generation"),
    ("pooling", str, f"embedding pooling: {', '.join(POOLING)} (default: the model's)"),
    ("chat_template", str, "a built-in chat format name or a Jinja template (default: model's)"),
    ("mmproj", str, "multimodal projector GGUF: image_url/input_audio parts in chat"),
    (
        "no_mmproj_probe",
        bool,
        "load the projector without trying it in a child process first (a file you trust; "
        "by default one that would abort is refused)",
    ),
    ("max_media", int, "images/sounds per request (default 8)"),
    ("api_key", list, "accepted Bearer key (repeatable; env: comma-separated)"),
    ("cors_origin", list, "allowed CORS origin or * (repeatable; default: CORS off)"),
    ("cors_origin_regex", str, "allowed CORS origins as a regex (see the README)"),
    ("insecure", bool, "allow a non-loopback --host without an API key"),
    ("max_body_bytes", int, "largest request body (default 8 MiB)"),
    ("max_tokens_limit", int, "cap on a request's max_tokens (default 4096)"),
    ("max_n", int, "cap on a request's n, best_of and prompts (default 8)"),
    ("max_queue", int, "requests waiting for a slot before 503 (default 64)"),
    ("timeout", float, "seconds a request may run (default 600)"),
    (
        "shutdown_timeout",
        float,
        "seconds requests in flight may take to finish after SIGTERM or Ctrl-C before the "
        "models close and they end with 503 shutting_down (default 5; 0: at once)",
    ),
    ("max_stored_responses", int, "responses kept for previous_response_id (default 256)"),
    ("stored_response_ttl", float, "seconds a stored response is kept (default 3600)"),
    (
        "max_stored_response_bytes",
        int,
        "bytes of JSON the stored responses may hold together, the oldest dropped first "
        "(default 268435456: 256 MiB)",
    ),
    ("props", bool, "allow POST /props (llama-server's flag; nothing is writable yet)"),
    ("slot_save_path", str, "directory for POST /slots/{id}?action=save|restore (default: off)"),
    ("hf_filename", str, "Hub: file or glob in the repository"),
    ("hf_revision", str, "Hub: branch, tag or commit"),
    ("hf_token", str, "Hub: access token (default HF_TOKEN)"),
    ("hf_cache_dir", str, "Hub: cache directory"),
    ("hf_endpoint", str, "Hub: endpoint URL (default HF_ENDPOINT)"),
    ("hf_offline", bool, "Hub: use the local cache only"),
    ("hf_mmproj", bool, "Hub: fetch the repository's multimodal projector too"),
    ("preset", str, "named options under the flags: low-ram, balanced, max-gpu (see README)"),
    ("models", str, "serve several models: a registry TOML file (instead of MODEL)"),
    ("models_dir", str, "serve every GGUF in this folder (instead of MODEL)"),
    ("models_max", int, "most models loaded at once; the least recently used unloads"),
    ("models_memory", str, "memory budget of the loaded models, e.g. 6GiB (estimated)"),
    ("keep_alive", float, "seconds an idle model stays loaded (default: until evicted)"),
    ("lora", list, "LoRA adapter file, scale 1 (repeatable; ids 0, 1, ... in order)"),
    ("lora_scaled", list, "LoRA adapter as FILE:SCALE (repeatable; after the --lora ones)"),
    ("control_vector", list, "control-vector GGUF file (repeatable; vectors add up)"),
    ("control_vector_scaled", list, "control vector as FILE:STRENGTH (repeatable)"),
    ("control_vector_layer_range", _pair, "first and last layer the control vectors apply to"),
    ("model_draft", str, "draft model GGUF for speculative decoding (needs --parallel 1)"),
    ("draft_max", int, "most tokens drafted per step (default 8; 32 for --lookup-ngram)"),
    ("n_gpu_layers_draft", int, "layers of the draft model to offload to a GPU"),
    ("lookup_ngram", int, "speculative decoding by prompt lookup up to this n-gram"),
    ("cache_ram", int, "prompt cache in RAM of N MiB (-1: no limit; 0: off)"),
    ("cache_disk", str, "prompt cache directory on disk (kept across restarts)"),
    ("cache_disk_size", int, "largest size of the --cache-disk directory in MiB (default 8192)"),
    ("cache_type_k", str, "KV cache type of K: f16, f32, bf16, q8_0, q4_0, q4_1, q5_0, q5_1"),
    ("cache_type_v", str, "KV cache type of V (the same types; quantized V needs flash attn)"),
    ("rope_scaling", str, "RoPE scaling: none, linear, yarn, longrope (default: the model's)"),
    ("rope_freq_base", float, "RoPE base frequency (default: the model's)"),
    ("rope_freq_scale", float, "RoPE frequency scale, 1/N to extend the context N times"),
    ("yarn_orig_ctx", int, "YaRN: the model's original context length"),
    ("yarn_ext_factor", float, "YaRN: extrapolation mix factor (-1: the model's)"),
]
_PLURAL = {"api_key": "api_keys", "cors_origin": "cors_origins", "rpc": "rpc_servers"}
_SINGULAR = {"control_vectors": "control_vector", "control_vectors_scaled": "control_vector_scaled"}


def add_arguments(
    parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None
) -> None:
    """Add the server flags to ``parser``; a set ``LLAMACRAB_<NAME>`` variable is the default
    (one not of its flag's type is refused by ``settings_from_args``, naming it)."""
    env = os.environ if environ is None else environ
    parser.add_argument(
        "model", nargs="?", default=env.get("LLAMACRAB_MODEL"),
        help="GGUF path or Hugging Face repo id (env LLAMACRAB_MODEL)",
    )  # fmt: skip
    parser.add_argument("-m", "--model", dest="model_flag", help="the same as MODEL")
    for name, kind, text in _OPTIONS:
        raw = env.get(_env_name(name))
        help_text = f"{text} [env {_env_name(name)}]"
        if kind is bool:
            switch = _from_env(name, raw, _boolean)
            parser.add_argument(_flag(name), action="store_true", default=switch, help=help_text)
        elif kind is list:
            items = [] if raw is None else [v.strip() for v in raw.split(",") if v.strip()]
            parser.add_argument(_flag(name), action="append", default=items, help=help_text)
        elif kind is _pair:  # two integers: START END (env: "START,END")
            pair = _from_env(name, raw, lambda r: [int(v) for v in r.replace(",", " ").split()])
            parser.add_argument(_flag(name), type=int, nargs=2, metavar=("START", "END"),
                                default=pair, help=help_text)  # fmt: skip
        else:
            parser.add_argument(
                _flag(name), type=kind, default=_from_env(name, raw, kind), help=help_text
            )


@dataclass(frozen=True)
class _BadEnv:
    """A variable's value that is not its flag's type: an error when the flag is used (every
    subcommand builds these flags: ``run --help`` failed on a bad LLAMACRAB_PORT)."""

    variable: str
    value: str
    problem: str


def _from_env(name: str, raw: str | None, convert: Callable[[str], Any]) -> Any:
    if raw is None:
        return None
    try:
        return convert(raw)
    except (ValueError, argparse.ArgumentTypeError) as error:
        return _BadEnv(_env_name(name), raw, str(error))


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """The settings of a namespace parsed with ``add_arguments``' flags; InvalidParameterError
    for a missing model, or a ``LLAMACRAB_*`` value not of its flag's type that no flag
    replaced (naming the variable)."""
    model = args.model_flag or args.model
    if not model and not (args.models or args.models_dir):
        raise InvalidParameterError(
            "no model: pass MODEL, --model or LLAMACRAB_MODEL (or --models / --models-dir)"
        )
    values: dict[str, Any] = {"model": model or ""}
    for name, kind, _ in _OPTIONS:
        value = getattr(args, name)
        if isinstance(value, _BadEnv):
            raise InvalidParameterError(f"{value.variable}={value.value!r}: {value.problem}")
        if kind is list:
            values[_PLURAL[name]] = tuple(value)
        elif value is not None:
            values[name] = value
    return ServerSettings(**values)


def parse_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> ServerSettings:
    parser = argparse.ArgumentParser(prog="llamacrab serve")
    add_arguments(parser, environ)
    return settings_from_args(parser.parse_args(argv))


# The model flags' repeatable options and the ServerSettings fields they fill.
_PLURAL.update(lora="lora", lora_scaled="lora_scaled", control_vector="control_vectors",
               control_vector_scaled="control_vectors_scaled")  # fmt: skip
