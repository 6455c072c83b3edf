"""A new objective is its schema, its module and one registry line (rolemrc.config.OBJECTIVES):
nothing in build.py or train.py changes for it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from omegaconf import OmegaConf, open_dict

from rolemrc.config import OBJECTIVES, Objective, ObjectiveConfig, check_train_config
from rolemrc.errors import ConfigError
from rolemrc.modules.sft import SFTModule
from rolemrc.train import fit, setup
from tests.train.helpers import series


@dataclass
class ToyObjectiveConfig(ObjectiveConfig):
    """A toy objective: the SFT loss times ``scale`` (its own key, checked by its own schema)."""

    name: str = "toy"
    scale: float = 0.5

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ConfigError(f"objective.scale must be > 0, got {self.scale}")


class ToyModule(SFTModule):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * self.objective.scale


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(OBJECTIVES, "toy", Objective(ToyObjectiveConfig, f"{__name__}:ToyModule", pairs=False))


def with_objective(cfg, node) -> None:
    with open_dict(cfg):
        cfg.objective = node


def test_a_registered_objective_trains_through_the_builders(toy, train_cfg) -> None:
    cfg = train_cfg("trainer.max_steps=2", "export.enabled=false")
    with_objective(cfg, OmegaConf.structured(ToyObjectiveConfig(scale=0.25)))
    run = setup(cfg)
    assert type(run.module) is ToyModule and run.module.objective == ToyObjectiveConfig(scale=0.25)
    assert run.datamodule.kind == "sft"  # pairs=False: conversations
    fit(run)
    assert len(series(run.cfg.run_dir, "train/loss")) == 2


def test_its_schema_checks_its_keys_before_anything_loads(toy, train_cfg) -> None:
    cfg = train_cfg()
    node = OmegaConf.structured(ToyObjectiveConfig)
    node.scale = -1.0
    with_objective(cfg, node)
    with pytest.raises(ConfigError, match=r"objective.scale must be > 0, got -1.0"):
        check_train_config(cfg)


def test_an_unregistered_objective_is_named(train_cfg) -> None:
    cfg = train_cfg()
    with_objective(cfg, OmegaConf.create({"name": "toy"}))
    with pytest.raises(ConfigError, match=r"objective.name must be one of \['dpo', 'sft'\], got 'toy'"):
        check_train_config(cfg)
