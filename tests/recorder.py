"""A callback tests add through Hydra (``+callbacks.record._target_=tests.recorder.Recorder``)
to see what a real run did: per step the loss and the sample indices of the batch, and at
the start how the parameters are laid out (sharded or not)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L


class Recorder(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def _write(self, trainer: L.Trainer, record: dict[str, Any]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        with (self.path / f"rank{trainer.global_rank}.jsonl").open("a") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch.distributed.tensor import DTensor

        local = full = 0
        for p in pl_module.model.parameters():
            full += p.numel()
            local += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
        self._write(trainer, {"event": "start", "local_params": local, "full_params": full,
                              "world_size": trainer.world_size, "global_step": trainer.global_step})

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._write(trainer, {"event": "step", "step": trainer.global_step, "epoch": trainer.current_epoch,
                              "loss": float(outputs["loss"]), "index": batch["index"].tolist()})


def read(path: str | Path, rank: int = 0) -> list[dict[str, Any]]:
    file = Path(path) / f"rank{rank}.jsonl"
    return [json.loads(line) for line in file.read_text().splitlines()] if file.exists() else []
