# shellcheck shell=bash
# Sourced by the scripts that run llamacrab-sys built with AddressSanitizer
# (LLAMACRAB_SANITIZE=address bash scripts/setup.sh --no-run). CPython itself is not
# instrumented, so the ASan runtime is preloaded (with libstdc++, which Python does not load: ASan
# must find __cxa_throw at start to intercept C++ exceptions), leak checks are off (CPython keeps
# memory until exit by design), and SIGFPE is left to the cases that expect a child to die of one.
# Sets python (from PYTHON, default .venv/bin/python), LD_PRELOAD, ASAN_OPTIONS (to which the
# scripts add their own) and GGML_NO_BACKTRACE;
# exits 2 when the interpreter's llamacrab-sys is not built with AddressSanitizer.
python=${PYTHON:-.venv/bin/python}
cc=${CC:-gcc}
LD_PRELOAD="$("$cc" -print-file-name=libasan.so) $("$cc" -print-file-name=libstdc++.so)"
export LD_PRELOAD
export GGML_NO_BACKTRACE=1
export ASAN_OPTIONS="detect_leaks=0:handle_sigfpe=0"
sanitize=$("$python" -c "from llamacrab_sys import build_info; print(build_info().sanitize)")
if [ "$sanitize" != "address" ]; then
  echo "llamacrab-sys is not built with AddressSanitizer (sanitize=${sanitize:-none});" \
       "build it with LLAMACRAB_SANITIZE=address" >&2
  exit 2
fi
