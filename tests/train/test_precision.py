"""The precision policy: trainable weights and AdamW states are fp32 masters under the recipes'
``model.dtype=bfloat16`` + ``trainer.precision=bf16-mixed``, so DPO's tiny steps (lr 4e-7) are not
rounded away; frozen weights stay in ``model.dtype``; the export is the masters rounded once."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from rolemrc.checkpointing import read_model_state
from rolemrc.models.precision import precision_policy
from rolemrc.run.train import run
from tests.conftest import ROOT

RECIPE = ["model.dtype=bfloat16", "trainer.precision=bf16-mixed"]
DPO = ["objective=dpo", "data.max_length=128", "data.max_prompt_length=96", "data.val_fraction=0",
       "optim.lr=4e-7", "optim.warmup_ratio=0", "optim.scheduler=constant", "trainer.max_steps=3",
       "data.batch_size=2", "callbacks=default", "runtime.checkpoint_every_n_steps=3"]


@pytest.fixture(scope="module")
def bf16_start(tmp_path_factory) -> Path:
    """A bf16 export of the tiny model, as the recipes start DPO from (an SFT export in bf16)."""
    from tests.conftest import FAST, compose_train

    out = run(compose_train([*FAST, "model.dtype=bfloat16", "trainer.max_steps=0", "data.val_fraction=0"],
                            run_dir=tmp_path_factory.mktemp("start") / "run"))
    return Path(out["export"])


def moved_fraction(state: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
    changed = total = 0
    for k, v in start.items():
        changed += (state[k].float() != v.float()).sum().item()
        total += v.numel()
    return changed / total


def check_masters(run_dir: Path, start: Path, ckpt: Path) -> None:
    state = read_model_state(ckpt)
    assert {v.dtype for v in state.values()} == {torch.float32}, "the checkpoint holds fp32 masters"
    begin = load_file(start / "model.safetensors")
    # DPO at lr 4e-7: bf16 masters keep ~0.4% of these steps; fp32 masters keep most of them.
    assert moved_fraction(state, begin) > 0.5
    export = load_file(run_dir / "export" / "model.safetensors")
    for k, v in export.items():  # the export: bf16, the masters rounded once
        assert v.dtype == torch.bfloat16
        assert torch.equal(v, state[k].to(torch.bfloat16)), k


def test_recipe_precision_trains_fp32_masters(train_cfg, bf16_start: Path) -> None:
    out = run(train_cfg(*RECIPE, *DPO, f"model.path={bf16_start}"))
    run_dir = Path(out["run_dir"])
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    check_masters(run_dir, bf16_start, ckpt)
    optim = torch.load(ckpt, map_location="cpu", weights_only=True)["optimizer_states"][0]["state"]
    dtypes = {t.dtype for s in optim.values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")}
    assert dtypes == {torch.float32}, "AdamW states are fp32"
    groups = torch.load(ckpt, map_location="cpu", weights_only=True)["optimizer_states"][0]["param_groups"]
    assert not groups[0]["fused"], "bf16-mixed keeps torch's default AdamW (the AMP plugin clips gradients)"


def test_fp32_cpu_run_steps_with_fused_adamw(train_cfg) -> None:
    """Plain CPU parameters outside AMP step with torch's fused AdamW (docs/performance.md: the
    default single-tensor loop cost up to ~10% of a packed proxy SFT step)."""
    out = run(train_cfg("trainer.max_steps=2", "data.val_fraction=0", "callbacks=default",
                        "runtime.checkpoint_every_n_steps=2"))
    ckpt = Path(out["run_dir"]) / "checkpoints" / "last.ckpt"
    groups = torch.load(ckpt, map_location="cpu", weights_only=True)["optimizer_states"][0]["param_groups"]
    assert groups[0]["fused"] is True


@pytest.mark.multiprocess
@pytest.mark.slow
def test_recipe_precision_under_fsdp2_dpo_then_export_and_load_as_model_path(tmp_path: Path, bf16_start: Path) -> None:
    """The recipe's shape: FSDP2 from model.path (a saved config with rope_parameters), bf16-mixed,
    DPO with its reference a copy of the policy, sharded like it."""
    from rolemrc.models.source import hf_model_path
    from tests import recorder

    run_dir = tmp_path / "fsdp"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "train.py", "trainer.accelerator=cpu", "trainer.devices=2", "strategy=fsdp",
         "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}", f"model.path={bf16_start}", *RECIPE, *DPO,
         "+callbacks.record._target_=tests.recorder.Recorder", f"+callbacks.record.path={run_dir}/record"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    assert ckpt.is_dir()
    check_masters(run_dir, bf16_start, ckpt)
    records = recorder.read(run_dir / "record", 0)
    assert records[0]["event"] == "start" and records[0]["local_params"] < records[0]["full_params"]  # sharded
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert abs(steps[0]["loss"] - 0.6931) < 1e-3  # policy == its sharded reference copy at the first step: log(2)

    # The rest of the recipe's flow from such a run: export.py on its sharded checkpoint gives the
    # run's own export, and model.path=<the checkpoint> (evaluate.py, probe.py, a DPO run) loads
    # those same weights (tests/train/test_checkpoint_as_model.py runs the scripts on one).
    again = tmp_path / "again"
    done = subprocess.run([sys.executable, "export.py", str(ckpt), "--out", str(again)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    a = load_file(run_dir / "export" / "model.safetensors")
    for folder in (again, Path(hf_model_path(str(ckpt)))):
        b = load_file(folder / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), folder


def test_policy_table() -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    assert precision_policy("bf16-mixed", "bfloat16") == (p := precision_policy("bf16-mixed", "bfloat16"))
    assert (p.master, p.frozen, p.compute) == (f32, bf16, bf16)
    p = precision_policy("32-true", "float32")
    assert (p.master, p.frozen, p.compute) == (f32, f32, f32)
    p = precision_policy("bf16-true", "float32")
    assert (p.master, p.frozen, p.compute) == (bf16, bf16, bf16)
    with pytest.raises(ValueError, match="trainer.precision"):
        precision_policy("8-mixed", "float32")


SEEN: list[torch.dtype] = []


def test_bf16_true_full_finetune_warns_and_its_reference_follows(train_cfg, caplog) -> None:
    caplog.set_level(logging.WARNING)
    SEEN.clear()
    run(train_cfg("objective=dpo", "trainer.precision=bf16-true", "data.max_length=128", "data.max_prompt_length=96",
                  "trainer.max_steps=1", "data.val_fraction=0", "export.enabled=false",
                  "+callbacks.probe._target_=tests.train.test_precision.DtypeProbe"))
    assert any("bf16-true" in r.getMessage() and "rounding step" in r.getMessage() for r in caplog.records)
    assert SEEN == [torch.bfloat16, torch.bfloat16]  # the reference copy is stored like the policy


class DtypeProbe(L.Callback):
    """Records the policy's and the reference copy's parameter dtypes when training starts."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        SEEN.extend([next(pl_module.model.parameters()).dtype, next(pl_module.ref_model.parameters()).dtype])
