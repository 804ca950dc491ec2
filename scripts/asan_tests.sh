#!/usr/bin/env bash
# Run the handle, lifecycle and native-input tests under AddressSanitizer (CI's asan job).
#
# Needs a llamacrab-sys built with LLAMACRAB_SANITIZE=address (shims and llama.cpp instrumented):
#   LLAMACRAB_SANITIZE=address bash scripts/setup.sh --no-run
# The environment is sanitizer_env.sh's. Reports go to files, so a report from a child process or
# from a process whose output pytest captured is never lost; any report fails the run.
#
# Usage: bash scripts/asan_tests.sh [pytest options]
#   PYTHON: the interpreter (default .venv/bin/python); ASAN_TESTS: the tests to run, separated
#   by spaces (default: the list below).
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/sanitizer_env.sh
case ",$sanitize," in
  *,address,*) ;;
  *) echo "llamacrab-sys is built with sanitize=$sanitize, without address" >&2; exit 2 ;;
esac
reports=$(mktemp -d "${TMPDIR:-/tmp}/llamacrab-asan.XXXXXX")

tests=(
  tests/test_handles.py tests/test_threads.py tests/test_parallel.py tests/test_state.py
  tests/test_crash_proof.py tests/test_abort.py tests/test_engine_faults.py tests/test_lora.py
  tests/test_multimodal.py tests/test_speculative.py tests/test_embeddings.py
  tests/test_tampered_files.py tests/test_gguf_check.py tests/test_hardening_inputs.py
  tests/test_ffi_traps.py
)
# The lifecycle fuzzing of the reliability suite (short size), where this checkout has it.
if grep -qs "def test_lifecycle_sequences" tests/test_reliability.py; then
  tests+=(tests/test_reliability.py::test_lifecycle_sequences)
fi
if [ -n "${ASAN_TESTS:-}" ]; then read -r -a tests <<< "$ASAN_TESTS"; fi

export ASAN_OPTIONS="$ASAN_OPTIONS:log_path=$reports/asan"

status=0
"$python" -m pytest -p no:cacheprovider "$@" "${tests[@]}" || status=$?
if compgen -G "$reports/asan.*" > /dev/null; then
  echo "AddressSanitizer reports:" >&2
  for report in "$reports"/asan.*; do
    echo "== $report" >&2
    cat "$report" >&2
  done
  status=1
fi
exit "$status"
