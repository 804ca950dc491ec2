#!/usr/bin/env bash
# Install llamacrab-sys wheels into a fresh virtual environment and prove they work there: the
# build info, then a few tokens from a tiny generated model (on the CPU when the wheel's GPU
# backend finds no device). Used by the release workflow for every Linux wheel.
#   bash scripts/smoke_wheel.sh WHEEL [WHEEL ...]
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$python" -m venv "$scratch/venv"
venv_py="$scratch/venv/bin/python"
"$venv_py" -m pip install --quiet --disable-pip-version-check "$@" gguf==0.19.0
"$venv_py" -m llamacrab_sys
"$venv_py" scripts/make_tiny_gguf.py "$scratch/tiny.gguf" >/dev/null
"$venv_py" examples/raw_generate.py "$scratch/tiny.gguf" --tokens 4
echo "OK: $* installs and generates in a fresh venv"
