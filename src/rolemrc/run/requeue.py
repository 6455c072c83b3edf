"""SLURM preemption: a checkpoint at a step boundary, then ``scontrol requeue`` (the requeued job
resumes from it: Lightning picks the newest ``hpc_ckpt_*`` of the run folder)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from types import FrameType
from typing import Any

import lightning as L
from lightning.fabric.plugins.environments import SLURMEnvironment

from rolemrc.checkpointing.find import next_hpc_checkpoint

log = logging.getLogger(__name__)


class SlurmRequeue(L.Callback):
    """On SIGUSR1 (``sbatch --signal=USR1@<s>``) every rank saves ``<run dir>/hpc_ckpt_<n>.ckpt``
    after the next optimizer step, rank 0 runs ``scontrol requeue``, and all ranks exit; the
    restarted job resumes from that checkpoint (Lightning picks the newest ``hpc_ckpt_*``).

    The handler only sets a flag. Saving inside the handler (Lightning's built-in way) can put
    one rank in the checkpoint's barrier while another waits in a gradient all-reduce, and the
    job hangs until the time limit kills it.
    """

    def __init__(self, signum: int = signal.SIGUSR1) -> None:
        self.signum = signal.Signals(signum)
        self._signalled = False
        self._active = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signalled = True

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._active = SLURMEnvironment.detect()
        if self._active:
            signal.signal(self.signum, self._on_signal)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._active or not bool(batch["step_end"]):
            return  # not under SLURM, or in the middle of gradient accumulation (the batch says so:
            # rolemrc.data.sampler.StepBatchSampler tags the micro-batch that closes each step)
        if not trainer.strategy.reduce_boolean_decision(self._signalled, all=False):
            return
        # rank 0 names it (a rank that looked after rank 0 had written would pick the next number)
        path = trainer.strategy.broadcast(str(next_hpc_checkpoint(trainer.default_root_dir)), src=0)
        trainer.save_checkpoint(path)
        requeued = False
        if trainer.is_global_zero:
            job = os.environ["SLURM_JOB_ID"]
            if os.environ.get("SLURM_ARRAY_JOB_ID"):
                job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
            done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
            requeued = done.returncode == 0
            if requeued:
                log.info("saved %s at step %d and requeued job %s", path, trainer.global_step, job)
            else:
                log.error("saved %s but `scontrol requeue %s` failed: %s", path, job, done.stderr.strip())
        if trainer.strategy.broadcast(requeued, src=0):
            raise SystemExit(0)  # SLURM runs the job again
        self._signalled = False
