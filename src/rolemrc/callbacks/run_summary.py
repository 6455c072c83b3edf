"""What every training run ends with, added to every trainer by the builder.

A final validation: a run that ``trainer.max_steps`` stops mid-epoch would end without one
(Lightning validates at epoch ends and every ``val_check_interval``), so its last ``val/*``
figures would be those of an earlier step, or none. At the step ``max_steps`` stops on, this
asks Lightning to stop there (``trainer.should_stop``), which makes it run the validation loop
before leaving (when there is validation data); a step that validates anyway validates once.

The figures of the end-of-run summary (:func:`rolemrc.run.train.fit` prints them and writes
``<run>/run_summary.json``): optimizer steps, epochs, the last ``train/loss`` and ``val/loss``
(an objective without a ``val/loss``, GRPO: its ``val/*`` figures, the last step's ``train/reward``
and the module's ``summary_notes``, saying what each reward figure is the mean of), and input tokens per second of training (validation time left out, all ranks counted). The
figures so far go into every checkpoint (the callback's ``state_dict``), so a resumed run's
summary counts the whole run, and a run resumed at its end (killed during its final validation
or export: :func:`rolemrc.run.train.fit` completes them) still has its last losses.
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning as L
import torch

from rolemrc.callbacks.throughput import ValidationPause, batch_counts


class RunSummary(ValidationPause):
    """See the module. ``figures`` holds the summary after training (every rank)."""

    def __init__(self) -> None:
        self.figures: dict[str, Any] = {}
        self._tokens: torch.Tensor | None = None
        self._t0: float | None = None
        self._restored: dict[str, Any] = {}  # the figures of the processes before this one

    def state_dict(self) -> dict[str, Any]:
        tokens = 0.0
        trainer = self._trainer
        if trainer is not None and self._tokens is not None:
            # every rank builds the checkpoint's contents (Lightning), so the sum is collective
            mine = self._tokens
            tokens = float(trainer.strategy.reduce(mine, reduce_op="sum") if trainer.world_size > 1 else mine)
        seconds = time.perf_counter() - self._t0 - self._paused if self._t0 is not None else 0.0
        return {"train_loss": self._last("train/loss"), "val_loss": self._last("val/loss"),
                "train_reward": self._last("train/reward"),
                "tokens": self._restored.get("tokens", 0.0) + tokens,
                "seconds": self._restored.get("seconds", 0.0) + seconds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._restored = dict(state)

    def _last(self, key: str) -> float | None:
        value = self._trainer.callback_metrics.get(key) if self._trainer is not None else None
        return float(value) if value is not None else self._restored.get(key.replace("/", "_"))

    _trainer: L.Trainer | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._tokens, self._t0, self._paused, self._pause_start = None, time.perf_counter(), 0.0, None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        real = batch_counts(batch)[0]
        self._tokens = real if self._tokens is None else self._tokens + real
        if 0 < trainer.max_steps <= trainer.global_step:  # the last step: validate before stopping
            trainer.should_stop = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.figures = self.summarise(trainer, pl_module)

    def summarise(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        """The figures (see the module); every rank calls it (a collective sum of the tokens)."""
        seconds = (time.perf_counter() - (self._t0 or time.perf_counter()) - self._paused
                   + self._restored.get("seconds", 0.0))
        tokens = self._tokens if self._tokens is not None else torch.zeros((), dtype=torch.float64,
                                                                            device=pl_module.device)
        if trainer.world_size > 1:  # every rank reaches on_train_end
            tokens = trainer.strategy.reduce(tokens, reduce_op="sum")
        tokens = float(tokens) + self._restored.get("tokens", 0.0)
        counted = self._tokens is not None or bool(self._restored.get("tokens"))
        per_epoch = trainer.num_training_batches
        micro = trainer.global_step * trainer.accumulate_grad_batches
        return {
            "steps": int(trainer.global_step),
            "epochs": round(micro / per_epoch, 3) if per_epoch and not math.isinf(per_epoch) else None,
            "train_loss": self._last("train/loss"),
            "val_loss": self._last("val/loss"),
            # what the objective validates when it has no val/loss (GRPO: val/reward): val/<name> -> value
            "val_metrics": {k: float(v) for k, v in sorted(trainer.callback_metrics.items())
                            if k.startswith("val/") and k != "val/loss" and getattr(v, "numel", lambda: 1)() == 1},
            # GRPO: the last step's train/reward beside val/reward, and what each is the mean of
            "train_reward": self._last("train/reward"),
            "notes": dict(pl_module.summary_notes),
            "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 and counted else None,
        }
