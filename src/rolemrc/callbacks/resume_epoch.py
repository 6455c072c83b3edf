"""Resuming a run that ``trainer.max_steps`` stopped mid-epoch continues that epoch.

Lightning saves the checkpoint at the end of such a run as if the epoch had finished (its epoch
counter already advanced), so ``ckpt_path=last`` with a larger ``trainer.max_steps`` would start
the next epoch, silently skipping the rest of this one's data, or, with ``max_epochs=1``, stop
at once. The data loader finds its place from the optimizer-step count
(:meth:`rolemrc.data.datamodule.ChatDataModule.train_dataloader`), so only the epoch counter
needs to be set back.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L

log = logging.getLogger(__name__)


def reopen_epoch_stopped_by_max_steps(checkpoint: dict[str, Any]) -> bool:
    """Set a checkpoint's fit-loop state back into the epoch that ``max_steps`` cut short (its
    last batch never reached); True when it did. Checkpoints saved mid-epoch or at a real epoch
    end are left as they are."""
    loop = checkpoint.get("loops", {}).get("fit_loop")
    if not loop:
        return False
    epochs, batches = loop["epoch_progress"], loop["epoch_loop.batch_progress"]
    done = epochs["current"]["completed"]
    if batches.get("is_last_batch", True) or done < 1 or done != epochs["current"]["ready"]:
        return False  # the epoch ran to its end, or the checkpoint was saved inside it
    if batches["current"]["completed"] < 1:
        return False
    for progress in (epochs["current"], epochs["total"]):
        progress["completed"] -= 1
        progress["processed"] = min(progress["processed"], progress["completed"])
    checkpoint["epoch"] = epochs["current"]["completed"]
    return True


class ContinueEpochStoppedByMaxSteps(L.Callback):
    """Applies :func:`reopen_epoch_stopped_by_max_steps` to the checkpoint a run resumes from
    (callbacks see it before Lightning restores its loops)."""

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if reopen_epoch_stopped_by_max_steps(checkpoint):
            log.info("resuming at step %d inside epoch %d, which trainer.max_steps had stopped",
                     checkpoint.get("global_step", -1), checkpoint["epoch"])
