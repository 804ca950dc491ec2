"""Load a model by its Hugging Face repository id, with every Hub option spelled out.

Usage: python examples/hub.py ORG/REPO [--filename GLOB] [--revision REV] [--endpoint URL]
           [--cache-dir DIR] [--offline]

The token comes from HF_TOKEN (or `huggingface-cli login`); it is never printed. Files land in the
standard Hugging Face cache, so a second run (or another tool) reuses them, also offline.
"""

from __future__ import annotations

import argparse

from llamacrab import HubOptions, Llama, resolve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repo")
    parser.add_argument("--filename")
    parser.add_argument("--revision")
    parser.add_argument("--endpoint")
    parser.add_argument("--cache-dir")
    parser.add_argument("--offline", action="store_true", default=None)
    args = parser.parse_args()
    options = HubOptions(filename=args.filename, revision=args.revision, endpoint=args.endpoint,
                         cache_dir=args.cache_dir, offline=args.offline)  # fmt: skip
    files = resolve(args.repo, options)  # downloads (with a progress bar) or finds in the cache
    print("model file:", files.path, f"({len(files.parts)} part(s))")
    with Llama(files.path, n_ctx=2048) as llm:
        print(llm.create_completion("Hello, my name is", max_tokens=16).text)


if __name__ == "__main__":
    main()
