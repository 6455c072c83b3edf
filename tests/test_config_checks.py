"""Enum-like keys and cross-key rules are refused when the config is checked, naming the key,
before any data or weights load (issue: config checked when composed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rolemrc.config import check_train_config
from rolemrc.errors import ConfigError
from rolemrc.objectives.dpo import LOSS_TYPES
from tests.conftest import ROOT, compose_train

BAD = [
    (["objective=dpo", "objective.loss_type=ipx"], r"objective.loss_type must be one of sigmoid, ipo, hinge, exo_pair, .*, got 'ipx'"),
    (["objective=dpo", "objective.beta=0"], r"objective.beta must be > 0, got 0"),
    (["objective=dpo", "objective.beta=-0.1"], r"objective.beta must be > 0"),
    (["objective=dpo", "objective.label_smoothing=0.5"], r"objective.label_smoothing must be in \[0, 0.5\)"),
    (["objective=dpo", "objective.loss_type=ipo", "objective.label_smoothing=0.1"],
     r"objective.label_smoothing only applies to objective.loss_type=sigmoid\|robust\|exo_pair\|aot\|aot_unpaired, not ipo"),
    (["objective=dpo", "objective.sft_weight=-1"], r"objective.sft_weight must be >= 0"),
    (["objective=dpo", "objective.reference=cached"], r"objective.reference must be one of copy, adapter, precomputed"),
    (["objective=dpo", "objective.reference=adapter"], r"objective.reference=adapter needs a LoRA model"),
    (["optim.scheduler=cosin"], r"optim.scheduler must be one of cosine, linear, constant, got 'cosin'"),
    (["strategy.name=deepspeed"], r"strategy.name must be one of single, ddp, fsdp"),
    (["data.on_error=ignore"], r"data.on_error must be one of raise, skip"),
    (["model.attn_implementation=flash"], r"model.attn_implementation must be one of"),
    (["model.kernels=triton"], r"model.kernels must be one of none, liger"),
    (["model.quantization.load_in_4bit=true"], r"load_in_4bit=true \(QLoRA\) needs model.peft.enabled=true"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_value_is_refused_naming_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_train_config(compose_train(overrides))


@pytest.mark.parametrize("overrides", [
    ["objective=dpo", "objective.loss_type=ipo"],
    ["objective=dpo", "objective.loss_type=hinge", "objective.reference=precomputed"],
    ["objective=dpo", "objective.reference=adapter", "model.peft.enabled=true"],
    ["objective=dpo", "objective.label_smoothing=0.1"],
    ["optim.scheduler=constant", "strategy=ddp", "data.on_error=skip"],
    ["model.peft.enabled=true", "model.quantization.load_in_4bit=true"],
])
def test_good_values_pass(overrides: list[str]) -> None:
    check_train_config(compose_train(overrides))


def test_paper_recipes_pass_the_checks() -> None:
    for name in ("rolemrc_llama_sft", "rolemrc_llama_dpo", "rolemrc_qwen_sft", "rolemrc_qwen_dpo"):
        check_train_config(compose_train([f"experiment={name}"]))


def test_train_py_refuses_before_loading_anything(tmp_path) -> None:
    """Through the entry script: exit 1, one ``error:`` line naming the key, and the run wrote
    no data report (no data was read) and no checkpoint."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "objective=dpo", "objective.loss_type=ipx", "logger=none",
         f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert errors == [f"error: objective.loss_type must be one of {', '.join(LOSS_TYPES)}, got 'ipx'"], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not list(run_dir.glob("data_report_*.json")) and not (run_dir / "checkpoints").exists()
