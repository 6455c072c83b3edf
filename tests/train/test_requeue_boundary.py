"""The SLURM requeue callback saves only when a micro-batch closes an optimizer step, never with
half a step's gradients accumulated (the resumed run would lose them)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rolemrc.callbacks.slurm_requeue import SlurmRequeue


class FakeTrainer:
    def __init__(self) -> None:
        self.saved: list[int] = []
        self.global_step = 0
        self.is_global_zero = False
        self.default_root_dir = "/nonexistent"
        self.strategy = SimpleNamespace(reduce_boolean_decision=lambda flag, all=True: flag,
                                        broadcast=lambda value, src=0: value)
        self._checkpoint_connector = SimpleNamespace(hpc_save_path=lambda root: f"{root}/hpc_ckpt_1.ckpt")

    def save_checkpoint(self, path: str) -> None:
        self.saved.append(self.global_step)


def test_signal_mid_accumulation_waits_for_the_step_boundary() -> None:
    cb, trainer = SlurmRequeue(), FakeTrainer()
    cb._active, cb._signalled = True, True
    # accumulate 3: micro-batches 0 and 1 leave the step open; a fresh process starts here too
    for k in range(2):
        cb.on_train_batch_end(trainer, None, None, {"step_end": torch.tensor(False)}, k)
    assert trainer.saved == []
    trainer.global_step = 1
    cb.on_train_batch_end(trainer, None, None, {"step_end": torch.tensor(True)}, 2)
    assert trainer.saved == [1]  # rank != 0: no requeue attempted, the flag is cleared
