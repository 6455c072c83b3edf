"""Checkpoint files that never look valid when half-written: single ``.ckpt`` files and
sharded (DCP) folders are written beside their final name and swapped in complete
(:func:`rolemrc.fileio.swap_in`); a temporary file a killed save left in the folder
(``.last.ckpt.tmp<pid>``, ``.hpc_ckpt_<n>.ckpt.tmp<pid>``: up to a whole checkpoint each) is
deleted at the next save there. A full disk (or a read-only folder) is a
:class:`~rolemrc.errors.StorageError` naming the checkpoint and what to do. Reading one back
(``ckpt_path=``) that turns out damaged is a :class:`~rolemrc.errors.CheckpointError` naming it (:func:`rolemrc.checkpointing.verify.reading`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy

from rolemrc.checkpointing.verify import reading
from rolemrc.errors import StorageError
from rolemrc.fileio import atomic_open, partial_path, remove, remove_stale_temps, storage_error, swap_in

log = logging.getLogger(__name__)

_FIX = "move the run folder to a disk with room"  # the recipe adds the command that continues (run.train.fit)


def _storage_fault(err: BaseException, path: Any, what: str) -> StorageError | None:
    """A failed save as a one-line :class:`~rolemrc.errors.StorageError` when a storage fault (a
    full disk, a read-only folder) is behind it: ``err`` itself, its cause (``torch.save`` wraps
    a failed write in a RuntimeError) or a distributed save's first failing rank's; else None."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop(0)
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        if isinstance(e, OSError):
            converted = storage_error(e, path, what, _FIX)
            if isinstance(converted, StorageError):
                return converted
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    return None


class AtomicCheckpointIO(TorchCheckpointIO):
    """Single-file checkpoints written beside their name, fsynced, then renamed over it."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        # any checkpoint's of this folder: a killed hpc_ckpt_<n> save is followed by hpc_ckpt_<n+1>
        for stale in remove_stale_temps(Path(path).parent, r".+\.ckpt"):
            log.info("removed %s, left by a killed checkpoint save", stale)
        try:
            with atomic_open(path, "wb") as fh:
                torch.save(checkpoint, fh)
        except (OSError, RuntimeError) as err:
            raise _storage_fault(err, path, "saving the checkpoint") or err

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
        try:
            super().save_checkpoint(checkpoint, tmp, storage_options)
        except Exception as err:
            raise _storage_fault(err, final, "saving the sharded checkpoint") or err
        self.barrier("checkpoint-written")
        if self.is_global_zero:
            swap_in(tmp, final)  # a crash leaves the old one, or <final>.old: find_checkpoint's fallback
        self.barrier("checkpoint-renamed")

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        with reading(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, *args, **kwargs)
