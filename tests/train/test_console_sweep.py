"""Sweeps (train.py -m): a failing job is one line and the others still run; the sweep ends with
one row per job, printed and in <sweep dir>/sweep_summary.md, and exit status 1 (rolemrc.sweep)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
       "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
TINY = ["data.max_length=96", "data.val_fraction=0", "export.enabled=false", "trainer.enable_progress_bar=false",
        "logger=csv", "task_name=sweeptest"]
BAD = "error: data.on_error must be one of raise, skip, got 'bogus'"


def sweep(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train.py"), "-m", *TINY, *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=900)


def only_sweep(cwd: Path) -> Path:
    (folder,) = (cwd / "multirun" / "sweeptest").iterdir()
    return folder


def test_local_launcher_sweep_runs_past_a_failed_job_and_summarises_every_job(tmp_path: Path) -> None:
    done = sweep(tmp_path, "hydra/launcher=local", "trainer.max_steps=1", "data.on_error=raise,bogus")
    assert done.returncode == 1, done.stderr[-3000:]
    printed = done.stdout + done.stderr
    assert "Traceback" not in printed and "UncompletedJobError" not in printed, printed[-3000:]
    folder = only_sweep(tmp_path)
    summary = (folder / "sweep_summary.md").read_text()
    assert f"sweep multirun/sweeptest/{folder.name}: 2 jobs, 1 completed, 1 failed" in summary
    rows = [line for line in summary.splitlines() if line.startswith("| 0 ") or line.startswith("| 1 ")]
    assert rows[0].startswith("| 0 | `data.on_error=raise` | completed | 1 | ") and str(folder.resolve() / "0") in rows[0]
    assert rows[1].startswith("| 1 | `data.on_error=bogus` | failed |  |  |  | ")
    assert f"- job 1 failed: {BAD}" in summary
    # The same table on the console, and the failed job's own log holds its one error line.
    assert f"- job 1 failed: {BAD}" in done.stdout and rows[0] in done.stdout
    logs = [p for p in (folder / ".submitit").rglob("*_log.err") if BAD in p.read_text()]
    assert len(logs) == 1 and "Traceback" not in logs[0].read_text()


def test_basic_launcher_goes_on_after_a_failed_job(tmp_path: Path) -> None:
    # Both jobs fail before anything loads (fast); the first used to end the whole sweep.
    done = sweep(tmp_path, "data.on_error=bogus,wrong")
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.count("error: data.on_error must be one of raise, skip") == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    summary = (only_sweep(tmp_path) / "sweep_summary.md").read_text()
    assert "2 jobs, 0 completed, 2 failed" in summary and "got 'wrong'" in summary and "got 'bogus'" in summary
