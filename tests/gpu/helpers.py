"""What the CUDA tests read off a run: the gradient norm and loss each optimizer step saw."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch


class StepProbe(L.Callback):
    """``+callbacks.probe._target_=tests.gpu.helpers.StepProbe +callbacks.probe.path=<file>``:
    appends one JSON line per optimizer step: the global gradient norm before the step (sharded
    gradients gathered) and the step's logged ``train/loss``."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.norm: float | None = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: ANN001
        total = torch.zeros((), dtype=torch.float64)
        for p in pl_module.parameters():
            if p.grad is None:
                continue
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            total += g.detach().double().pow(2).sum().cpu()
        self.norm = float(total.sqrt())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        loss = trainer.callback_metrics.get("train/loss")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as fh:
            fh.write(json.dumps({"step": trainer.global_step, "grad_norm": self.norm,
                                 "loss": None if loss is None else float(loss),
                                 "device": str(pl_module.device)}) + "\n")


def probe(path: Path) -> list[str]:
    return ["+callbacks.probe._target_=tests.gpu.helpers.StepProbe", f"+callbacks.probe.path={path}"]


def steps(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
