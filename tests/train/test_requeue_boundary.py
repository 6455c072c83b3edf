"""The SLURM requeue callback saves only when a micro-batch closes an optimizer step, never with
half a step's gradients accumulated (the resumed run would lose them)."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest
import torch

from rolemrc.run.requeue import SlurmRequeue


class FakeTrainer:
    def __init__(self) -> None:
        self.saved: list[int] = []
        self.global_step = 0
        self.is_global_zero = False
        self.default_root_dir = "/nonexistent"
        self.strategy = SimpleNamespace(reduce_boolean_decision=lambda flag, all=True: flag,
                                        broadcast=lambda value, src=0: value)

    def save_checkpoint(self, path: str) -> None:
        self.saved.append(self.global_step)


def test_signal_mid_accumulation_waits_for_the_step_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_NTASKS", "1")  # what Lightning's SLURMEnvironment.detect() reads
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    cb, trainer = SlurmRequeue(), FakeTrainer()
    before = signal.getsignal(signal.SIGUSR1)
    try:
        cb.on_train_start(trainer, None)  # under SLURM: the handler is installed
        os.kill(os.getpid(), signal.SIGUSR1)  # SLURM's warning signal arrives mid-accumulation
    finally:
        signal.signal(signal.SIGUSR1, before)
    # accumulate 3: micro-batches 0 and 1 leave the step open; a fresh process starts here too
    for k in range(2):
        cb.on_train_batch_end(trainer, None, None, {"step_end": torch.tensor(False)}, k)
    assert trainer.saved == []
    trainer.global_step = 1
    cb.on_train_batch_end(trainer, None, None, {"step_end": torch.tensor(True)}, 2)
    assert trainer.saved == [1]  # rank != 0: no requeue attempted, the flag is cleared
