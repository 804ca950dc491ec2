"""A GPU build on a machine without its GPU imports, says which backend is missing and why (once,
as a logging warning and in build_info()), runs on the CPU, and says once that n_gpu_layers has
no effect. Simulated with ggml's real module loader (GGML_BACKEND_DL) and stand-in CUDA modules
compiled here: one needing a driver library that is not installed, one that finds no device,
one whose runtime library comes from a stand-in of NVIDIA's wheel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from build_tools.source import resolve_source

REPO = Path(__file__).resolve().parents[2]
CHILD = REPO / "tests" / "missing_backend_child.py"
# Not libcuda.so.1: a machine with a real driver must fail the load too.
DRIVER = "libllamacrab-test-driver.so.1"

NO_DEVICE_MODULE = """
#include "ggml-backend-impl.h"
static const char *name(ggml_backend_reg_t reg) { (void) reg; return "CUDA"; }
static size_t count(ggml_backend_reg_t reg) { (void) reg; return 0; }
static ggml_backend_dev_t device(ggml_backend_reg_t reg, size_t i) {
    (void) reg; (void) i; return 0;
}
static struct ggml_backend_reg reg = {
    .api_version = GGML_BACKEND_API_VERSION,
    .iface = {.get_name = name, .get_device_count = count, .get_device = device},
};
__attribute__((visibility("default"))) ggml_backend_reg_t ggml_backend_init(void) { return &reg; }
"""


def compile_module(out: Path, source: str, *flags: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    c_file = out.with_suffix(".c")
    c_file.write_text(source)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(out), str(c_file), *flags], check=True)
    c_file.unlink()


def run_child(module_dir: Path, model: Path, site: Path | None = None) -> dict[str, Any]:
    """The child's result; ``site``: a directory on its import path (NVIDIA's wheels)."""
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    child = subprocess.run([sys.executable, str(CHILD), str(module_dir), str(model)],
                           capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def assert_runs_on_cpu_and_warns_once(result: dict[str, Any], reason: str) -> None:
    assert list(result["missing"]) == ["cuda"] and reason in result["missing"]["cuda"]
    ours = [m for m in result["warnings"] if m.startswith("llamacrab_sys: ")]
    assert len(ours) == 1 and reason in ours[0] and "running on the CPU" in ours[0]
    layers = [m for m in result["warnings"] if "n_gpu_layers=99 has no effect" in m]
    assert len(layers) == 1, result["warnings"]  # two models, one warning
    assert "cuda: " + result["missing"]["cuda"] in layers[0]
    assert result["tokens"][0] == result["tokens"][1] and len(result["tokens"][0]) == 4


def test_a_module_whose_driver_is_missing(tmp_path: Path, tiny_model_path: Path) -> None:
    driver = tmp_path / "driver" / DRIVER
    compile_module(driver, "int llamacrab_test_driver;\n", f"-Wl,-soname,{DRIVER}")
    # The module needs the driver library; at run time it is nowhere the loader looks.
    compile_module(tmp_path / "modules" / "libggml-cuda.so", "int unused;\n",
                   "-Wl,--no-as-needed", str(driver))  # fmt: skip
    result = run_child(tmp_path / "modules", tiny_model_path)
    assert_runs_on_cpu_and_warns_once(result, "the CUDA backend module failed to load")
    assert f"{DRIVER}: cannot open shared object file" in result["missing"]["cuda"]


def test_a_module_that_finds_no_device(tmp_path: Path, tiny_model_path: Path) -> None:
    ggml = resolve_source().path / "ggml"
    compile_module(tmp_path / "modules" / "libggml-cuda.so", NO_DEVICE_MODULE,
                   f"-I{ggml / 'include'}", f"-I{ggml / 'src'}")  # fmt: skip
    result = run_child(tmp_path / "modules", tiny_model_path)
    assert_runs_on_cpu_and_warns_once(result, "the CUDA backend found no device")


def test_the_cuda_runtime_comes_from_nvidias_wheels(tmp_path: Path, tiny_model_path: Path) -> None:
    """A CUDA wheel does not bundle libcudart: it depends on nvidia-cuda-runtime, which pip puts
    in site-packages/nvidia/cu13/lib. Without it the module cannot load; with it on the import
    path, llamacrab_sys loads it first and the module loads (and here finds no device). The
    stand-in is major version 99: no system CUDA install has that one."""
    runtime = tmp_path / "site" / "nvidia" / "cu13" / "lib" / "libcudart.so.99"
    compile_module(runtime, "int cudart_stand_in;\n", "-Wl,-soname,libcudart.so.99")
    ggml = resolve_source().path / "ggml"
    compile_module(tmp_path / "modules" / "libggml-cuda.so", NO_DEVICE_MODULE,
                   f"-I{ggml / 'include'}", f"-I{ggml / 'src'}",
                   "-Wl,--no-as-needed", str(runtime))  # fmt: skip
    without = run_child(tmp_path / "modules", tiny_model_path)
    assert "libcudart.so.99: cannot open shared object file" in without["missing"]["cuda"]
    result = run_child(tmp_path / "modules", tiny_model_path, site=tmp_path / "site")
    assert_runs_on_cpu_and_warns_once(result, "the CUDA backend found no device")


def test_module_file_names_follow_ggml(monkeypatch: Any) -> None:
    from llamacrab_sys._backends import module_file

    assert module_file("cuda") == "libggml-cuda.so"
    monkeypatch.setattr(sys, "platform", "darwin")  # ggml names macOS modules .so too
    assert module_file("metal") == "libggml-metal.so"
    monkeypatch.setattr(sys, "platform", "win32")
    assert module_file("cuda") == "ggml-cuda.dll"
