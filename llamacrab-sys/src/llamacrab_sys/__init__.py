"""Raw cffi bindings to the llama.cpp build this package ships.

UNSAFE: ``lib`` calls straight into C. The caller owns every invariant: pointer lifetimes, teardown
order, thread safety, and inputs that make llama.cpp abort the process. Applications should use the
``llamacrab`` package, which wraps all of this in safe handles.

- ``ffi`` / ``lib``: the cffi API-mode module generated from the pinned headers. Every function that
  may throw a C++ exception also exists as ``lib.safe_<name>(..., err)`` taking a
  ``llamacrab_error *`` that receives the exception instead of letting it cross into Python.
- ``build_info()``: what was built and how; ``python -m llamacrab_sys`` prints it.
- Log, progress and abort callbacks from Python: see ``set_log_handler`` and ``CallbackHandle``;
  ``raise_callback_interrupt()`` after a call raises a Ctrl-C that landed inside one.
- ``python_sampler``: a ``struct llama_sampler`` implemented in Python, for a native chain.
"""

# First: on Windows it makes the llama.cpp DLLs findable before anything loads _native.
from llamacrab_sys import _library_path  # noqa: F401

# isort: split
from llamacrab_sys import _backends
from llamacrab_sys._build_info import BuildInfo, build_info
from llamacrab_sys._callbacks import (
    CallbackHandle,
    abort_callback,
    progress_callback,
    raise_callback_interrupt,
    set_log_handler,
)
from llamacrab_sys._native import ffi, lib
from llamacrab_sys._python_sampler import SamplerCallbacks, python_sampler

__version__ = "0.1.0"

if build_info().package_version != __version__:
    raise ImportError(
        f"llamacrab_sys {__version__} found a compiled module built for "
        f"{build_info().package_version}: reinstall llamacrab-sys"
    )
# A portable build links no CPU backend: register the best variant for this machine (and any
# other dlopen-only backend) from the module directory, once per process; a GPU backend this
# machine cannot use is recorded (build_info().missing_backends) and logged once.
_backends.load(build_info().backend, build_info().module_dir, bool(build_info().backend_modules))

__all__ = [
    "BuildInfo",
    "CallbackHandle",
    "SamplerCallbacks",
    "__version__",
    "abort_callback",
    "build_info",
    "ffi",
    "lib",
    "progress_callback",
    "python_sampler",
    "raise_callback_interrupt",
    "set_log_handler",
]
