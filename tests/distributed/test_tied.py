"""Tied embeddings (one parameter for embed_tokens and lm_head, as in Qwen2.5 <= 3B) stay tied
when training (DPO) single-process and under FSDP2: both make the same update,
and the export loads in plain transformers, tied, computing what the trained weights compute."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rolemrc.checkpointing import read_model_state
from tests.conftest import ROOT
from tests.train.helpers import series, train_in_process

# Both tests read one FSDP run (whole): on one xdist worker, so it is made once.
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.xdist_group("tied")]

ARGS = ["model=tiny_qwen", "model.init.tie_word_embeddings=true", "data.max_length=96", "data.val_fraction=0",
        "trainer.max_steps=3", "data.batch_size=2", "optim.lr=1e-2", "optim.warmup_ratio=0",
        "runtime.checkpoint_every_n_steps=3", "trainer.enable_progress_bar=false", "trainer.accelerator=cpu"]


def train(run_dir: Path, devices: int, *overrides: str, ok: bool = True) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "train.py", *ARGS, f"trainer.devices={devices}", f"hydra.run.dir={run_dir}",
                           *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert (proc.returncode == 0) == ok, proc.stderr[-4000:]


# DPO with the reference's log-probs precomputed: the tied parameter trains through both its uses.
DPO = ["objective=dpo", "objective.reference=precomputed", "data.max_prompt_length=64", "trainer.max_steps=4",
       "runtime.checkpoint_every_n_steps=2"]
FSDP = ["strategy=fsdp", "strategy.param_dtype=null"]


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted FSDP2 run on 2 ranks (batch 2 each), shared by both tests below; it keeps
    its step-2 checkpoint (``epoch=0-step=2.ckpt``) beside ``last.ckpt``."""
    run_dir = tmp_path_factory.mktemp("tied") / "whole"
    train(run_dir, 2, *DPO, *FSDP, "callbacks.checkpoint.save_top_k=-1")
    return run_dir


def test_tied_embeddings_stay_tied_under_every_strategy(whole: Path, tmp_path: Path) -> None:
    # (DDP replicates the module as it is, ties included; its update equals a single process's,
    # tests/train/test_loss_normalisation.py.) The single-process run (batch 4) is made here, in-process.
    runs = {"single": train_in_process(tmp_path / "single", *ARGS, "trainer.devices=1", *DPO, "data.batch_size=4",
                                       "logger=csv"),
            "fsdp": whole}
    exports = {}
    ids = torch.tensor([[5, 17, 42, 7, 99, 3]])
    for name, run_dir in runs.items():
        export = run_dir / "export"
        model = AutoModelForCausalLM.from_pretrained(export)
        assert model.config.tie_word_embeddings
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), name
        # The trained weights (the checkpoint) and the export compute the same logits.
        state = read_model_state(run_dir / "checkpoints" / "last.ckpt")
        trained = AutoModelForCausalLM.from_pretrained(export)
        trained.load_state_dict(state, strict=False)  # the checkpoint's own embed_tokens and lm_head
        assert torch.equal(state["model.embed_tokens.weight"], state["lm_head.weight"]), name
        with torch.no_grad():
            assert torch.allclose(model(ids).logits, trained(ids).logits, atol=1e-6), name
        exports[name] = load_file(export / "model.safetensors")
    # One tied parameter trained by both its uses: the same update everywhere, float noise apart
    # (the update itself moves every tensor by more than 100x that noise bound).
    start = load_file(train_in_process(tmp_path / "start", *ARGS, "trainer.devices=1", "trainer.max_steps=0",
                                       "logger=csv") / "export" / "model.safetensors")
    for name in ("fsdp",):
        for k, v in exports["single"].items():
            assert (v - start[k]).norm() > 1e-2 * v.norm(), k
            assert (exports[name][k] - v).norm() <= 1e-4 * v.norm(), (name, k)


def test_fsdp_tied_precomputed_dpo_resumed_elsewhere_follows_the_uninterrupted_run(whole: Path,
                                                                                  tmp_path: Path) -> None:
    """FSDP2 restores checkpoints after on_fit_start: the tables still come from the initial
    weights (or the checkpoint), and a run resumed in another folder (no reference cache there)
    from the step-2 checkpoint logs the same rewards step by step."""
    (step2,) = (whole / "checkpoints").glob("*step=2.ckpt")
    assert step2.is_dir() and (step2 / ".metadata").is_file()  # sharded, as FSDP2 writes it
    resume = f'ckpt_path="{step2}"'  # quoted: the name holds '='
    train(tmp_path / "second", 2, *DPO, "export.enabled=false", *FSDP, resume)
    for key in ("train/loss", "train/rewards/chosen", "train/rewards/margins"):
        expected = series(whole, key)
        assert series(tmp_path / "second", key) == pytest.approx(expected[2:], abs=1e-5), key
