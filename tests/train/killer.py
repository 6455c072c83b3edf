"""A callback tests add through Hydra to SIGKILL a real training process at a known point:
``+callbacks.kill._target_=tests.train.killer.KillAt +callbacks.kill.step=N
+callbacks.kill.marker=<file>`` kills the process at the start of the batch after N optimizer
steps (their rows logged, the checkpoint of step N not necessarily written) unless ``marker``
exists, which it creates first: the same command line, run again, is not killed."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import lightning as L


class KillAt(L.Callback):
    def __init__(self, step: int, marker: str) -> None:
        self.step = step
        self.marker = Path(marker)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step == self.step and not self.marker.exists():
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            self.marker.write_text(f"killed at step {self.step}\n")
            os.kill(os.getpid(), signal.SIGKILL)
