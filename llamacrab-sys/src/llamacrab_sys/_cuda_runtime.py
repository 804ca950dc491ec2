"""CUDA's runtime libraries from NVIDIA's wheels, for a CUDA wheel that does not bundle them.

A CUDA llamacrab-sys wheel depends on ``nvidia-cuda-runtime`` and ``nvidia-cublas`` (their
``-cu12`` packages for CUDA 12) instead of carrying libcudart and cuBLAS (about 0.6 GiB, under
NVIDIA's own license). pip installs those under ``site-packages/nvidia/``, where the dynamic
loader does not look: loaded here by path first, they satisfy ggml's CUDA module, which asks for
them by SONAME (``libcudart.so.13``, ...). Nothing is loaded where no such wheel is installed:
a system CUDA install on the loader's path serves then. The driver (``libcuda.so.1``) always
comes from the system.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import re
from pathlib import Path

logger = logging.getLogger("llamacrab_sys")

# In the order they need each other: cuBLAS needs cuBLASLt, both need the runtime.
LIBRARIES = ("libcudart.so", "libcublasLt.so", "libcublas.so")


def wheel_library_dirs() -> list[Path]:
    """The ``lib`` directories of the installed ``nvidia-*`` wheels (``nvidia/cu13/lib`` for
    CUDA 13, ``nvidia/cuda_runtime/lib`` and ``nvidia/cublas/lib`` for CUDA 12)."""
    spec = importlib.util.find_spec("nvidia")  # a namespace package, spread over site dirs
    roots = [] if spec is None else list(spec.submodule_search_locations or [])
    return sorted({path.parent for root in roots for path in Path(root).glob("*/lib/libcu*.so.*")})


def preload() -> list[Path]:
    """Load the runtime libraries found in NVIDIA's wheels; the paths loaded. Every CUDA major
    version found is loaded: the module binds the one whose SONAME it names."""
    loaded = []
    directories = wheel_library_dirs()
    for name in LIBRARIES:
        soname = re.compile(re.escape(name) + r"\.\d+")  # libcudart.so.13, not .so.13.0.96
        for directory in directories:
            for path in sorted(directory.iterdir()):
                if not soname.fullmatch(path.name):
                    continue
                try:
                    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
                except OSError as error:  # another architecture, a broken install: ggml says why
                    logger.debug("could not preload %s: %s", path, error)
                else:
                    loaded.append(path)
    return loaded
