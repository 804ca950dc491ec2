#!/usr/bin/env bash
# Assemble a CUDA toolkit prefix that CMake's FindCUDAToolkit accepts on a machine whose CUDA
# install has nvcc and cudart but no cuBLAS.
#   - cuBLAS comes from the PyPI wheel nvidia-cublas, pinned to the toolkit's major.minor
#     (override with CUBLAS_SPEC, e.g. CUBLAS_SPEC='nvidia-cublas==13.0.2.14'), or an installed
#     one named by CUBLAS_DIR (its include/ and lib/, e.g. PyTorch's site-packages/nvidia/cu13:
#     nothing downloaded, for a machine without a package index);
#   - the prefix is a directory of symlinks: bin/nvvm from ${CUDA_HOME:-/usr/local/cuda},
#     include/ and lib/ merging the toolkit's and the wheel's, lib64 -> lib, targets/<arch>/
#     pointing back at them, and unversioned libcublas.so / libcublasLt.so links.
# Usage: scripts/cuda_toolkit_prefix.sh [OUT_DIR]   (prints the prefix path on stdout)
# Then: cmake ... -DCUDAToolkit_ROOT=<prefix> -DCMAKE_CUDA_COMPILER=<prefix>/bin/nvcc
# Re-running reuses the installed wheel and refreshes the links.
set -euo pipefail

out=${1:-${LLAMACRAB_CACHE_DIR:-$HOME/.cache/llamacrab}/cuda-toolkit}
cuda=$(realpath "${CUDA_HOME:-/usr/local/cuda}")
python=${PYTHON:-python3}
[ -x "$cuda/bin/nvcc" ] || { echo "no nvcc in $cuda/bin (set CUDA_HOME)" >&2; exit 1; }
mkdir -p "$out"
out=$(realpath "$out")
wheel="$out/wheel"     # pip --target scratch dir
prefix="$out/prefix"   # the merged toolkit

# 1. cuBLAS wheel, matching the toolkit release (nvcc: "release 13.0, V13.0.88").
find_cublas_h() { find "$wheel" -name cublas_v2.h -path '*/include/*' 2>/dev/null | head -n1; }
if [ -n "${CUBLAS_DIR:-}" ]; then
    wheel=$(realpath "$CUBLAS_DIR")
elif [ -z "$(find_cublas_h)" ]; then
    release=$("$cuda/bin/nvcc" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
    spec=${CUBLAS_SPEC:-nvidia-cublas==${release}.*}
    echo "installing $spec into $wheel" >&2
    "$python" -m pip install --quiet --disable-pip-version-check --no-deps \
        --target "$wheel" "$spec" >&2
fi
header=$(find_cublas_h)
[ -n "$header" ] || { echo "cublas_v2.h not found under $wheel" >&2; exit 1; }
wheel_root=$(dirname "$(dirname "$header")")   # nvidia/cu13 (or nvidia/cublas for cu12 wheels)

# Symlink every entry of directory $1 into directory $2, first one in wins.
link_entries() {
    local src=$1 dst=$2 entry
    [ -d "$src" ] || return 0
    for entry in "$src"/*; do
        [ -e "$dst/$(basename "$entry")" ] || ln -s "$entry" "$dst/"
    done
}

# 2. The merged prefix.
mkdir -p "$prefix/include" "$prefix/lib"
for d in bin nvvm; do
    [ -d "$cuda/$d" ] && ln -sfn "$cuda/$d" "$prefix/$d"
done
link_entries "$cuda/include" "$prefix/include"
link_entries "$wheel_root/include" "$prefix/include"
link_entries "$(realpath "$cuda/lib64")" "$prefix/lib"
link_entries "$wheel_root/lib" "$prefix/lib"
ln -sfn lib "$prefix/lib64"
# targets/<arch>/{include,lib} as in a real toolkit, pointing at the merged dirs.
for t in "$cuda"/targets/*/; do
    [ -d "$t" ] || continue
    arch=$(basename "$t")
    mkdir -p "$prefix/targets/$arch"
    ln -sfn ../../include "$prefix/targets/$arch/include"
    ln -sfn ../../lib "$prefix/targets/$arch/lib"
done
# The wheel ships only libcublas.so.13 etc.; the linker and FindCUDAToolkit want the bare names.
for name in libcublas libcublasLt; do
    versioned=$(find "$prefix/lib/" -maxdepth 1 -name "$name.so.*" | sort -V | head -n1)
    [ -n "$versioned" ] || { echo "no $name.so.* in $wheel_root/lib" >&2; exit 1; }
    ln -sfn "$(basename "$versioned")" "$prefix/lib/$name.so"
done

echo "$prefix"
