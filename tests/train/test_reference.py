"""DPO reference log-probs come from the initial weights, always: a precomputed run resumed in
another folder (its cache gone) continues the uninterrupted run step for step, writes no cache
from trained weights (a shared cache stays right for later runs), and refuses when it could only
recompute from them; the precomputed pass runs under the training precision; the adapter
reference runs in eval mode."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from rolemrc.config import TrainStep
from rolemrc.data.datamodule import ChatDataModule
from rolemrc.data.templates import ChatFormat
from rolemrc.models.loading import load_model, load_tokenizer
from rolemrc.run.build import build_module
from rolemrc.run.train import run
from tests.train.helpers import series

ARGS = ["objective=dpo", "objective.reference=precomputed", "data.max_length=128", "data.max_prompt_length=96",
        "data.val_fraction=0", "data.batch_size=4", "optim.lr=5e-3", "optim.warmup_ratio=0", "trainer.max_steps=6",
        "trainer.max_epochs=5", "callbacks=default", "runtime.checkpoint_every_n_steps=1", "export.enabled=false"]
STOP = ["+callbacks.stop._target_=tests.train.test_loss_normalisation.StopAt", "+callbacks.stop.step=3"]


def in_dir(cfg, path: Path):
    cfg.run_dir = str(path)
    return cfg


def test_precomputed_resume_in_another_folder_continues_exactly(train_cfg, tmp_path: Path) -> None:
    run(in_dir(train_cfg(*ARGS), tmp_path / "whole"))
    with pytest.raises(RuntimeError, match="stopped at step 3"):
        run(in_dir(train_cfg(*ARGS, *STOP), tmp_path / "first"))
    shutil.rmtree(tmp_path / "first" / "ref_cache")  # another machine, a cleaned scratch folder
    ckpt = tmp_path / "first" / "checkpoints" / "last.ckpt"
    run(in_dir(train_cfg(*ARGS, f"ckpt_path={ckpt}"), tmp_path / "second"))
    for key in ("train/loss", "train/rewards/chosen", "train/rewards/rejected"):
        whole = series(tmp_path / "whole", key)
        assert series(tmp_path / "second", key) == pytest.approx(whole[3:], abs=1e-5), key
    assert not (tmp_path / "second" / "ref_cache").exists(), "nothing computed from the trained weights"


def test_resume_without_tables_or_cache_is_refused(train_cfg, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="stopped at step 3"):
        run(in_dir(train_cfg(*ARGS, *STOP), tmp_path / "first"))
    ckpt = tmp_path / "first" / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    state.pop("reference_logps", None)  # as a checkpoint written before the tables travelled with it
    torch.save(state, ckpt)
    shutil.rmtree(tmp_path / "first" / "ref_cache")
    with pytest.raises(RuntimeError, match="cannot be recomputed"):
        run(in_dir(train_cfg(*ARGS, f"ckpt_path={ckpt}"), tmp_path / "second"))
    assert not (tmp_path / "second" / "ref_cache").exists()


def test_resumed_run_leaves_a_shared_cache_right(train_cfg, tmp_path: Path) -> None:
    """The cache key is the initial weights: a resume (cache file gone) must not store log-probs of
    trained weights under it, or every later run sharing the cache trains against them."""
    cache = f"objective.reference_cache_dir={tmp_path / 'cache'}"
    run(in_dir(train_cfg(*ARGS), tmp_path / "whole"))
    with pytest.raises(RuntimeError, match="stopped at step 3"):
        run(in_dir(train_cfg(*ARGS, *STOP, cache), tmp_path / "first"))
    shutil.rmtree(tmp_path / "cache")
    run(in_dir(train_cfg(*ARGS, cache, f"ckpt_path={tmp_path / 'first' / 'checkpoints' / 'last.ckpt'}"),
               tmp_path / "second"))
    run(in_dir(train_cfg(*ARGS, cache), tmp_path / "later"))  # a fresh run, reading the cache if there is one
    assert series(tmp_path / "later", "train/rewards/chosen")[0] == pytest.approx(0.0, abs=1e-6)
    assert series(tmp_path / "later", "train/loss") == pytest.approx(series(tmp_path / "whole", "train/loss"), abs=1e-5)


def test_resume_with_tables_of_other_rows_is_refused(train_cfg, tmp_path: Path) -> None:
    """The checkpoint's tables are indexed by row: resumed on differently encoded pairs (here
    shorter prompts), they are not used."""
    with pytest.raises(RuntimeError, match="stopped at step 3"):
        run(in_dir(train_cfg(*ARGS, *STOP), tmp_path / "first"))
    shutil.rmtree(tmp_path / "first" / "ref_cache")
    ckpt = tmp_path / "first" / "checkpoints" / "last.ckpt"
    with pytest.raises(RuntimeError, match="cannot be recomputed"):
        run(in_dir(train_cfg(*ARGS, "data.max_prompt_length=48", f"ckpt_path={ckpt}"), tmp_path / "second"))


def test_precomputed_pass_runs_under_the_training_precision(train_cfg, tmp_path: Path) -> None:
    """bf16-mixed: the reference pass autocasts like the policy's forward, so at step 0 policy and
    reference agree (rewards 0, loss log 2)."""
    run(in_dir(train_cfg(*ARGS, "trainer.max_steps=1", "trainer.precision=bf16-mixed"), tmp_path / "bf16"))
    assert series(tmp_path / "bf16", "train/rewards/chosen")[0] == pytest.approx(0.0, abs=1e-6)
    assert series(tmp_path / "bf16", "train/loss")[0] == pytest.approx(math.log(2), abs=1e-6)


def test_adapter_reference_runs_without_dropout(train_cfg) -> None:
    cfg = train_cfg("objective=dpo", "objective.reference=adapter", "data.max_length=128", "data.max_prompt_length=96",
                    "data.val_fraction=0", "model.peft.enabled=true", "model.peft.dropout=0.5",
                    "+model.init.attention_dropout=0.5")
    tok = load_tokenizer(cfg.model)
    dm = ChatDataModule(cfg.data, "pairs", ChatFormat(tok))
    dm.setup()
    module = build_module(TrainStep.of(cfg), load_model(cfg.model, tok), dm, run_dir=str(cfg.run_dir))
    batch = dm.collator()(dm.train_rows[:4])
    module.model.train()
    a, b = module.reference_logps(batch, "train"), module.reference_logps(batch, "train")
    assert module.model.training, "the policy's mode is restored"
    module.model.eval()
    with torch.no_grad(), module.model.disable_adapter():
        base = module.pair_logps(module.model, batch).logps
    assert torch.equal(a, b) and torch.allclose(a, base)
