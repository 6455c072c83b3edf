"""DPO on the sample pairs with every reference mode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rolemrc.config import TrainStep
from rolemrc.data.datamodule import ChatDataModule
from rolemrc.data.templates import ChatFormat
from rolemrc.models.loading import count_parameters, load_model, load_tokenizer
from rolemrc.modules.dpo import DPOModule
from rolemrc.run.build import build_module
from rolemrc.run.train import fit, run, setup
from tests.train.helpers import series

DPO = ["objective=dpo", "data.max_length=160", "data.max_prompt_length=96", "trainer.max_epochs=50",
       "data.val_fraction=0", "export.enabled=false", "optim.warmup_ratio=0"]
LORA = ["model.peft.enabled=true", "model.peft.r=16", "model.peft.alpha=32",
        "model.peft.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"]


def train_pair_accuracy(module: DPOModule, dm) -> tuple[float, float]:
    """Reward accuracy and mean margin over every training pair, after training."""
    module.eval()
    correct, margins = [], []
    with torch.no_grad():
        for batch in dm.train_dataloader():
            b = batch["index"].shape[0]
            policy = module.pair_logps(module.model, batch).logps
            ref = module.reference_logps(batch, "train")
            beta = module.objective.beta
            chosen, rejected = beta * (policy[:b] - ref[:b]), beta * (policy[b:] - ref[b:])
            correct.append((chosen > rejected).float())
            margins.append(chosen - rejected)
    return torch.cat(correct).mean().item(), torch.cat(margins).mean().item()


@pytest.mark.parametrize("mode", ["copy", "precomputed", "adapter"])
def test_each_reference_mode_learns_the_preferences(train_cfg, mode: str) -> None:
    # LoRA adapters learn through fewer parameters: a higher lr and more steps.
    steps, extra = (40, LORA + ["optim.lr=2e-2"]) if mode == "adapter" else (25, ["optim.lr=3e-3"])
    parts = setup(train_cfg(*DPO, f"objective.reference={mode}", f"trainer.max_steps={steps}", *extra))
    out = fit(parts)
    run_dir = Path(out["run_dir"])
    margins = series(run_dir, "train/rewards/margins")
    assert len(margins) == steps
    assert sum(margins[-5:]) / 5 > sum(margins[:5]) / 5 + 0.2, margins
    accuracy, margin = train_pair_accuracy(parts.module, parts.datamodule)
    assert accuracy > 0.9, f"{mode}: reward accuracy on training pairs {accuracy:.2f}"
    assert margin > 0


def test_precomputed_and_copy_agree_on_first_step(train_cfg, tmp_path: Path) -> None:
    losses = {}
    for mode in ("copy", "precomputed"):
        out = run(train_cfg(*DPO, f"objective.reference={mode}", "trainer.max_steps=2",
                            f"objective.reference_cache_dir={tmp_path / 'cache'}"))
        losses[mode] = series(Path(out["run_dir"]), "train/loss")
        chosen = series(Path(out["run_dir"]), "train/rewards/chosen")
        assert chosen[0] == pytest.approx(0.0, abs=1e-5)  # policy == reference at step 0
    assert losses["copy"][0] == pytest.approx(losses["precomputed"][0], abs=1e-6)
    assert losses["copy"][1] == pytest.approx(losses["precomputed"][1], abs=1e-4)


def test_precomputed_cache_is_reused_and_invalidated(train_cfg, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    common = [*DPO, "objective.reference=precomputed", "trainer.max_steps=1", f"objective.reference_cache_dir={cache}"]
    run(train_cfg(*common))
    files = sorted(cache.glob("*.safetensors"))
    assert len(files) == 1
    stamp = files[0].stat().st_mtime_ns
    run(train_cfg(*common))  # same model, data, template: read from the cache
    assert sorted(cache.glob("*.safetensors")) == files and files[0].stat().st_mtime_ns == stamp
    run(train_cfg(*common, "data.max_prompt_length=64"))  # different encoded data
    assert len(list(cache.glob("*.safetensors"))) == 2
    run(train_cfg(*common, "seed=7"))  # different initial weights
    assert len(list(cache.glob("*.safetensors"))) == 3


def test_adapter_mode_holds_no_second_copy(train_cfg) -> None:
    sizes = {}
    for mode, extra in (("adapter", LORA), ("copy", [])):
        cfg = train_cfg(*DPO, f"objective.reference={mode}", *extra)
        tok = load_tokenizer(cfg.model)
        dm = ChatDataModule(cfg.data, "pairs", ChatFormat(tok))
        module = build_module(TrainStep.of(cfg), load_model(cfg.model, tok), dm, run_dir=str(cfg.run_dir))
        held = {id(p): p.numel() for p in module.model.parameters()}
        if module.ref_model is not None:
            held |= {id(p): p.numel() for p in module.ref_model.parameters()}
        sizes[mode] = (sum(held.values()), count_parameters(module.model)[1])
    adapter_held, adapter_model = sizes["adapter"]
    copy_held, copy_model = sizes["copy"]
    assert adapter_held == adapter_model  # reference = same weights, adapter switched off
    assert copy_held == 2 * copy_model
    assert adapter_held < 1.5 * copy_model


def test_adapter_mode_without_lora_fails_early(train_cfg) -> None:
    with pytest.raises(ValueError, match="peft.enabled=true"):
        run(train_cfg(*DPO, "objective.reference=adapter"))


def test_share_prompt_must_match_the_datamodule_layout(train_cfg) -> None:
    cfg = train_cfg(*DPO, "objective.share_prompt=true")
    tok = load_tokenizer(cfg.model)
    with pytest.raises(ValueError, match="objective.share_prompt=True but the datamodule lays pairs out"):
        build_module(TrainStep.of(cfg), load_model(cfg.model, tok), ChatDataModule(cfg.data, "pairs", ChatFormat(tok)),
                     run_dir=str(cfg.run_dir))
    shared = ChatDataModule(cfg.data, "pairs", ChatFormat(tok), share_prompt=True)
    assert build_module(TrainStep.of(cfg), load_model(cfg.model, tok), shared, run_dir=str(cfg.run_dir)).packs_with_context()


def test_ipo_rewards_mean_what_trls_mean_and_per_token_ones_have_their_own_names(train_cfg) -> None:
    """TRL logs rewards/* = beta * (policy - reference) of the SUMMED log-probs for every loss type
    (also IPO, whose loss compares length-averaged ones). The length-averaged rewards are logged
    as rewards_per_token/* (IPO only), never under TRL's names."""
    parts = setup(train_cfg(*DPO, "objective.loss_type=ipo", "trainer.max_steps=3", "optim.lr=3e-3"))
    out = fit(parts)
    module, beta = parts.module, parts.module.objective.beta
    module.eval()
    batch = next(iter(parts.datamodule.train_dataloader()))
    b = batch["index"].shape[0]
    with torch.no_grad():
        terms = module.pair_terms(batch, "train")
        policy, counts = module.pair_logps(module.model, batch)
        ref = module.reference_logps(batch, "train")
    trl_chosen, trl_rejected = beta * (policy[:b] - ref[:b]), beta * (policy[b:] - ref[b:])  # TRL's rewards
    assert torch.allclose(terms["rewards/chosen"], trl_chosen) and torch.allclose(terms["rewards/rejected"], trl_rejected)
    assert torch.allclose(terms["rewards/margins"], trl_chosen - trl_rejected)
    per_chosen = beta * (policy[:b] / counts[:b] - ref[:b] / counts[:b])
    per_rejected = beta * (policy[b:] / counts[b:] - ref[b:] / counts[b:])
    assert torch.allclose(terms["rewards_per_token/chosen"], per_chosen, atol=1e-6)
    assert torch.allclose(terms["rewards_per_token/margins"], per_chosen - per_rejected, atol=1e-6)
    assert not torch.allclose(terms["rewards/chosen"], terms["rewards_per_token/chosen"])  # a different quantity
    run_dir = Path(out["run_dir"])
    assert len(series(run_dir, "train/rewards/chosen")) == 3 and len(series(run_dir, "train/rewards_per_token/chosen")) == 3
    # Other losses log no per-token rewards, and the same rewards/* (summed log-probs).
    module.objective.loss_type = "sigmoid"
    with torch.no_grad():
        sig = module.pair_terms(batch, "train")
    assert not any(k.startswith("rewards_per_token/") for k in sig) and "rewards_per_token/chosen" not in module.val_columns
    assert torch.allclose(sig["rewards/chosen"], terms["rewards/chosen"])
