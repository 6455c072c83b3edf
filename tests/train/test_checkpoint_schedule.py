"""When checkpoints are written and under which name, in process:

- by default ``last.ckpt`` is also written by time (``runtime.checkpoint_every_minutes``): a run
  that dies mid-epoch without a signal (a crash here; SIGKILL alike) left a checkpoint of that
  epoch, and ``ckpt_path=last`` resumes from it;
- an interrupted run (Ctrl-C) continued with a step interval keeps one ``last.ckpt``, the newest
  (Lightning would write ``last-v1.ckpt`` beside one it did not know it wrote, which
  ``ckpt_path=last`` never reads);
- ``hydra.run.dir=<run> ckpt_path=last`` on a run folder without a checkpoint (its first save
  failed) trains that folder's own config and keeps its ``.hydra/``: the command a full disk
  advises works.
"""

from __future__ import annotations

import errno
import os
import shlex
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf

from rolemrc.config import TrainStep
from rolemrc.errors import StorageError
from rolemrc.run.resume import NO_HYDRA_FILES, continue_run_argv
from tests.conftest import CONF, compose_train
from tests.train.helpers import train_in_process

pytestmark = pytest.mark.slow

# 122 conversations in batches of 32: four steps an epoch
FAST = ["data.max_length=96", "data.batch_size=32", "data.val_fraction=0", "trainer.enable_progress_bar=false",
        "logger=csv", "export.enabled=false"]


class Crash(Exception):
    pass


class CrashAt(L.Callback):
    """Raises :class:`Crash` as the batch after ``step`` optimizer steps starts (a process that
    dies with no signal to act on), unless ``marker`` exists (created first)."""

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker = step, Path(marker)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step == self.step and not self.marker.exists():
            self.marker.write_text("crashed\n")
            raise Crash(f"crash at step {self.step}")


class StartedAt(L.Callback):
    """Records the step training starts from (a resumed run: its checkpoint's)."""

    steps: list[int] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        StartedAt.steps.append(trainer.global_step)


def saved(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_a_checkpoint_by_time_is_written_mid_epoch_and_resumed_from(tmp_path: Path) -> None:
    from rolemrc.run.build import build_trainer
    from rolemrc.run.state import RunState

    # the default: a checkpoint every 5 minutes, on every run
    cfg = compose_train(["callbacks=none", "logger=none"], run_dir=tmp_path / "default")
    (state,) = [c for c in build_trainer(TrainStep.of(cfg), logger=cfg.logger, callbacks=cfg.callbacks, run_dir=str(cfg.run_dir)).callbacks if isinstance(c, RunState)]
    assert cfg.runtime.checkpoint_every_minutes == 5 and state.every_s == 300

    run = tmp_path / "run"
    args = [*FAST, "callbacks=none", "trainer.max_epochs=2", "trainer.max_steps=6", "runtime.checkpoint_every_minutes=1e-6",
            "+callbacks.crash._target_=tests.train.test_checkpoint_schedule.CrashAt", "+callbacks.crash.step=3",
            f"+callbacks.crash.marker={tmp_path / 'crashed'}",
            "+callbacks.started._target_=tests.train.test_checkpoint_schedule.StartedAt"]
    StartedAt.steps = []
    with pytest.raises(Crash):
        train_in_process(run, *args)
    last = run / "checkpoints" / "last.ckpt"
    # no step interval, no epoch end, no signal: the checkpoint is the time trigger's, mid-epoch 0
    # (at least 10x the previous save's duration apart: step 1's at the latest, up to step 3's)
    step = saved(last)["global_step"]
    assert 1 <= step <= 3 and saved(last)["epoch"] == 0

    train_in_process(run, *args, "ckpt_path=last")
    assert StartedAt.steps == [0, step], "ckpt_path=last resumed from the checkpoint written by time"
    assert saved(last)["global_step"] == 6
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]


def test_an_interrupted_run_continued_keeps_one_last_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [*FAST, "callbacks=default", "trainer.max_epochs=2", "trainer.max_steps=7", "runtime.checkpoint_every_minutes=0",
            "runtime.checkpoint_every_n_steps=3",
            "+callbacks.kill._target_=tests.train.killer.KillAt", "+callbacks.kill.step=1",
            "+callbacks.kill.signal=SIGINT", f"+callbacks.kill.marker={tmp_path / 'interrupted'}"]
    with pytest.raises(SystemExit) as stop:
        train_in_process(run, *args)
    assert stop.value.code == 130
    last = run / "checkpoints" / "last.ckpt"
    assert saved(last)["global_step"] == 2
    # continued: Lightning's saves every 3 steps (3, 6) go to last.ckpt too, never to a last-v1.ckpt
    # beside it (which held step 6 while last.ckpt got the end's step 7)
    train_in_process(run, *args, "ckpt_path=last")
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]
    assert saved(last)["global_step"] == 7


def test_a_run_folder_whose_first_save_failed_continues_with_its_own_config(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    import rolemrc.checkpointing.io as ckpt_io

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt_io.torch, "save", full)
    run = tmp_path / "run"
    with pytest.raises(StorageError) as err:
        train_in_process(run, *FAST, "callbacks=none", "task_name=mine", "trainer.max_steps=3",
                         "runtime.checkpoint_every_n_steps=1")
    monkeypatch.undo()
    message = str(err.value)
    assert message.startswith(f"{run}/checkpoints/last.ckpt: saving the checkpoint failed: no space left on the "
                              "device; free space there, or move the run folder to a disk with room; then continue "
                              f"it: python train.py hydra.run.dir={run} ckpt_path=last")
    assert not (run / "checkpoints" / "last.ckpt").exists()
    config = (run / ".hydra" / "config.yaml").read_bytes()

    # the advised command: the folder's own config (its command line under the new one), .hydra/ kept
    advised = shlex.split(message.split("then continue it: ", 1)[1].split(" (with", 1)[0])
    assert advised[:2] == ["python", "train.py"]
    argv = continue_run_argv(["train.py", *advised[2:]], CONF, "train")
    assert f"{run} holds no checkpoint: training it from the start with its saved config" in capsys.readouterr().out
    assert NO_HYDRA_FILES in argv and "task_name=mine" in argv and "trainer.max_steps=3" in argv
    cfg = compose_train([a for a in argv[1:] if not a.startswith("hydra.")], run_dir=run)
    assert cfg.task_name == "mine" and cfg.trainer.max_steps == 3
    assert (run / ".hydra" / "config.yaml").read_bytes() == config
    assert OmegaConf.load(run / ".hydra" / "config.yaml").task_name == "mine"
