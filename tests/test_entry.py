"""The entry scripts' wrapper (rolemrc.entry): user errors as one line and exit 1, bugs with
their traceback. (Lightning's log lines printed once: tests/train/test_console.py's run.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rolemrc.entry import entry_point
from rolemrc.errors import CheckpointError, InputNotFound
from tests.conftest import ROOT

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
       "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def test_a_user_error_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop, entry_point():
        raise InputNotFound("data file not found: /nowhere/sft.jsonl")
    assert stop.value.code == 1
    assert capsys.readouterr().err == "error: data file not found: /nowhere/sft.jsonl\n"
    # The user-error types are still what callers catch.
    assert issubclass(InputNotFound, FileNotFoundError) and issubclass(CheckpointError, ValueError)


def test_a_bug_keeps_its_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ZeroDivisionError), entry_point():
        1 / 0  # noqa: B018
    assert "error:" not in capsys.readouterr().err


def _no_key_env() -> dict[str, str]:
    env = dict(ENV)
    env.pop("ROLEMRC_TEST_UNSET_KEY", None)
    return env


def test_a_missing_api_key_is_one_line(tmp_path: Path) -> None:
    """evaluate.py's judge and synthesize.py's generator name the unset variable, exit 1."""
    judged = subprocess.run(
        [sys.executable, "evaluate.py", "judge=openai", "judge.model=any", "judge.api_key_env=ROLEMRC_TEST_UNSET_KEY",
         "limit=1", "generation.max_new_tokens=2", "metrics.names=[bleu]", f"out_dir={tmp_path / 'eval'}"],
        cwd=ROOT, env=_no_key_env(), capture_output=True, text=True, timeout=600)
    personas = tmp_path / "personas.jsonl"
    personas.write_text('{"persona": "A retired lighthouse keeper who collects sea glass and tells long stories"}\n'
                        '{"persona": "A pastry chef in Lyon obsessed with butter and precise timing"}\n')
    synthesized = subprocess.run(
        [sys.executable, "synthesize.py", f"out_dir={tmp_path / 'synth'}", "personas.source=file",
         f"personas.path={personas}", "personas.n=2", "progress=false", "stages=[personas,profiles]",
         "generator.api_key_env=ROLEMRC_TEST_UNSET_KEY"],
        cwd=ROOT, env=_no_key_env(), capture_output=True, text=True, timeout=600)
    for done in (judged, synthesized):
        assert done.returncode == 1, done.stderr[-3000:]
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and "ROLEMRC_TEST_UNSET_KEY" in last, last


def test_synthesize_names_bad_input_in_one_line(tmp_path: Path) -> None:
    """A personas file that yields no persona, and a config value out of range."""
    personas = tmp_path / "personas.jsonl"
    personas.write_text('{"persona": "x"}\n')  # too short to be a persona
    runs = {
        f"error: personas: no persona read from {personas} (": [
            f"personas.path={personas}", "personas.source=file", "stages=[personas]"],
        "error: synthesize config: assemble.test_fraction: must lie in [0, 1)": ["assemble.test_fraction=1.5"],
    }
    for want, args in runs.items():
        done = subprocess.run([sys.executable, "synthesize.py", f"out_dir={tmp_path / 'out'}", "progress=false", *args],
                              cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
        assert done.stderr.strip().splitlines()[-1].startswith(want), done.stderr[-3000:]


def test_a_model_path_that_does_not_exist_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_export"
    # BERTScore named offline (its default, roberta-large, is not cached here: an error of its own)
    done = subprocess.run([sys.executable, "evaluate.py", f"model.path={missing}", "limit=1",
                           "metrics.bertscore.model=minilm", f"out_dir={tmp_path / 'eval'}"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (f"error: model.path={missing}: no such folder "
                                                     "(a hub id is written owner/name)")


def test_benchmarks_offline_name_the_missing_data_set_before_any_model_loads(tmp_path: Path) -> None:
    """benchmarks=general offline with nothing cached: the one error line, and no model built first
    (build_model logs "model <name>: <n> parameters")."""
    done = subprocess.run(
        [sys.executable, "evaluate.py", "benchmarks=general", "limit=1", f"out_dir={tmp_path / 'eval'}"],
        cwd=ROOT, env={**ENV, "HF_DATASETS_OFFLINE": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: benchmarks: task gsm8k: its data set cannot be loaded"), last
    assert "parameters" not in done.stdout + done.stderr


def test_train_sbatch_outside_a_slurm_job_is_one_line(tmp_path: Path) -> None:
    """``bash slurm/train.sbatch ...`` on a machine (no SLURM job): what to run instead, not bash's
    ``SLURM_SUBMIT_DIR: unbound variable``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run(["bash", str(ROOT / "slurm" / "train.sbatch"), "trainer.max_steps=1"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: train.sbatch runs inside a SLURM job: submit it with sbatch (sbatch slurm/train.sbatch <overrides>); "
        "to train on this machine: python train.py <overrides>"]
