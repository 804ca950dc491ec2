#!/usr/bin/env bash
# Run sections of the reliability suite (scripts/reliability.py) on llamacrab-sys built with
# sanitizers, in the environment of sanitizer_env.sh. A case that makes a sanitizer report ends
# its child with exit status 99: it is a death, its detail the report's summary and end (the
# whole report is in the child's log, kept with its job file). With AddressSanitizer the
# sections run without their address-space limits, which its shadow memory cannot live under.
#
# What ASan sees: the blocks llamacrab, the GGUF reader, llama.cpp's loader and tokenizers
# allocate one by one. A kernel's read past a tensor that stays inside one of ggml's buffers
# (weights, KV cache, compute graph) is not seen: the rerun on another heap is for those. Two
# deaths are ASan's own: a C++ allocation too large for its allocator (the plain build throws
# std::bad_alloc, an error) and, where a section expects a child to die of a signal, none.
#
# Usage: bash scripts/sanitizer_reliability.sh [reliability.py options], e.g.
#   bash scripts/sanitizer_reliability.sh --sections archs,tampered-tiny --workdir /tmp/sanitized
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/sanitizer_env.sh
export ASAN_OPTIONS="$ASAN_OPTIONS:print_legend=0"
exec "$python" scripts/reliability.py "$@"
