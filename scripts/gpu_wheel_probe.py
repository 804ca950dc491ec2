"""Check an installed CUDA llamacrab-sys wheel on a GPU: it is the one under test, ggml's CUDA
backend found the device, and a model with every layer on it generates.

Usage: python scripts/gpu_wheel_probe.py SITE MODEL.gguf
(SITE: the --target folder the wheel and llamacrab were installed into, alone on PYTHONPATH;
scripts/gpu_wheel_check.sh runs it.) Exits non-zero on the first check that fails.
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
import sys
import time
from pathlib import Path

import llamacrab
import llamacrab_sys
from llamacrab import Llama
from llamacrab._native import devices
from llamacrab_sys import build_info, ffi, lib

OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")


class LogLines(logging.Handler):
    """llama.cpp's log lines, which llamacrab hands to the ``llamacrab`` logger."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def show_build(site: Path) -> None:
    info = build_info()
    here = Path(llamacrab_sys.__file__).resolve()
    print(f"llamacrab_sys {llamacrab_sys.__version__} from {here}")
    print(f"llamacrab {llamacrab.__version__} from {Path(llamacrab.__file__).resolve()}")
    assert here.is_relative_to(site), "llamacrab_sys is not the one installed under test"
    patches = len(info.llama_cpp_patches)
    print(f"backend {info.backend}, portable {info.portable}, {patches} llama.cpp patches")
    print("CUDA options:", [o for o in info.cmake_options if "CUDA" in o])
    print("backend modules:", [p.name for p in info.backend_modules])
    print("system info:", info.system_info)
    for package in ("nvidia-cuda-runtime", "nvidia-cublas"):  # the wheel's dependencies
        try:
            print(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            print(f"{package}: not installed")
    assert info.backend == "cuda" and info.portable, "not a portable CUDA build"
    assert not info.missing_backends, f"missing backends: {info.missing_backends}"


def show_devices() -> None:
    for i in range(lib.ggml_backend_dev_count()):
        device = lib.ggml_backend_dev_get(i)
        free, total = ffi.new("size_t *"), ffi.new("size_t *")
        lib.ggml_backend_dev_memory(device, free, total)
        name = ffi.string(lib.ggml_backend_dev_name(device)).decode()
        description = ffi.string(lib.ggml_backend_dev_description(device)).decode()
        print(f"device {i}: {name} ({description}), type {lib.ggml_backend_dev_type(device)}, "
              f"{free[0] >> 20} of {total[0] >> 20} MiB free")  # fmt: skip
    assert devices.accelerator_present(), "ggml registered no GPU device"


def generate(model: str, log: LogLines, **options: object) -> str:
    log.lines.clear()
    began = time.perf_counter()
    with Llama(model, n_ctx=256, n_threads=4, seed=1, **options) as llm:  # type: ignore[arg-type]
        loaded = time.perf_counter() - began
        began = time.perf_counter()
        text = llm.create_completion("the cat sat on", max_tokens=32, temperature=0).text
        greedy = time.perf_counter() - began
        sampled = llm.create_completion("the cat", max_tokens=16, temperature=0.8).text
    offloaded = [m.group(0) for line in log.lines if (m := OFFLOADED.search(line))]
    print(f"{options}: load {loaded:.2f} s, 32 greedy tokens {greedy:.3f} s, {offloaded}")
    print(f"  greedy {text!r}; sampled {sampled!r}")
    if options.get("n_gpu_layers") == -1:
        counts = [OFFLOADED.search(line) for line in offloaded]
        every = counts and all(m and m[1] == m[2] != "0" for m in counts)
        assert every, "not every layer on the GPU"
    return text


def show_loaded(site: Path) -> None:
    """Where each library came from: ours from the wheel, CUDA's from NVIDIA's wheels and the
    driver."""
    with open("/proc/self/maps", encoding="utf-8") as maps:
        loaded = sorted({line.split()[-1] for line in maps if ".so" in line})
    ours = [p for p in loaded if "llamacrab" in p or "ggml" in p]
    cuda = [p for p in loaded if re.search(r"/lib(cuda|cudart|cublas|cublasLt)\.so", p)]
    print("ours:", *ours, sep="\n  ")
    print("CUDA:", *cuda, sep="\n  ")
    assert all(Path(p).resolve().is_relative_to(site) for p in ours), "a library from elsewhere"
    assert any("ggml-cuda" in p for p in ours), "ggml's CUDA module is not loaded"


def main() -> None:
    site, model = Path(sys.argv[1]).resolve(), sys.argv[2]
    log = LogLines()
    logger = logging.getLogger("llamacrab")
    logger.addHandler(log)
    logger.setLevel(logging.INFO)
    show_build(site)
    show_devices()
    on_gpu = generate(model, log, n_gpu_layers=-1)
    on_cpu = generate(model, log, n_gpu_layers=0, graph_sampling="off")
    print("greedy text the same on the GPU and the CPU:", on_gpu == on_cpu)
    show_loaded(site)
    print("OK")


if __name__ == "__main__":
    main()
