"""A run's life keeps its promises (issue 31 item 4, issue 35 items 2, 3, 5), through train.py:

- continuing a folder by name (``hydra.run.dir=<run> ckpt_path=last trainer.max_steps=N``) runs
  the run's own saved config under the new overrides, never rewrites ``.hydra/config.yaml``
  (``.hydra/continuations.yaml`` records it), and the "finished" message's command, pasted, trains;
  the command that made the run still finds it afterwards;
- Ctrl-C (SIGINT) writes a checkpoint at the step boundary, prints the command that continues and
  exits 130; that command continues to the uninterrupted run's rows (SIGTERM the same, exit 143);
- a validation killed at a checkpointed step is redone on resume, and a run killed during its
  final export completes it (and its ``run_summary.json``) when resumed;
- a second training process of a folder in use stops with one error line, writing nothing.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from rolemrc.run.resume import continue_run_argv, run_folder_lock
from tests.conftest import CONF, ROOT
from tests.train.helpers import metric_rows, train_in_process

pytestmark = pytest.mark.slow

FAST = ["data.max_length=96", "trainer.deterministic=true", "trainer.enable_progress_bar=false", "logger=csv",
        "callbacks=none"]


def train(cwd: Path, *args: str) -> tuple[int, str, str]:
    # this checkout's src ahead of an installed rolemrc (a shared venv's editable install may point elsewhere)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)
    return done.returncode, done.stdout, done.stderr


def advised(text: str, after: str) -> list[str]:
    """The overrides of the ``python train.py ...`` command printed after ``after``."""
    line = text.split(after, 1)[1].splitlines()[0]
    words = shlex.split(line)
    assert words[:2] == ["python", "train.py"], line
    return words[2:]


def step_of(run: Path) -> int:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]


def test_continuing_a_folder_keeps_its_config_and_the_advice_works(tmp_path: Path) -> None:
    # 122 conversations in batches of 64: two steps an epoch; max_epochs=3, killed after step 4 (two complete epochs, checkpoint at 4):
    # the run that stopped at step 60 of max_epochs=10.
    original = [*FAST, "task_name=keep", "trainer.max_epochs=3", "data.batch_size=64",  # two steps an epoch
                "data.val_fraction=0", "export.enabled=false", "runtime.checkpoint_every_n_steps=2",
                "+callbacks.kill._target_=tests.train.killer.KillAt", "+callbacks.kill.step=4",
                f"+callbacks.kill.marker={tmp_path / 'killed'}", "ckpt_path=last"]
    rc, _, err = train(tmp_path, *original)
    assert rc == -9, err[-3000:]
    (run,) = (tmp_path / "outputs" / "keep").iterdir()
    saved = (run / ".hydra" / "config.yaml").read_bytes()
    assert step_of(run) == 4

    # By name, with only a longer max_steps: the run's own config (max_epochs=3, its checkpoint
    # interval, task_name) plus trainer.max_steps=5; on main this said "finished (max_epochs=1 ...)".
    rc, out, err = train(tmp_path, f"hydra.run.dir={run}", "ckpt_path=last", "trainer.max_steps=5")
    assert rc == 0, err[-3000:]
    assert f"ckpt_path=last: continuing {run} (its saved config with trainer.max_steps: -1 -> 5)" in out
    assert step_of(run) == 5
    assert (run / ".hydra" / "config.yaml").read_bytes() == saved, "the saved config is never rewritten"
    (entry,) = yaml.safe_load((run / ".hydra" / "continuations.yaml").read_text())
    assert entry["changed"] == {"trainer.max_steps": {"saved": -1, "now": 5}}
    assert "trainer.max_steps=5" in entry["overrides"]

    # Again: finished; the advised command, pasted, trains (up to max_epochs=3: step 6)...
    rc, out, err = train(tmp_path, f"hydra.run.dir={run}", "ckpt_path=last", "trainer.max_steps=5")
    assert rc == 0 and f"{run} is finished (trainer.max_steps=5 reached at step 5" in out, err[-3000:]
    command = advised(out, "to train further: ")
    assert command == [f"hydra.run.dir={run}", "ckpt_path=last", "trainer.max_steps=10"]
    rc, out, err = train(tmp_path, *command)
    assert rc == 0, err[-3000:]
    assert step_of(run) == 6 and "is finished" not in out
    # ... and what it advises then (max_epochs reached) raises max_epochs, keeping max_steps=10: no loop.
    rc, out, err = train(tmp_path, *command)
    assert rc == 0 and f"{run} is finished (trainer.max_epochs=3 complete epoch(s) at step 6" in out, err[-3000:]
    assert advised(out, "to train further: ") == [f"hydra.run.dir={run}", "ckpt_path=last", "trainer.max_steps=10",
                                                  "trainer.max_epochs=4"]
    assert (run / ".hydra" / "config.yaml").read_bytes() == saved
    assert len(yaml.safe_load((run / ".hydra" / "continuations.yaml").read_text())) == 2  # the two that trained

    # The command that made the run still finds it (on main: a new run from step 0).
    os.chdir(tmp_path)
    try:
        argv = continue_run_argv(["train.py", *original], CONF, "train")
    finally:
        os.chdir(ROOT)
    assert f'hydra.run.dir="{run.relative_to(tmp_path)}"' in argv and "hydra.output_subdir=null" in argv


def test_ctrl_c_checkpoints_at_the_step_boundary_and_the_printed_command_continues(tmp_path: Path) -> None:
    args = [*FAST, "trainer.max_steps=7", "export.enabled=false", "trainer.val_check_interval=4",
            "+callbacks.kill._target_=tests.train.killer.KillAt", "+callbacks.kill.step=3",
            "+callbacks.kill.signal=SIGINT", f"+callbacks.kill.marker={tmp_path / 'interrupted'}"]
    run = tmp_path / "run"
    rc, _, err = train(tmp_path, *args, f"hydra.run.dir={run}")
    # SIGINT as step 4 starts: step 4 is finished and checkpointed (no checkpoint interval is set)
    assert rc == 130, err[-3000:]
    assert f"interrupted by SIGINT at step 4: checkpoint {run}/checkpoints/last.ckpt" in err
    assert "Traceback" not in err and step_of(run) == 4
    command = advised(err, "to continue: ")
    assert command[:2] == [f"hydra.run.dir={run}", "ckpt_path=last"]
    rc, out, err = train(tmp_path, *command)
    assert rc == 0, err[-3000:]

    reference = train_in_process(tmp_path / "reference", *args[:5], "trainer.max_steps=7", "export.enabled=false",
                                 "trainer.val_check_interval=4")
    rows, want = metric_rows(run), metric_rows(reference)
    assert [r["step"] for r in rows] == [r["step"] for r in want]
    for got, expected in zip(rows, want):
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert any("val/loss" in r for r in rows)


def test_sigterm_checkpoints_at_the_step_boundary_and_exits_143(tmp_path: Path) -> None:
    # In process: the signal handling is the callback's, not the script's.
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stop:
        train_in_process(tmp_path / "run", *FAST, "trainer.max_steps=6", "export.enabled=false",
                         "data.val_fraction=0", "+callbacks.kill._target_=tests.train.killer.KillAt",
                         "+callbacks.kill.step=2", "+callbacks.kill.signal=SIGTERM",
                         f"+callbacks.kill.marker={tmp_path / 'term'}")
    assert stop.value.code == 128 + signal.SIGTERM
    assert step_of(tmp_path / "run") == 3
    assert signal.getsignal(signal.SIGTERM) == handler  # the process's own handler again


@pytest.mark.multiprocess
def test_ctrl_c_under_ddp_checkpoints_at_one_step_boundary_and_says_so_once(tmp_path: Path) -> None:
    """Ctrl-C in a terminal signals every process of its group: under DDP (2 CPU processes) the ranks
    agree on one step boundary, its checkpoint is written, the signal line and the continue command
    are printed once (rank 0) and the run exits 130, no rank left behind. The run is started in a
    session of its own, so the group's SIGINT (sent by rank 0 as step 3 starts) reaches only it.
    Continuing a DDP run from its checkpoint: tests/distributed/test_strategies.py."""
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *FAST, "trainer.accelerator=cpu", "trainer.devices=2",
         "strategy=ddp", "data.val_fraction=0", "trainer.max_steps=5", "export.enabled=false",
         "+callbacks.kill._target_=tests.train.killer.KillAt", "+callbacks.kill.step=2",
         "+callbacks.kill.signal=SIGINT", "+callbacks.kill.group=true", f"+callbacks.kill.marker={tmp_path / 'sigint'}",
         f"hydra.run.dir={run}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, start_new_session=True)
    err = done.stderr
    assert done.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    assert err.count("SIGINT: stopping at the end of this optimizer step") == 1, err[-3000:]
    assert err.count("to continue: ") == 1, err[-3000:]
    assert f"interrupted by SIGINT at step 3: checkpoint {run}/checkpoints/last.ckpt" in err
    assert advised(err, "to continue: ")[:2] == [f"hydra.run.dir={run}", "ckpt_path=last"]
    assert step_of(run) == 3


def test_killed_validation_and_export_are_completed_on_resume(tmp_path: Path) -> None:
    args = [*FAST, "trainer.max_steps=8", "runtime.checkpoint_every_n_steps=4", "trainer.val_check_interval=4"]
    kills = ["+callbacks.kill._target_=tests.train.killer.KillAt", "+callbacks.kill.step=4",
             "+callbacks.kill.at=validation", f"+callbacks.kill.marker={tmp_path / 'val'}",
             "+callbacks.kill2._target_=tests.train.killer.KillAt", "+callbacks.kill2.step=8",
             "+callbacks.kill2.at=export", f"+callbacks.kill2.marker={tmp_path / 'export'}"]
    run = tmp_path / "run"
    command = [*args, *kills, f"hydra.run.dir={run}", "ckpt_path=last"]
    rc, _, err = train(tmp_path, *command)  # killed in the validation after step 4 (checkpoint of step 4)
    assert rc == -9 and step_of(run) == 4, err[-3000:]
    rc, _, err = train(tmp_path, *command)  # redoes it, trains on, killed writing the export
    assert rc == -9 and step_of(run) == 8, err[-3000:]
    assert (run / "export.partial").is_dir() and not (run / "export").exists()
    assert not (run / "run_summary.json").exists()

    rc, out, err = train(tmp_path, *command)  # on main: "is finished", exit 0, nothing exported
    assert rc == 0, err[-3000:]
    assert f"{run} finished training at step 8; completing its end-of-run work (export {run}/export" in out
    assert (run / "export" / "config.json").is_file() and not (run / "export.partial").exists()
    summary = yaml.safe_load((run / "run_summary.json").read_text())
    assert summary["steps"] == 8 and summary["val_loss"] is not None and summary["train_loss"] is not None

    reference = train_in_process(tmp_path / "reference", *args, "export.enabled=false")
    rows, want = metric_rows(run), metric_rows(reference)
    assert [r["step"] for r in rows] == [r["step"] for r in want]
    assert [r for r in rows if "val/loss" in r] == pytest.approx([r for r in want if "val/loss" in r], rel=1e-6)
    for got, expected in zip(rows, want):
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert summary["val_loss"] == pytest.approx(want[-1]["val/loss"], rel=1e-6)

    rc, out, err = train(tmp_path, *command)  # now all done: nothing to do
    assert rc == 0 and f"{run} is finished" in out, err[-3000:]


def test_a_second_process_of_a_folder_in_use_stops_with_one_error_line(tmp_path: Path) -> None:
    run = train_in_process(tmp_path / "run", *FAST, "trainer.max_steps=2", "export.enabled=false",
                           "data.val_fraction=0")
    before = (run / "csv" / "metrics.csv").read_text()
    with run_folder_lock(run):  # this process trains the folder (as a first ckpt_path=last run would)
        rc, out, err = train(tmp_path, *FAST, "trainer.max_steps=4", "export.enabled=false",
                             "data.val_fraction=0", f"hydra.run.dir={run}", "ckpt_path=last")
    assert rc == 1, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"error: {run} is in use by another training process (pid {os.getpid()}, lock {run}/.train.lock); "
        "wait for it to end, or train in another folder")
    assert "Traceback" not in err and (run / "csv" / "metrics.csv").read_text() == before
    assert step_of(run) == 2


def test_a_ckpt_path_last_start_looks_up_and_checks_its_checkpoint_once(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # On main one such start called find_checkpoint 6 times and check_checkpoint 3 times.
    import rolemrc.checkpointing
    import rolemrc.run.train
    from rolemrc.run.train import run
    from tests.conftest import compose_train

    args = [*FAST, "task_name=count", "export.enabled=false", "data.val_fraction=0"]
    folder = tmp_path / "outputs" / "count" / "2026-01-01_00-00-00"
    train_in_process(folder, *args, "trainer.max_steps=2")
    found, checked = [], []
    find, check = rolemrc.checkpointing.find_checkpoint, rolemrc.run.train.check_checkpoint
    monkeypatch.setattr(rolemrc.checkpointing, "find_checkpoint", lambda d: found.append(Path(d).resolve()) or find(d))
    monkeypatch.setattr(rolemrc.run.train, "check_checkpoint", lambda p: checked.append(p) or check(p))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)

    argv = continue_run_argv(["train.py", *args, "trainer.max_steps=3", "ckpt_path=last"], CONF, "train")
    assert 'hydra.run.dir="outputs/count/2026-01-01_00-00-00"' in argv
    run(compose_train([*args, "trainer.max_steps=3", "ckpt_path=last"], run_dir=folder))
    assert step_of(folder) == 3
    assert found.count(folder.resolve()) == 1 and len(found) == 2  # the folder, and the one Hydra would make
    assert [Path(c).resolve() for c in checked] == [folder.resolve() / "checkpoints" / "last.ckpt"]
