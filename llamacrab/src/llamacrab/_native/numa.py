"""NUMA placement of llama.cpp's CPU threads: one choice for the whole process, as llama-server's
``--numa`` makes it (llama.cpp keeps it in ggml's global state)."""

from __future__ import annotations

import threading

from llamacrab._exceptions import InvalidParameterError, LlamaError
from llamacrab._native.backend import ensure_initialised
from llamacrab._native.call import call, ffi, lib
from llamacrab._native.fork import reset_in_child

STRATEGIES = {
    "distribute": lib.GGML_NUMA_STRATEGY_DISTRIBUTE,  # threads spread over every node
    "isolate": lib.GGML_NUMA_STRATEGY_ISOLATE,  # threads on the node the process started on
    "numactl": lib.GGML_NUMA_STRATEGY_NUMACTL,  # the CPUs numactl (the affinity) gives it
}
_lock = threading.Lock()
reset_in_child(_lock)
_chosen: str | None = None


def init_numa(strategy: str) -> None:
    """Place llama.cpp's CPU threads on NUMA nodes for this process (a machine of several
    sockets): "distribute", "isolate" or "numactl" (see ``STRATEGIES``), as llama-server's
    ``--numa``. Call it before loading models: llama.cpp reads it when it starts threads and
    maps weights. Once per process; asking again for the same is nothing, for another an
    InvalidParameterError. On a machine of one node it changes nothing."""
    global _chosen
    if strategy not in STRATEGIES:
        raise InvalidParameterError(
            f"NUMA strategy must be one of {', '.join(STRATEGIES)}, not {strategy!r}"
        )
    ensure_initialised()
    with _lock:
        if _chosen is not None:
            if _chosen != strategy:
                raise InvalidParameterError(
                    f"NUMA placement is {_chosen!r} for this process; llama.cpp sets it once"
                )
            return
        # llama.cpp asserts (an abort) when no CPU backend is loaded.
        if lib.ggml_backend_dev_by_type(lib.GGML_BACKEND_DEVICE_TYPE_CPU) == ffi.NULL:
            raise LlamaError("no CPU backend is loaded: NUMA placement needs one")
        call("llama_numa_init", STRATEGIES[strategy])
        _chosen = strategy
