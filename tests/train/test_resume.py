"""Exact resume: a run killed with SIGKILL mid-epoch and resumed from its last checkpoint
follows the uninterrupted run's loss curve step for step, and in that epoch no sample is
skipped or seen twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import recorder
from tests.conftest import ROOT
from tests.train.helpers import train_in_process

pytestmark = pytest.mark.slow

# 122 training conversations / batch 8 = 16 steps an epoch; 18 steps cross into epoch 2.
ARGS = ["data.max_length=96", "trainer.max_steps=18", "trainer.max_epochs=5", "trainer.deterministic=true",
        "trainer.enable_progress_bar=false", "logger=csv", "export.enabled=false", "data.val_fraction=0",
        "+callbacks.record._target_=tests.recorder.Recorder", "model.peft.enabled=true",
        "model.peft.dropout=0.3", "model.peft.target_modules=[q_proj,v_proj,down_proj]"]


def train(run_dir: Path, *extra: str) -> subprocess.Popen:
    # this checkout's src ahead of an installed rolemrc (a shared venv's editable install may point elsewhere)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    return subprocess.Popen(
        [sys.executable, "train.py", *ARGS, f"hydra.run.dir={run_dir}", f"+callbacks.record.path={run_dir}/record",
         *extra],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )


def test_sigkill_mid_epoch_then_resume_matches_uninterrupted(tmp_path: Path) -> None:
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "interrupted"
    victim = train(run_dir, "runtime.checkpoint_every_n_steps=1")
    # Kill the second run once it has trained a few steps (mid-epoch 1).
    deadline = time.time() + 300
    while len([r for r in recorder.read(run_dir / "record") if r["event"] == "step"]) < 6:
        assert victim.poll() is None, victim.stderr.read()[-3000:]
        assert time.time() < deadline, "run did not reach step 6"
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    # The uninterrupted run, made in this process (the same overrides, no kill).
    train_in_process(ref_dir, *ARGS, f"+callbacks.record.path={ref_dir}/record")

    ckpt = run_dir / "checkpoints" / "last.ckpt"
    resumed_from = torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"]
    assert 5 <= resumed_from < 16, "the kill should land mid-epoch"
    before = [r for r in recorder.read(run_dir / "record") if r["event"] == "step" and r["step"] <= resumed_from]

    resume = train(run_dir, "runtime.checkpoint_every_n_steps=1", "ckpt_path=last")
    code, err = resume.wait(timeout=600), resume.stderr.read()
    assert code == 0, err[-3000:]
    assert "not resumable" not in err  # Lightning is told the loader resumes mid-epoch (its state_dict)
    records = recorder.read(run_dir / "record")
    starts = [i for i, r in enumerate(records) if r["event"] == "start"]
    assert records[starts[-1]]["global_step"] == resumed_from
    after = [r for r in records[starts[-1]:] if r["event"] == "step"]

    reference_steps = {r["step"]: r for r in recorder.read(ref_dir / "record") if r["event"] == "step"}
    combined = before + after
    assert [r["step"] for r in combined] == list(range(1, 19))
    for r in combined:  # same batches, same dropout masks, same weights: same loss
        assert r["index"] == reference_steps[r["step"]]["index"], r["step"]
        assert r["loss"] == pytest.approx(reference_steps[r["step"]]["loss"], abs=1e-6), r["step"]
    epoch0 = [i for r in combined if r["epoch"] == 0 for i in r["index"]]
    assert sorted(epoch0) == list(range(122)), "every sample of the epoch exactly once"
