"""The builders hand each LightningModule its typed parts (schema dataclasses, the precision
policy, the reference), never the whole config or the datamodule."""

from __future__ import annotations

import dataclasses

import pytest

from rolemrc.build import build_chat, build_model, build_module
from rolemrc.config import DPOObjectiveConfig, OptimConfig, SFTObjectiveConfig, StrategyConfig
from tests.conftest import compose_train


@pytest.mark.parametrize(("overrides", "objective_type"), [
    (["objective=sft"], SFTObjectiveConfig),
    (["objective=dpo", "objective.beta=0.2"], DPOObjectiveConfig),
])
def test_modules_receive_typed_parts(overrides: list[str], objective_type: type) -> None:
    cfg = compose_train(overrides)
    chat = build_chat(cfg.model)
    module = build_module(cfg, build_model(cfg.model, chat.tokenizer))
    assert type(module.objective) is objective_type and dataclasses.is_dataclass(module.objective)
    assert type(module.optim) is OptimConfig and module.optim.lr == cfg.optim.lr
    assert module.sharding is None  # single device: nothing to shard
    assert not hasattr(module, "cfg") and not hasattr(module, "datamodule")
    if objective_type is DPOObjectiveConfig:
        assert module.objective.beta == 0.2 and module.reference.mode == cfg.objective.reference


def test_fsdp_modules_receive_the_strategy_options() -> None:
    cfg = compose_train(["strategy=fsdp", "strategy.cpu_offload=true"])
    chat = build_chat(cfg.model)
    module = build_module(cfg, build_model(cfg.model, chat.tokenizer))
    assert type(module.sharding) is StrategyConfig and module.sharding.cpu_offload is True


@pytest.mark.parametrize(("device_gb", "simulate", "expected"), [(80, False, False), (0.0001, True, True)])
def test_setup_resolves_auto_checkpointing(train_cfg, caplog, device_gb: float, simulate: bool,
                                           expected: bool) -> None:
    """setup() turns model.gradient_checkpointing=auto into the estimate's choice before the model
    is built: the tiny model fits an 80 GB device (off, by the formula) and not a 100 kB one (on,
    by the simulated step; the simulation itself: tests/test_memory_sim.py)."""
    import logging

    from rolemrc.train import setup

    cfg = train_cfg("model.gradient_checkpointing=auto", f"runtime.device_memory_gb={device_gb}",
                    f"runtime.simulate_memory={str(simulate).lower()}")
    with caplog.at_level(logging.INFO, logger="rolemrc.memory"):
        run = setup(cfg)
    assert run.cfg.model.gradient_checkpointing is expected
    assert run.module.model.is_gradient_checkpointing is expected
    assert f"activation checkpointing: {'on' if expected else 'off'}, auto: " in caplog.text
    assert ("simulated per-rank peak" in caplog.text) is simulate
