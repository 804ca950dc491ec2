"""The devices llama.cpp computes on in this process: is there a GPU to offload layers to?"""

from __future__ import annotations

import logging
import threading

from llamacrab._native.fork import reset_in_child
from llamacrab_sys import build_info, lib

logger = logging.getLogger("llamacrab")

_lock = threading.Lock()
reset_in_child(_lock)
_warned = False


def accelerator_present() -> bool:
    """Whether ggml registered a GPU (discrete or integrated) device."""
    accelerators = (lib.GGML_BACKEND_DEVICE_TYPE_GPU, lib.GGML_BACKEND_DEVICE_TYPE_IGPU)
    return any(
        lib.ggml_backend_dev_type(lib.ggml_backend_dev_get(i)) in accelerators
        for i in range(lib.ggml_backend_dev_count())
    )


def warn_if_no_gpu(n_gpu_layers: int | None, remote: bool) -> None:
    """Say once per process that asked-for GPU layers stay on the CPU (no GPU, no RPC worker)."""
    global _warned
    if n_gpu_layers is None or n_gpu_layers <= 0 or remote or accelerator_present():
        return
    with _lock:
        if _warned:
            return
        _warned = True
    why = "; ".join(f"{name}: {reason}" for name, reason in build_info().missing_backends.items())
    logger.warning(
        "n_gpu_layers=%d has no effect: no GPU device is present (%s); the model runs on the CPU",
        n_gpu_layers, why or f"this llamacrab-sys is a {build_info().backend} build",
    )  # fmt: skip
