"""objective=grpo on two CPU ranks under FSDP2 (sharded policy and reference copy, generate with
synced decoding steps) and DDP: the same rollouts, rewards and KL step for step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.train.helpers import metric_rows

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ARGS = ["objective=grpo", "data.prompts=[{path: ${asset:sample/test.jsonl}}]", "data.max_prompt_length=48",
        "data.batch_size=2", "objective.num_generations=3", "objective.max_completion_length=6",
        "trainer.max_steps=2", "objective.beta=0.04", "trainer.devices=2", "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false", "export.enabled=false", "data.val_fraction=0",
        "+objective.rewards.vowels._target_=tests.train.test_grpo.vowel_reward"]


def train(run_dir: Path, *overrides: str) -> list[dict[str, float]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "train.py", *ARGS, f"hydra.run.dir={run_dir}", *overrides], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "returned a view tensor" not in proc.stderr
    return [r for r in metric_rows(run_dir) if "train/loss" in r]


def test_fsdp2_and_ddp_give_the_same_rollouts(tmp_path: Path) -> None:
    fsdp = train(tmp_path / "fsdp", "strategy=fsdp", "strategy.param_dtype=null")
    ddp = train(tmp_path / "ddp", "strategy=ddp")
    assert len(fsdp) == len(ddp) == 2
    for key in ("train/reward", "train/rewards/vowels/mean", "train/completions/mean_length", "train/kl"):
        assert [r[key] for r in fsdp] == pytest.approx([r[key] for r in ddp], abs=1e-5), key
    assert fsdp[1]["train/kl"] > 0  # the policy moved off the reference after one step
