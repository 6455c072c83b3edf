"""Messages a user reads: a missing checkpoint file named as a file, JSON errors whole, "1 step",
``python -m rolemrc.memory --help`` (issue 34, item 7)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rolemrc.data.schemas import DataError
from rolemrc.eval.generation import read_replies
from rolemrc.run.train import summary_text
from tests.conftest import ROOT

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
       "OMP_NUM_THREADS": "1"}


def test_a_missing_checkpoint_file_is_named_a_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "run" / "checkpoints" / "last.ckpt"
    done = subprocess.run([sys.executable, "evaluate.py", f"model.path={missing}", "limit=1", "metrics.bertscore.model=minilm",
                           f"out_dir={tmp_path / 'eval'}"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == f"error: model.path={missing}: no such file"


def test_memory_help_prints_usage_and_exits_0_at_once() -> None:
    """At once: before torch is imported (seconds); it names where the table lives now."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "rolemrc.memory", "--help"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:") and "--simulate" in done.stdout and "python -m rolemrc.memory" in done.stdout
    assert "docs/memory.md" in done.stdout and "README" not in done.stdout and "an 8B recipe takes minutes" in done.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert not [m for m in imported if m in ("torch", "hydra", "rolemrc.config")], imported


@pytest.mark.parametrize(("steps", "words"), [(1, "1 step,"), (2, "2 steps,"), (0, "0 steps,")])
def test_the_run_summary_counts_steps_in_english(steps: int, words: str) -> None:
    text = summary_text({"steps": steps, "run_dir": "/r", "export": None})
    assert text.startswith(f"run summary: {words} "), text


def test_the_run_summary_names_what_the_objective_validates() -> None:
    """GRPO validates the reward of sampled completions, not a loss: the summary line says that figure,
    what it is the mean of, and the last step's train/reward beside it, rather than "no validation
    data"; with neither, it says there was none."""
    text = summary_text({"steps": 2, "run_dir": "/r", "export": None, "val_loss": None,
                         "val_metrics": {"val/completions/mean_length": 6.0, "val/reward": 0.25,
                                         "val/rewards/verifier/mean": 0.25},
                         "train_reward": 0.125, "notes": {"val/reward": "4 validation prompts x 8 completions",
                                                          "train/reward": "last step"}})
    assert ("train/reward 0.1250 (last step), val/reward 0.2500 (4 validation prompts x 8 completions), "
            in text) and "no validation data" not in text and "mean_length" not in text
    text = summary_text({"steps": 2, "run_dir": "/r", "export": None, "val_loss": None,
                         "val_metrics": {"val/a": 0.25, "val/b": 0.5}})
    assert "val/a 0.2500, val/b 0.5000" in text
    assert "val/loss n/a (no validation data)" in summary_text({"steps": 2, "run_dir": "/r", "export": None})
    assert "val/loss 1.5000" in summary_text({"steps": 2, "run_dir": "/r", "export": None, "val_loss": 1.5,
                                              "val_metrics": {"val/reward": 0.25}})


def test_a_json_error_is_not_cut_mid_sentence(tmp_path: Path) -> None:
    replies = tmp_path / "replies.jsonl"
    replies.write_text('{"id": "a", "reply": "fine"}\n{"id": "b", "reply": "a\tb"}\n', encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_replies(str(replies))
    line = str(err.value).splitlines()[-1].strip()
    assert line == f"{replies}:2: not JSON (Invalid control character at: column 24)", line


def test_a_mistyped_hub_id_fails_at_once_without_hf_hub_offline(tmp_path: Path) -> None:
    """Offline by default (issue 34, item 3): no HF_HUB_OFFLINE in the environment, and a hub id
    that is not in the cache ends in its one error line, with no retries against the hub."""
    env = {k: v for k, v in ENV.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env["HF_HOME"] = str(tmp_path / "hf")  # an empty cache
    done = subprocess.run([sys.executable, "train.py", "model.path=meta-llama/Llama-3.1-8B-Instrut",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("error: model.path=meta-llama/Llama-3.1-8B-Instrut: cannot load it "
                                "(no config.json of it in the local hub cache)."), lines[-1]
    assert "HF_HUB_OFFLINE=0" in lines[-1]
    assert not [ln for ln in lines[:-1] if "retry" in ln.lower() or "huggingface.co" in ln], lines


def test_the_model_summary_has_no_flops_it_did_not_count(capsys: pytest.CaptureFixture[str]) -> None:
    """Lightning counts FLOPs only for a module with an example input (rolemrc's have none): its
    summary would print "Total FLOPs: 0" on every run; rolemrc's leaves FLOPs out."""
    import lightning as L
    import torch
    from lightning.pytorch.utilities.model_summary.model_summary import summarize

    from rolemrc.callbacks.model_summary import ModelSummaryWithoutFlops

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 4)

    s = summarize(Module(), max_depth=1)
    assert s.total_flops == 0
    ModelSummaryWithoutFlops.summarize(s._get_summary_data(), s.total_parameters, s.trainable_parameters,
                                       s.model_size, s.total_training_modes, total_flops=s.total_flops)
    out = capsys.readouterr().out
    assert "Total params: 20" in out and "layer" in out and "Linear" in out and "FLOPs" not in out


def test_grpo_on_cpu_says_what_a_step_costs() -> None:
    from omegaconf import OmegaConf

    from rolemrc.run.train import grpo_cpu_hint

    cfg = OmegaConf.create({"data": {"batch_size": 4}, "trainer": {"accumulate_grad_batches": 2},
                            "objective": {"num_generations": 8, "max_completion_length": 48}})
    hint = grpo_cpu_hint(cfg.objective, cfg.data, cfg.trainer)
    assert hint.startswith("GRPO on CPU: each step samples 64 completions of up to 48 tokens") and "10-20 s" in hint
