"""n_gpu_layers without a GPU device: the layers stay on the CPU and llamacrab says so once.
(The missing GPU backend itself is simulated in tests/sys/test_missing_backend.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from llamacrab import Llama
from llamacrab._native import devices


@pytest.mark.parametrize(("layers", "warned"), [(0, False), (-1, False), (5, True)])
def test_the_layer_warning_needs_layers_asked_for(
    layers: int, warned: bool, tiny_model_path: Path, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    if warned and devices.accelerator_present():
        pytest.skip("this build has a GPU device: the layers do take effect")
    monkeypatch.setattr(devices, "_warned", False)  # once per process: this test's process too
    with caplog.at_level("WARNING", logger="llamacrab"), Llama(
        tiny_model_path, n_ctx=64, n_threads=2, n_gpu_layers=layers
    ):  # fmt: skip
        pass
    said = [r for r in caplog.records if "has no effect" in r.getMessage()]
    assert len(said) == warned
