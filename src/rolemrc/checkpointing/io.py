"""Checkpoint files that never look valid when half-written: single ``.ckpt`` files and
sharded (DCP) folders are written beside their final name and swapped in complete
(:func:`rolemrc.fileio.swap_in`). Reading one back (``ckpt_path=``) that turns out damaged is a
:class:`~rolemrc.errors.CheckpointError` naming it (:func:`rolemrc.checkpointing.verify.reading`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy

from rolemrc.checkpointing.verify import reading
from rolemrc.fileio import atomic_open, partial_path, remove, swap_in


class AtomicCheckpointIO(TorchCheckpointIO):
    """Single-file checkpoints written beside their name, fsynced, then renamed over it."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        with atomic_open(path, "wb") as fh:
            torch.save(checkpoint, fh)

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        with reading(path):
            return super().load_checkpoint(path, *args, **kwargs)


class AtomicModelParallelStrategy(ModelParallelStrategy):
    """FSDP2 strategy whose distributed (DCP) checkpoints are written to a ``.partial``
    folder by all ranks and renamed by rank 0 once every shard is on disk."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        final = Path(filepath)
        tmp = partial_path(final)
        if self.is_global_zero:
            remove(tmp)
        self.barrier("checkpoint-start")
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier("checkpoint-written")
        if self.is_global_zero:
            swap_in(tmp, final)  # a crash leaves the old one, or <final>.old: find_checkpoint's fallback
        self.barrier("checkpoint-renamed")

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        with reading(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, *args, **kwargs)
