"""What a user reads on the console: captured LoRA and DPO training runs, evaluate.py and
export.py print no line outside the allow-list (tests/train/helpers.py: none of the known library
noise, rolemrc.warnings) and a training run ends with its numbers; a run stopped by trainer.max_steps validates
at its end; evaluation does not call the model it only runs trainable; a config key no run can
satisfy is refused before Lightning is imported."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT
from tests.train.helpers import lines_outside_the_allow_list

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
       "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
ENV.pop("WANDB_SERVICE", None)  # the child starts its own W&B service
# Known, non-actionable lines (issue 22) that must not reach the console.
NOISE = ("LeafSpec", "litlogger", "Loading weights", "Writing model shards", "is_gradient_checkpointing",
         "gradient_checkpointing_enable", "anonymous", "`pretrained` model kwarg", "Total length of `list`",
         "assuming the intent is to")


def python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)


def test_a_training_run_prints_no_known_noise_validates_at_max_steps_and_ends_with_its_numbers(tmp_path: Path) -> None:
    run = tmp_path / "run"
    # LoRA with gradient checkpointing and W&B: the settings that brought most of the noise.
    done = python("train.py", "trainer.max_steps=2", "data.max_length=96", "model.peft.enabled=true",
                  "model.gradient_checkpointing=true", "logger=[csv,wandb]", f"hydra.run.dir={run}")
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout + done.stderr
    for noise in NOISE:
        assert noise not in printed, (noise, printed[-3000:])
    assert lines_outside_the_allow_list(printed) == [], printed[-3000:]
    # Lightning's own lines printed once, and once in Hydra's log file.
    for line in ("`Trainer.fit` stopped: `max_steps=2` reached.", "GPU available: False"):
        assert printed.count(line) == 1, printed[-3000:]
        assert (run / "train.log").read_text().count(line) == 1

    # The end-of-run summary, and the same figures in run_summary.json.
    summary = json.loads((run / "run_summary.json").read_text())
    assert summary["steps"] == 2 and summary["run_dir"] == str(run) and summary["export"] == str(run / "export")
    assert summary["epochs"] > 0 and summary["tokens_per_s"] > 0
    assert f"run summary: 2 steps, {summary['epochs']:.2f} epochs, train/loss {summary['train_loss']:.4f}, " \
           f"val/loss {summary['val_loss']:.4f}" in done.stdout
    assert f"  run folder: {run}\n  export: {run / 'export'}\n" in done.stdout

    # max_steps=2 stopped the epoch (14 batches) early: a final validation at step 2 all the same.
    with open(run / "csv" / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    val = [r for r in rows if r.get("val/loss")]
    assert len(val) == 1 and int(val[0]["step"]) == max(int(r["step"]) for r in rows if r.get("train/loss"))
    assert float(val[0]["val/loss"]) == summary["val_loss"]
    assert float([r for r in rows if r.get("train/loss")][-1]["train/loss"]) == summary["train_loss"]

    # Evaluating the export: its weights load without a progress bar in a log and without being
    # called trainable.
    evaluated = python("evaluate.py", f"model.path={run / 'export'}", "limit=1", "generation.max_new_tokens=2",
                       "metrics.names=[bleu]", f"out_dir={tmp_path / 'eval'}")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    printed = evaluated.stdout + evaluated.stderr
    assert "trainable" not in printed and "parameters" in printed
    for noise in NOISE:
        assert noise not in printed, (noise, printed[-3000:])
    assert lines_outside_the_allow_list(printed) == [], printed[-3000:]

    # export.py on the LoRA run's checkpoint, merged: its one line.
    exported = python("export.py", str(run), "--out", str(tmp_path / "merged"), "--merge")
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert lines_outside_the_allow_list(exported.stdout + exported.stderr) == [], exported.stderr[-3000:]
    assert exported.stdout == f"exported model: {tmp_path / 'merged'}\n" and exported.stderr == ""


def test_a_dpo_run_prints_only_the_allowed_lines(tmp_path: Path) -> None:
    """An ordinary DPO run (full fine-tuning, validation on, the progress bar in a log): nothing
    outside the allow-list (tests/train/helpers.py), each line once."""
    done = python("train.py", "objective=dpo", "trainer.max_steps=2", "data.max_length=96", "data.max_prompt_length=64",
                  f"hydra.run.dir={tmp_path / 'dpo'}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert lines_outside_the_allow_list(done.stdout + done.stderr) == [], (done.stdout + done.stderr)[-3000:]
    assert "run summary: 2 steps" in done.stdout


def test_a_key_no_run_can_satisfy_is_refused_before_lightning_loads(tmp_path: Path) -> None:
    # `+objective.lr=...` is the form Hydra's own hint suggests; -X importtime lists every import.
    done = python("-X", "importtime", "train.py", "+objective.lr=1e-3", f"hydra.run.dir={tmp_path / 'r'}")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == ("error: objective.lr is not a key of objective=sft (SFTObjectiveConfig); remove it: it has "
                         "no effect on this objective")
    imported = {line.split("|")[-1].strip() for line in lines if line.startswith("import time:")}
    assert "rolemrc.config" in imported
    assert not {"lightning", "transformers", "rolemrc.run.train"} & imported
