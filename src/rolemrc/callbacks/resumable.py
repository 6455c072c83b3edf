"""What makes every run resumable where it stopped, added to every trainer by the builder.

A checkpoint at the end of training: ``ModelCheckpoint`` with ``every_n_train_steps`` saves on
those steps only, so a run of 10 steps checkpointed every 4 ended with step 8's, and resuming
the finished run redid its last steps.

Resuming a run that ``trainer.max_steps`` stopped mid-epoch continues that epoch.

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
from lightning.pytorch.callbacks import ModelCheckpoint

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


class CheckpointAtEnd(L.Callback):
    """Saves ``last.ckpt`` of each ``save_last`` ModelCheckpoint when training ends at a step no
    checkpoint holds yet (every rank calls it: the save is collective under FSDP)."""

    def __init__(self) -> None:
        self._saved_step = -1

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._saved_step = trainer.global_step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == self._saved_step or trainer.global_step == 0:
            return
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.save_last and callback.dirpath:
                path = f"{callback.dirpath}/{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
                log.info("end of training at step %d: checkpoint %s", trainer.global_step, path)
                trainer.save_checkpoint(path, weights_only=False)
                callback.last_model_path = path
