"""CUDA tests (``pytest -m gpu``; ``make gpu-check`` runs them on the device): every test under
tests/gpu is marked ``gpu`` and skipped, saying why, where torch sees no CUDA device.

``ROLEMRC_GPU_TESTS_DEVICE=cpu`` runs the same checks on the CPU instead (gloo, bf16 autocast on
the CPU): how their logic is checked on a machine without a GPU. It proves nothing about CUDA."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

DEVICE = os.environ.get("ROLEMRC_GPU_TESTS_DEVICE", "cuda")
if DEVICE not in ("cuda", "cpu"):
    raise pytest.UsageError(f"ROLEMRC_GPU_TESTS_DEVICE={DEVICE!r}: expected cuda or cpu")
ACCELERATOR = "gpu" if DEVICE == "cuda" else "cpu"
HERE = Path(__file__).resolve().parent
# The device every run of these tests trains on; fp32 matmuls in full precision (no TF32), so that
# the fp32 side of a comparison is the exact one.
ON_DEVICE = [f"trainer.accelerator={ACCELERATOR}", "trainer.devices=1", "runtime.matmul_precision=highest"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = None
    if DEVICE == "cuda" and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="CUDA test: torch sees no CUDA device here "
                                       "(ROLEMRC_GPU_TESTS_DEVICE=cpu runs its logic on the CPU)")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)
