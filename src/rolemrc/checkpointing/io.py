"""Checkpoint files that never look valid when half-written: single ``.ckpt`` files and
sharded (DCP) folders are written beside their final name and swapped in complete."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy

from rolemrc.fileio import atomic_open


def _swap_in(tmp: Path, final: Path) -> None:
    """Replace ``final`` by ``tmp``; a crash leaves either the old or the new one (or
    ``<final>.old``, which :func:`find_checkpoint` falls back to), never a mix."""
    if final.is_dir():
        old = final.with_name(final.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Single-file checkpoints written beside their name, fsynced, then renamed over it."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        with atomic_open(path, "wb") as fh:
            torch.save(checkpoint, fh)


class AtomicModelParallelStrategy(ModelParallelStrategy):
    """FSDP2 strategy whose distributed (DCP) checkpoints are written to a ``.partial``
    folder by all ranks and renamed by rank 0 once every shard is on disk."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        final = Path(filepath)
        tmp = final.with_name(final.name + ".partial")
        if self.is_global_zero and tmp.exists():
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        self.barrier("checkpoint-start")
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier("checkpoint-written")
        if self.is_global_zero:
            _swap_in(tmp, final)
        self.barrier("checkpoint-renamed")
