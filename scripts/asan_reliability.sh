#!/usr/bin/env bash
# Run sections of the reliability suite (scripts/reliability.py) on llamacrab-sys built with
# AddressSanitizer, in the environment of asan_env.sh. A case that makes ASan report ends its
# child with exit status 1: it is a death, its detail the end of the report (the whole one is in
# the child's log, kept with its job file). Sections run without their address-space limits,
# which ASan's shadow memory cannot live under.
#
# What ASan sees: the blocks llamacrab, the GGUF reader, llama.cpp's loader and tokenizers
# allocate one by one. A kernel's read past a tensor that stays inside one of ggml's buffers
# (weights, KV cache, compute graph) is not seen: the rerun on another heap is for those.
#
# Usage: bash scripts/asan_reliability.sh [reliability.py options], e.g.
#   bash scripts/asan_reliability.sh --sections archs,tampered-tiny --workdir /tmp/asan-reliability
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/asan_env.sh
export ASAN_OPTIONS="$ASAN_OPTIONS:print_legend=0"
exec "$python" scripts/reliability.py "$@"
