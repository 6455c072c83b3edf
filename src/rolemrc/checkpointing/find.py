"""Finding checkpoints: a run's newest complete one (with the ``.old`` fallback left by a
crash mid-swap), what is a training checkpoint, and the run folder it belongs to."""

from __future__ import annotations

import re
from pathlib import Path

from rolemrc.errors import InputNotFound


def find_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run: ``checkpoints/last.ckpt`` (or its ``.old``
    twin after a crash mid-swap) or a SLURM preemption checkpoint ``hpc_ckpt_<n>.ckpt``."""
    run_dir = Path(run_dir)
    candidates = [run_dir / "checkpoints" / "last.ckpt", *run_dir.glob("hpc_ckpt_*.ckpt")]
    if not candidates[0].exists():
        candidates[0] = run_dir / "checkpoints" / "last.ckpt.old"
    existing = [c for c in candidates if c.exists()]
    return max(existing, key=lambda c: c.stat().st_mtime) if existing else None


def is_training_checkpoint(path: str | Path) -> bool:
    """A Lightning checkpoint this framework writes: a ``.ckpt`` file or a sharded (DCP) folder."""
    path = Path(path)
    return (path.is_file() and path.suffix == ".ckpt") or (path.is_dir() and (path / ".metadata").is_file())


def checkpoint_run_dir(checkpoint: str | Path) -> Path:
    """The run folder (holding ``.hydra/config.yaml``) of a checkpoint: ``<run>/checkpoints/last.ckpt``
    or a SLURM preemption checkpoint ``<run>/hpc_ckpt_<n>.ckpt``."""
    checkpoint = Path(checkpoint).resolve()
    for folder in (checkpoint.parent, checkpoint.parent.parent):
        if (folder / ".hydra" / "config.yaml").is_file():
            return folder
    raise InputNotFound(f"{checkpoint}: no .hydra/config.yaml in {checkpoint.parent} or its parent; the run's "
                            "config rebuilds the model (export.py --run-dir <run folder> names it)")


def next_hpc_checkpoint(run_dir: str | Path) -> Path:
    """Where a SLURM preemption checkpoint goes: ``<run_dir>/hpc_ckpt_<n+1>.ckpt`` after the highest
    ``n`` there (1 in an empty folder), the name Lightning resumes a requeued job from."""
    numbers = [int(m.group(1)) for p in Path(run_dir).glob("hpc_ckpt_*.ckpt")
               if (m := re.fullmatch(r"hpc_ckpt_(\d+)\.ckpt", p.name))]
    return Path(run_dir) / f"hpc_ckpt_{max(numbers, default=0) + 1}.ckpt"
