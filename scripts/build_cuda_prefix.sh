#!/usr/bin/env bash
# Build the pinned, patched llama.cpp with CUDA into an install-shaped folder for
# scripts/gpu_check.sh: include/, lib/ (upstream library names) and bin/llama-bench and
# bin/llama-quantize, linked together (RPATH $ORIGIN, $ORIGIN/../lib).
#   [CUDA_ARCHS=90-real] [CUDA_TOOLKIT_DIR=DIR] bash scripts/build_cuda_prefix.sh BUILD_DIR OUT_DIR
# CUDA_ARCHS is CMAKE_CUDA_ARCHITECTURES: "90-real" (Hopper machine code, no PTX) is what one
# machine needs and the fastest to compile (~40 minutes on 2 cores); a wheel for many GPUs
# lists several. The CPU code is built for AVX2 machines (no -march=native: the GPU machine's
# processor is not this one). Needs the dev environment (scripts/setup.sh) and nvcc.
set -euo pipefail
cd "$(dirname "$0")/.."
build=$(realpath -m "${1:?usage: build_cuda_prefix.sh BUILD_DIR OUT_DIR}")
out=$(realpath -m "${2:?usage: build_cuda_prefix.sh BUILD_DIR OUT_DIR}")
py=.venv/bin/python
src=$(cd llamacrab-sys && "../$py" -c "from build_tools.source import resolve_source; print(resolve_source().path)")
toolkit=$(PYTHON=$py bash scripts/cuda_toolkit_prefix.sh "${CUDA_TOOLKIT_DIR:-}")

# GGML_CUDA_NO_VMM: no link to libcuda, which a machine without the driver lacks (the
# toolkit here has no stub); ggml then pools device memory without virtual memory. The
# programs' link resolves libggml-cuda's cuBLAS through -rpath-link (it is in no system path).
cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS:-90-real}" -DGGML_CUDA_NO_VMM=ON \
    "-DCUDAToolkit_ROOT=$toolkit" "-DCMAKE_CUDA_COMPILER=$toolkit/bin/nvcc" \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
    -DGGML_RPC=ON -DGGML_RPC_RDMA=OFF -DGGML_CCACHE=OFF -DLLAMA_BUILD_COMMON=ON \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_MTMD=ON "-DCMAKE_INSTALL_RPATH=\$ORIGIN:\$ORIGIN/../lib" \
    -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON "-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath-link,$toolkit/lib"
cmake --build "$build" --target llama mtmd ggml-rpc llama-bench llama-quantize

# `cmake --install` wants every tool built; the few files an install of these targets holds:
rm -rf "$out"
mkdir -p "$out/include" "$out/lib" "$out/bin"
cp -P "$build"/bin/lib{llama,ggml,mtmd}*.so* "$out/lib/"
# The programs' own libraries stay beside them, out of what llamacrab-sys binds.
mv "$out"/lib/libllama-{common,bench-impl,quantize-impl}.so* "$out/bin/"
cp "$build/bin/llama-bench" "$build/bin/llama-quantize" "$out/bin/"
cp "$src"/include/llama.h "$src"/include/llama-cpp.h "$src"/ggml/include/*.h \
    "$src"/tools/mtmd/mtmd.h "$src"/tools/mtmd/mtmd-helper.h "$out/include/"
strip --strip-unneeded "$out"/lib/lib*.so.*.* "$out"/bin/llama-* "$out"/bin/lib*.so.*.*
echo "$out"
