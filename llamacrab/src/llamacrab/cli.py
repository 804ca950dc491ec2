"""The ``llamacrab`` command line: ``llamacrab run MODEL --prompt ...``.

MODEL is a GGUF path or a Hugging Face repository id (``org/repo``); the Hub options are the
same as the Python API's. More commands (``serve``) come with the server.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from llamacrab._context import ContextParams
from llamacrab._exceptions import LlamaError
from llamacrab._hub import HubOptions
from llamacrab._llama import Llama
from llamacrab._model import ModelParams


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a GGUF file or a Hugging Face repository id (org/repo)")
    hub = parser.add_argument_group("Hugging Face Hub")
    hub.add_argument("--filename", help="file (or glob) in the repository")
    hub.add_argument("--revision", help="branch, tag or commit")
    hub.add_argument("--token", help="access token (default: HF_TOKEN or the saved login)")
    hub.add_argument("--cache-dir", help="cache directory (default: huggingface_hub's)")
    hub.add_argument("--endpoint", help="Hub URL (default: HF_ENDPOINT or huggingface.co)")
    hub.add_argument("--offline", action="store_true", default=None, help="use the cache only")
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--n-threads", type=int)
    parser.add_argument("--n-gpu-layers", type=int)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llamacrab", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="complete a prompt and stream the text")
    _add_model_arguments(run)
    run.add_argument("-p", "--prompt", required=True)
    run.add_argument("-n", "--max-tokens", type=int, default=128)
    run.add_argument("--temperature", type=float, default=0.8)
    run.add_argument("--top-k", type=int, default=40)
    run.add_argument("--top-p", type=float, default=0.95)
    run.add_argument("--seed", type=int)
    run.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    return parser


def _run(args: argparse.Namespace) -> None:
    hub = HubOptions(
        filename=args.filename,
        revision=args.revision,
        token=args.token,
        cache_dir=args.cache_dir,
        endpoint=args.endpoint,
        offline=args.offline,
    )
    params = {"n_ctx": args.n_ctx, "n_threads": args.n_threads, "n_gpu_layers": args.n_gpu_layers}
    given = {k: v for k, v in params.items() if v is not None}
    model_params = ModelParams(**{k: v for k, v in given.items() if k == "n_gpu_layers"})
    context_params = ContextParams(**{k: v for k, v in given.items() if k != "n_gpu_layers"})
    with Llama(
        args.model, model_params=model_params, context_params=context_params, hub=hub
    ) as llm:
        stream = llm.stream_completion(
            args.prompt, max_tokens=args.max_tokens, stop=args.stop, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        )  # fmt: skip
        for chunk in stream:
            print(chunk.text, end="", flush=True)
        print()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            _run(args)
    except LlamaError as error:
        print(f"llamacrab: {error}", file=sys.stderr)
        return 1
    return 0
