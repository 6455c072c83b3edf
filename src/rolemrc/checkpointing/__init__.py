"""Checkpoint storage: atomic writes (:mod:`.io`), finding a run's checkpoints (:mod:`.find`)
and reading weights and other entries out of them (:mod:`.state`); Lightning is imported only by
:mod:`.io` (training's atomic saves), so reading a checkpoint (evaluate.py, export.py,
``ckpt_path=last`` before Hydra starts) does not import it. Exporting them to HF format is
:mod:`rolemrc.models.export`; turning ``model.path`` into something loadable is
:mod:`rolemrc.models.source`."""

from rolemrc.checkpointing.find import checkpoint_run_dir, find_checkpoint, is_training_checkpoint
from rolemrc.checkpointing.state import full_state_dict, read_checkpoint_entries, read_model_state

__all__ = ["checkpoint_run_dir", "find_checkpoint", "full_state_dict", "is_training_checkpoint",
           "read_checkpoint_entries", "read_model_state"]
