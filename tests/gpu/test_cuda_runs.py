"""Training runs on the CUDA device (tiny model, sample data, in-process): FSDP2 on one device
against no FSDP, one step of each DPO reference mode, a checkpoint resumed against the
uninterrupted run, and Liger's kernels against the plain model where liger-kernel is present."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.gpu.conftest import DEVICE, ON_DEVICE
from tests.gpu.helpers import probe, steps
from tests.train.helpers import series, train_in_process

BASE = [*ON_DEVICE, "trainer.enable_progress_bar=false", "callbacks=none", "logger=csv", "data.max_length=192",
        "data.max_prompt_length=128", "data.val_fraction=0", "data.batch_size=4", "export.enabled=false",
        "optim.warmup_ratio=0", "trainer.precision=32-true"]


def _run(out: Path, *overrides: str) -> list[dict]:
    train_in_process(out, *BASE, *overrides, *probe(out / "probe.jsonl"))
    seen = steps(out / "probe.jsonl")
    assert all(s["device"].startswith(DEVICE) for s in seen), seen
    return seen


def test_fsdp2_on_one_device_matches_no_fsdp(tmp_path: Path) -> None:
    """strategy=fsdp (FSDP2 fully_shard over a 1-device mesh) trains as strategy=single: the same
    losses and gradient norms for 3 steps (fp32)."""
    common = ["data.packing=true", "trainer.max_steps=3"]
    single = _run(tmp_path / "single", "strategy=single", *common)
    fsdp = _run(tmp_path / "fsdp", "strategy=fsdp", *common)
    assert len(single) == len(fsdp) == 3
    # The first step's gradient is the same computation; after one AdamW update (its first step
    # moves every weight by ~lr whatever the gradient's size, so rounding-level differences of tiny
    # gradients move weights too) the runs agree to rounding amplified by that update.
    assert fsdp[0]["loss"] == pytest.approx(single[0]["loss"], rel=2e-5)
    assert fsdp[0]["grad_norm"] == pytest.approx(single[0]["grad_norm"], rel=1e-3)
    for a, b in zip(single[1:], fsdp[1:]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=2e-2), (a, b)
    assert single[-1]["loss"] < single[0]["loss"]  # it trained


@pytest.mark.parametrize("reference", ["copy", "adapter", "precomputed"])
def test_dpo_reference_modes_step(reference: str, tmp_path: Path) -> None:
    """Two DPO steps with each reference (a frozen copy, the LoRA policy with its adapter off,
    log-probs precomputed before training): the first step's policy is its reference (loss log 2,
    zero rewards), the second's is not, and every figure is finite."""
    lora = ["model.peft.enabled=true", "model.peft.dropout=0", "optim.lr=5e-2"] if reference == "adapter" else []
    run_dir = tmp_path / reference
    seen = _run(run_dir, "objective=dpo", f"objective.reference={reference}", "objective.share_prompt=true",
                "trainer.max_steps=2", *lora)
    assert len(seen) == 2 and all(math.isfinite(s["loss"]) and s["grad_norm"] > 0 for s in seen)
    assert seen[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert series(run_dir, "train/rewards/chosen")[0] == pytest.approx(0.0, abs=1e-5)
    assert seen[1]["loss"] != pytest.approx(math.log(2), abs=1e-5)


def test_precomputed_reference_equals_copy(tmp_path: Path) -> None:
    """Reference log-probs precomputed on the device give the copy reference's losses step for step."""
    args = ["objective=dpo", "objective.share_prompt=true", "trainer.max_steps=3"]
    copy = _run(tmp_path / "copy", *args, "objective.reference=copy")
    pre = _run(tmp_path / "pre", *args, "objective.reference=precomputed")
    assert [s["loss"] for s in pre] == pytest.approx([s["loss"] for s in copy], abs=1e-5)


def test_checkpoint_resume_continues_the_uninterrupted_run(tmp_path: Path) -> None:
    """A run stopped after step 3 and resumed from its CUDA checkpoint (model, AdamW states, the
    sampler's place, RNG states) logs the uninterrupted run's losses for steps 4-6."""
    args = ["data.packing=true", "trainer.max_steps=6", "trainer.max_epochs=5", "callbacks=default",
            "runtime.checkpoint_every_n_steps=1", "optim.lr=5e-3"]
    whole = tmp_path / "whole"
    train_in_process(whole, *BASE, *args)
    parts = tmp_path / "parts"
    with pytest.raises(RuntimeError, match="stopped at step 3"):
        train_in_process(parts, *BASE, *args, "+callbacks.stop._target_=tests.train.test_loss_normalisation.StopAt",
                         "+callbacks.stop.step=3")
    assert (parts / "checkpoints" / "last.ckpt").is_file()
    train_in_process(parts, *BASE, *args, "ckpt_path=last")
    full, resumed = series(whole, "train/loss"), series(parts, "train/loss")
    assert len(full) == 6 and len(resumed) == 6  # the resumed run appends steps 4-6 to the same CSV
    # fp32; the same kernels on the same inputs (CUDA's attention backward may sum in another order)
    assert resumed[3:] == pytest.approx(full[3:], rel=1e-5, abs=1e-5)


def test_liger_kernels_match_plain_model(tmp_path: Path) -> None:
    """model.kernels=liger (fused RMSNorm, RoPE, SwiGLU and linear cross-entropy) trains as the plain
    model: the same losses for 3 steps within the fused kernels' fp32 tolerance."""
    from rolemrc.models.kernels import liger_available

    if not liger_available():
        pytest.skip("liger-kernel is not installed here (make gpu-wheels carries it)")
    args = ["data.packing=true", "trainer.max_steps=3"]
    plain = _run(tmp_path / "plain", *args, "model.kernels=none")
    liger = _run(tmp_path / "liger", *args, "model.kernels=liger")
    assert [s["loss"] for s in liger] == pytest.approx([s["loss"] for s in plain], rel=1e-3)
    assert [s["grad_norm"] for s in liger] == pytest.approx([s["grad_norm"] for s in plain], rel=1e-2)
