# shellcheck shell=bash
# Sourced by the scripts that run llamacrab-sys built with sanitizers
# (LLAMACRAB_SANITIZE=address, undefined or address,undefined bash scripts/setup.sh --no-run).
# - AddressSanitizer: CPython itself is not instrumented, so the runtime is preloaded (with
#   libstdc++, which Python does not load: ASan must find __cxa_throw at start to intercept C++
#   exceptions), leak checks are off (CPython keeps memory until exit by design), and SIGFPE is
#   left to the cases that expect a child to die of one.
# - UndefinedBehaviorSanitizer (built to stop at the first report): stack traces printed.
# A process a sanitizer stops exits with status 99, so that it never passes for one that exited
# with an error (1), such as the projector trial refusing a file.
# Sets python (from PYTHON, default .venv/bin/python), sanitize (the build's list), LD_PRELOAD,
# ASAN_OPTIONS and UBSAN_OPTIONS (to which the scripts add their own) and GGML_NO_BACKTRACE;
# exits 2 when the interpreter's llamacrab-sys is built without sanitizers.
python=${PYTHON:-.venv/bin/python}
cc=${CC:-gcc}
# Read with the ASan runtime preloaded, which an instrumented build needs to load at all.
LD_PRELOAD="$("$cc" -print-file-name=libasan.so) $("$cc" -print-file-name=libstdc++.so)"
export LD_PRELOAD GGML_NO_BACKTRACE=1
export ASAN_OPTIONS="detect_leaks=0:handle_sigfpe=0:exitcode=99"
export UBSAN_OPTIONS="print_stacktrace=1:exitcode=99"
sanitize=$("$python" -c "from llamacrab_sys import build_info; print(build_info().sanitize)")
if [ -z "$sanitize" ]; then
  echo "llamacrab-sys is not built with sanitizers; build it with LLAMACRAB_SANITIZE=address" \
       "(or undefined, or both)" >&2
  exit 2
fi
case ",$sanitize," in
  *,address,*) ;;
  *) unset LD_PRELOAD ;;
esac
