"""The SLURM preemption checkpoint gets the name Lightning resumes a requeued job from."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

from rolemrc.checkpointing.find import next_hpc_checkpoint


def test_next_name_is_lightnings(tmp_path: Path) -> None:
    for existing in ([], [1], [1, 3], [2, 10]):
        run = tmp_path / ("run" + "_".join(map(str, existing)))
        run.mkdir()
        for n in existing:
            (run / f"hpc_ckpt_{n}.ckpt").write_bytes(b"x")
        ours = next_hpc_checkpoint(run)
        # Lightning's own naming (a private static method: this test fails if Lightning changes it)
        assert str(ours) == _CheckpointConnector.hpc_save_path(str(run))
        assert ours.name == f"hpc_ckpt_{max(existing, default=0) + 1}.ckpt"
