"""A new preference objective plugged in from outside rolemrc: its loss function, its settings
(schema), its module and its registry entry live in a package of their own (written here into a
temporary folder on ``sys.path``); it trains, resumes and is sized through the objective contract
(rolemrc.modules.base.PairModule / PolicyModule, rolemrc.config.ObjectiveConfig) with no rolemrc
file touched."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf, open_dict

from rolemrc.config import OBJECTIVES
from rolemrc.run.train import fit, setup
from tests.train.helpers import series

PACKAGE = '''
from dataclasses import dataclass

import torch

from rolemrc.config import Objective, PairObjectiveConfig
from rolemrc.modules.base import PairModule, reward_terms
from rolemrc.objectives.dpo import DPOOutput, average_logps


def margin_loss(chosen, rejected, chosen_tokens, rejected_tokens, *, beta, margin):
    """A hinge on the length-averaged log-probs: relu(margin - beta * (a_w - a_l)) per pair."""
    a_w, a_l = average_logps(chosen, chosen_tokens), average_logps(rejected, rejected_tokens)
    return DPOOutput(torch.relu(margin - beta * (a_w - a_l)), beta * a_w.detach(), beta * a_l.detach(), a_w - a_l)


@dataclass
class MarginConfig(PairObjectiveConfig):
    name: str = "margin"
    margin: float = 1.0


class MarginModule(PairModule):
    pair_metrics = ("rewards/chosen", "rewards/margins")
    steps = 0  # pair_terms calls in training steps: the simulation runs this step too

    def pair_terms(self, batch, stage):
        type(self).steps += stage == "train"
        b = batch["index"].shape[0]
        logps, counts = self.pair_logps(self.model, batch)
        out = margin_loss(logps[:b], logps[b:], counts[:b], counts[b:], beta=self.objective.beta,
                          margin=self.objective.margin)
        return {**reward_terms(out, logps, counts), "chosen_sum": logps[:b], "chosen_tokens": counts[:b]}


ENTRY = Objective(MarginConfig, "margin_objective:MarginModule", data="pairs")
'''

PAIRS = ["optim.scheduler=constant", "data.max_length=96", "data.max_prompt_length=48", "data.batch_size=2", "export.enabled=false"]


@pytest.fixture
def margin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The plug-in package, importable and registered as objective ``margin``."""
    (tmp_path / "plugin").mkdir()
    (tmp_path / "plugin" / "margin_objective.py").write_text(PACKAGE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path / "plugin"))
    package = importlib.import_module("margin_objective")
    monkeypatch.setitem(OBJECTIVES, "margin", package.ENTRY)
    yield package
    sys.modules.pop("margin_objective", None)


def margin_cfg(train_cfg, package, run_dir: Path, *overrides: str):
    cfg = train_cfg(*PAIRS, *overrides)
    with open_dict(cfg):
        cfg.objective = OmegaConf.structured(package.MarginConfig(beta=0.5, margin=2.0))
        cfg.run_dir = str(run_dir)
    return cfg


def test_a_plugged_in_preference_objective_trains_resumes_and_is_sized(margin, train_cfg, tmp_path: Path) -> None:
    from tests.test_memory_sim import simulate

    every_step = ["runtime.checkpoint_every_n_steps=1"]
    whole = setup(margin_cfg(train_cfg, margin, tmp_path / "whole", "trainer.max_steps=3", *every_step))
    assert type(whole.module).__name__ == "MarginModule" and whole.module.reference is None
    assert whole.datamodule.kind == "pairs"
    fit(whole)
    losses = series(tmp_path / "whole", "train/loss")
    assert len(losses) == 3 and len(series(tmp_path / "whole", "train/rewards/margins")) == 3
    assert len(series(tmp_path / "whole", "val/loss")) >= 1  # validation through the pair base

    fit(setup(margin_cfg(train_cfg, margin, tmp_path / "first", "trainer.max_steps=2", *every_step)))
    ckpt = tmp_path / "first" / "checkpoints" / "last.ckpt"
    fit(setup(margin_cfg(train_cfg, margin, tmp_path / "second", "trainer.max_steps=3", f"ckpt_path={ckpt}")))
    # resumed exactly (a constant schedule: max_steps does not change it)
    assert series(tmp_path / "second", "train/loss") == pytest.approx(losses[2:], abs=1e-5)

    before = margin.MarginModule.steps
    sim = simulate(margin_cfg(train_cfg, margin, tmp_path / "sim"), checkpointing=False)
    assert margin.MarginModule.steps - before == 2  # the warm-up step and the tracked one: its own step
    assert sim.rows == 2 * 2 and sim.tokens == 4 * 96 and sim.peak_bytes > 0  # chosen and rejected rows
