"""The README's resume command, ``python train.py <same overrides> ckpt_path=last``, continues the
interrupted run in its own folder (the run Hydra would start is never a new step-0 run beside
it); its ``csv/metrics.csv`` then holds the rows of an uninterrupted run (none lost to the kill,
none dropped by the resume) and W&B continues the same run id. Ambiguous cases (several runs
with this config, a run whose config changed since) stop with an error listing them; a
requeued SLURM job keeps its job-id folder."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from rolemrc.run.resume import continue_run_argv
from tests.conftest import CONF, ROOT
from tests.train.helpers import metric_rows, train_in_process

ARGS = ["data.max_length=96", "trainer.max_steps=10", "trainer.deterministic=true", "trainer.enable_progress_bar=false",
        "export.enabled=false", "data.val_fraction=0", "runtime.checkpoint_every_n_steps=4", "task_name=resumetest"]
# Killed at the start of step 8: rows of steps 1-7 logged, last checkpoint at step 4.
KILL = ["+callbacks.kill._target_=tests.train.killer.KillAt", "+callbacks.kill.step=7"]


def train(cwd: Path, *args: str) -> subprocess.Popen:
    # this checkout's src ahead of an installed rolemrc (a shared venv's editable install may point elsewhere)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]), "HF_HUB_OFFLINE": "1",
           "WANDB_MODE": "offline"}
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


@pytest.mark.slow
def test_ckpt_path_last_continues_a_killed_run_in_its_folder_with_all_its_rows(tmp_path: Path) -> None:
    # One command, run twice: the first run is SIGKILLed mid-training, the second continues it.
    command = [*ARGS, "logger=[csv,wandb]", *KILL, f"+callbacks.kill.marker={tmp_path / 'killed'}", "ckpt_path=last"]
    rc, out, err = finish(train(tmp_path, *command))
    assert rc == -9, err[-3000:]  # killed: a fresh run with ckpt_path=last started normally
    assert "ckpt_path=last: no run of this config with a checkpoint" in out and "starting a new run" in out
    runs = sorted((tmp_path / "outputs" / "resumetest").iterdir())
    assert len(runs) == 1
    run = runs[0]
    assert f"starting a new run in outputs/resumetest/{run.name}\n" in out  # the folder printed is the one written
    # Every step's row up to the kill is on disk (Lightning's CSV logger wrote every 100 steps).
    assert [r["step"] for r in metric_rows(run) if "train/loss" in r] == list(range(7))
    run_id = (run / "wandb_run_id").read_text().strip()

    rc, out, err = finish(train(tmp_path, *command))
    assert rc == 0, err[-3000:]
    assert f"ckpt_path=last: continuing outputs/resumetest/{run.name}" in out
    assert sorted((tmp_path / "outputs" / "resumetest").iterdir()) == [run], "no new run folder"

    reference = train_in_process(tmp_path / "reference", *ARGS, "logger=csv")  # the same run, uninterrupted
    rows, expected = metric_rows(run), metric_rows(reference)
    assert len(rows) == len(expected) == 20  # per step: the lr monitor's row and the module's row
    for got, want in zip(rows, expected):
        assert got.keys() == want.keys()
        assert got == pytest.approx(want, rel=1e-6, abs=1e-7)

    # W&B: both processes logged to the run id kept in the folder.
    offline = sorted(p.name for p in (run / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(name.endswith(f"-{run_id}") for name in offline)


def test_raising_max_steps_extends_a_finished_run_within_its_epoch(tmp_path: Path) -> None:
    """A run that trainer.max_steps stopped mid-epoch (checkpointed at its end), resumed with a larger max_steps, trains on
    the rest of that epoch's batches (Lightning's end-of-training checkpoint says the epoch ended)
    at the new schedule's learning rates. With callbacks=none the checkpoint still lands in
    <run>/checkpoints, where ckpt_path=last looks (Lightning's default: the logger's folder)."""
    args = [*ARGS, "callbacks=none", "logger=csv", "task_name=extend", "ckpt_path=last"]
    rc, _, err = finish(train(tmp_path, *args, "trainer.max_steps=2"))
    assert rc == 0, err[-3000:]
    (run,) = sorted((tmp_path / "outputs" / "extend").iterdir())
    assert (run / "checkpoints" / "last.ckpt").is_file() and not list((run / "csv").rglob("*.ckpt"))
    # Saved at the end of training although runtime.checkpoint_every_n_steps=4 had no step for it.
    assert torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 2
    rc, out, err = finish(train(tmp_path, *args, "trainer.max_steps=4"))
    assert rc == 0, err[-3000:]
    assert f"ckpt_path=last: continuing outputs/extend/{run.name}" in out and "max_steps=4` reached" in err + out
    reference = train_in_process(tmp_path / "reference", *args, "trainer.max_steps=4")  # 4 steps at once
    got, want = ([r for r in metric_rows(d) if "train/loss" in r] for d in (run, reference))
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 1, 2, 3]
    assert [r["train/tokens"] for r in got] == [r["train/tokens"] for r in want]  # the same batches, in order
    assert [r["train/lr"] for r in got[2:]] == pytest.approx([r["train/lr"] for r in want[2:]], rel=1e-6)
    assert got[1]["train/lr"] != pytest.approx(want[1]["train/lr"])  # steps 0-1 ran the 2-step schedule

    # Finished now: the same command again says so and how to extend it, and touches nothing
    # (no checkpoint saved again, no row, no Hydra file rewritten).
    def files() -> dict[Path, int]:  # the lock file holds the pid of the process using the folder
        return {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file() and p.name != ".train.lock"}

    before = files()
    rc, out, err = finish(train(tmp_path, *args, "trainer.max_steps=4"))
    assert rc == 0, err[-3000:]
    assert f"ckpt_path=last: {run} is finished (trainer.max_steps=4 reached at step 4" in out, out
    assert (f"to train further: python train.py hydra.run.dir={run} ckpt_path=last "
            "trainer.max_steps=8") in out and "Trainer.fit" not in err + out
    assert files() == before


def test_logger_none_trains_with_the_default_callbacks(tmp_path: Path) -> None:
    # The learning-rate monitor, which needs a logger, is left out.
    train_in_process(tmp_path / "r", *ARGS, "trainer.max_steps=1", "logger=none")
    assert (tmp_path / "r" / "checkpoints" / "last.ckpt").is_file()


# ------------------------------------------------------------- which folder (no training)


def saved_run(root: Path, name: str, args: list[str], **changes: object) -> Path:
    """A run folder as train.py leaves it: Hydra's saved config and overrides, and a checkpoint
    (never loaded here: only the folder choice is tested)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=args)
    GlobalHydra.instance().clear()
    for key, value in changes.items():
        OmegaConf.update(cfg, key.replace("__", "."), value)
    folder = root / name
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    (folder / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(args)))
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "last.ckpt").write_bytes(b"not read")
    return folder


@pytest.fixture
def outputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    return Path("outputs") / "resumetest"


def choose(*args: str) -> list[str]:
    return continue_run_argv(["train.py", *args], CONF, "train")[1:]


def test_the_one_matching_run_is_continued_others_are_not(outputs: Path) -> None:
    saved_run(outputs, "2026-01-01_00-00-00", ARGS)
    saved_run(outputs, "2026-01-02_00-00-00", [*ARGS, "optim.lr=1e-3"])  # another experiment
    saved_run(outputs, "2026-01-03_00-00-00", [*ARGS, "seed=1"])
    (outputs / "2026-01-04_00-00-00" / ".hydra").mkdir(parents=True)  # crashed before its first checkpoint
    # Continued: its saved .hydra/ is left as the run wrote it (Hydra writes none)
    assert choose(*ARGS, "ckpt_path=last", "trainer.max_steps=20") == [
        *ARGS, "ckpt_path=last", "trainer.max_steps=20", f'hydra.run.dir="{outputs}/2026-01-01_00-00-00"',
        "hydra.output_subdir=null"]
    # None: a new run, in the folder decided (and printed) here, not in one Hydra would time-stamp again.
    new = choose(*ARGS, "ckpt_path=last", "seed=2")
    assert new[:-1] == [*ARGS, "ckpt_path=last", "seed=2"]
    assert re.fullmatch(rf'hydra\.run\.dir="{outputs}/\d{{4}}-\d\d-\d\d_\d\d-\d\d-\d\d"', new[-1]), new[-1]
    assert choose(*ARGS) == ARGS  # no ckpt_path=last: untouched
    explicit = [*ARGS, "ckpt_path=last", "hydra.run.dir=elsewhere"]
    assert choose(*explicit) == explicit


def test_an_override_hydra_cannot_parse_is_left_to_hydra(tmp_path: Path, outputs: Path) -> None:
    # Lightning names checkpoints epoch=0-step=2.ckpt: unquoted, the '=' in the value is Hydra's
    # grammar error, which it reports in its usual lines (no traceback); quoted, the path is taken.
    unquoted = ["ckpt_path=/runs/x/checkpoints/epoch=0-step=2.ckpt"]
    assert choose(*unquoted) == unquoted
    quoted = ['ckpt_path="/runs/x/checkpoints/epoch=0-step=2.ckpt"']
    assert choose(*quoted) == quoted
    rc, out, err = finish(train(tmp_path, *unquoted), timeout=120)
    assert rc == 1 and "Traceback" not in err, err[-2000:]
    assert "mismatched input '='" in err + out


def test_two_runs_with_this_config_are_an_error_listing_both(outputs: Path) -> None:
    a = saved_run(outputs, "2026-01-01_00-00-00", ARGS)
    b = saved_run(outputs, "2026-01-02_00-00-00", ARGS)
    with pytest.raises(ValueError, match="2 run folders") as err:
        choose(*ARGS, "ckpt_path=last")
    assert str(a) in str(err.value) and str(b) in str(err.value) and "hydra.run.dir=<folder>" in str(err.value)


def test_same_command_with_a_changed_config_is_an_error_naming_the_key(outputs: Path) -> None:
    old = saved_run(outputs, "2026-01-01_00-00-00", ARGS, optim__lr=0.5)  # e.g. conf/train.yaml edited since
    with pytest.raises(ValueError, match="another config") as err:
        choose(*ARGS, "ckpt_path=last")
    assert str(old) in str(err.value) and "optim.lr: 0.5 -> 0.002" in str(err.value)


def test_entry_script_reports_the_ambiguity_in_one_line(tmp_path: Path) -> None:
    root = tmp_path / "outputs" / "resumetest"
    saved_run(root, "2026-01-01_00-00-00", ARGS)
    saved_run(root, "2026-01-02_00-00-00", ARGS)
    rc, _, err = finish(train(tmp_path, *ARGS, "ckpt_path=last"), timeout=120)
    assert rc == 1
    assert err.strip().splitlines()[-1].startswith("error: ckpt_path=last: 2 run folders"), err[-2000:]
    assert "Traceback" not in err


def test_slurm_requeue_keeps_its_job_folder(outputs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved_run(outputs, "2026-01-01_00-00-00", ARGS)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    # A requeued job: its own folder (outputs/<task>/<job id>) holds the checkpoint; Hydra reuses it.
    saved_run(outputs, "4242", ARGS)
    assert choose(*ARGS, "ckpt_path=last") == [*ARGS, "ckpt_path=last", "hydra.output_subdir=null"]
    # A new job resubmitted after the old one was killed continues the old job's run.
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    with pytest.raises(ValueError, match="2 run folders"):  # both earlier folders match
        choose(*ARGS, "ckpt_path=last")


def test_csv_logger_keeps_rows_before_the_resumed_step_and_drops_a_torn_row(tmp_path: Path) -> None:
    from rolemrc.loggers import CSVLogger

    first = CSVLogger(save_dir=tmp_path, name="csv", version="")
    for step in range(5):
        first.log_metrics({"train/loss": 1.0 / (step + 1)}, step=step)
    assert [r["step"] for r in metric_rows(tmp_path)] == [0, 1, 2, 3, 4]  # on disk as logged, no save() needed
    with (tmp_path / "csv" / "metrics.csv").open("a") as fh:
        fh.write("1,0.1")  # killed mid-write: a torn row ("12,0.1..." cut short)
    resumed = CSVLogger(save_dir=tmp_path, name="csv", version="")  # resumed from the checkpoint of step 3
    resumed.log_metrics({"train/loss": 9.0, "val/loss": 0.5}, step=3)  # a new column rewrites the header
    assert metric_rows(tmp_path) == [{"train/loss": 1.0, "step": 0}, {"train/loss": 0.5, "step": 1},
                                     {"train/loss": 1 / 3, "step": 2}, {"train/loss": 9.0, "val/loss": 0.5, "step": 3}]
    CSVLogger(save_dir=tmp_path, name="csv", version="").log_metrics({"train/loss": 7.0}, step=0)  # a fresh start
    assert metric_rows(tmp_path) == [{"train/loss": 7.0, "step": 0}]


def test_csv_logger_resumed_with_a_redone_validation_keeps_that_steps_training_row(tmp_path: Path) -> None:
    # Resumed from a checkpoint written as step 3 ended, before its validation (killed there): the
    # new process first logs that validation again; step 3's training row stays, its old
    # validation row (if any) is replaced, later rows go.
    from rolemrc.loggers import CSVLogger

    first = CSVLogger(save_dir=tmp_path, name="csv", version="")
    for step in range(5):
        first.log_metrics({"train/loss": float(step)}, step=step)
    first.log_metrics({"val/loss": 0.5}, step=3)
    resumed = CSVLogger(save_dir=tmp_path, name="csv", version="")
    resumed.log_metrics({"val/loss": 0.25}, step=3)
    assert metric_rows(tmp_path) == [{"train/loss": 0.0, "step": 0}, {"train/loss": 1.0, "step": 1},
                                     {"train/loss": 2.0, "step": 2}, {"train/loss": 3.0, "step": 3},
                                     {"val/loss": 0.25, "step": 3}]
