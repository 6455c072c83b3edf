"""A callback tests add through Hydra to signal a real training process at a known point:
``+callbacks.kill._target_=tests.train.killer.KillAt +callbacks.kill.step=N
+callbacks.kill.marker=<file>`` kills the process (SIGKILL) at the start of the batch after N
optimizer steps (their rows logged, the checkpoint of step N not necessarily written) unless
``marker`` exists, which it creates first: the same command line, run again, is not killed.
``+callbacks.kill.at=validation`` signals at the start of the validation after step N instead,
``at=export`` once the end-of-run export has written into ``export.partial/``;
``+callbacks.kill.signal=SIGINT`` sends that signal (Ctrl-C) instead of SIGKILL;
``+callbacks.kill.group=true`` sends it, from global rank 0 only, to the whole process group (what
Ctrl-C in a terminal does: every rank of a multi-process run gets it; start the run in a session of
its own)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import lightning as L


class KillAt(L.Callback):
    def __init__(self, step: int, marker: str, at: str = "train_batch", signal: str = "SIGKILL",
                 group: bool = False) -> None:
        self.step = step
        self.group = group
        self.rank = 0
        self.marker = Path(marker)
        self.at = at
        self.signum = signal

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.rank = trainer.global_rank

    def _kill(self) -> None:
        if self.marker.exists() or (self.group and self.rank != 0):
            return
        self.marker.parent.mkdir(parents=True, exist_ok=True)
        self.marker.write_text(f"{self.signum} at {self.at} of step {self.step}\n")
        if self.group:
            os.killpg(os.getpgid(0), getattr(signal, self.signum))
        else:
            os.kill(os.getpid(), getattr(signal, self.signum))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.at == "train_batch" and trainer.global_step == self.step:
            self._kill()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.at == "validation" and not trainer.sanity_checking and trainer.global_step == self.step:
            self._kill()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.at == "export" and trainer.global_step == self.step:
            import rolemrc.models.export as export

            original = export.export_pretrained

            def killed_midway(model: Any, tokenizer: Any, out_dir: Any, *args: Any, **kwargs: Any) -> Any:
                partial = Path(f"{out_dir}.partial")
                partial.mkdir(parents=True, exist_ok=True)
                (partial / "config.json").write_text("{}")  # some of the export written
                self._kill()
                return original(model, tokenizer, out_dir, *args, **kwargs)

            export.export_pretrained = killed_midway
