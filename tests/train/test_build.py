"""The builders hand each LightningModule its typed parts (schema dataclasses, the precision
policy, the reference), never the whole config or the datamodule."""

from __future__ import annotations

import dataclasses

import pytest

from rolemrc.run.build import build_chat, build_model, build_module
from rolemrc.config import DPOObjectiveConfig, OptimConfig, SFTObjectiveConfig, StrategyConfig, TrainStep
from tests.conftest import compose_train


@pytest.mark.parametrize(("overrides", "objective_type"), [
    (["objective=sft"], SFTObjectiveConfig),
    (["objective=dpo", "objective.beta=0.2"], DPOObjectiveConfig),
])
def test_modules_receive_typed_parts(overrides: list[str], objective_type: type) -> None:
    cfg = compose_train(overrides)
    chat = build_chat(cfg.model)
    module = build_module(TrainStep.of(cfg), build_model(cfg.model, chat.tokenizer), run_dir=str(cfg.run_dir))
    assert type(module.objective) is objective_type and dataclasses.is_dataclass(module.objective)
    assert type(module.optim) is OptimConfig and module.optim.lr == cfg.optim.lr
    assert module.sharding is None  # single device: nothing to shard
    assert not hasattr(module, "cfg") and not hasattr(module, "datamodule")
    if objective_type is DPOObjectiveConfig:
        assert module.objective.beta == 0.2 and module.reference.mode == cfg.objective.reference


def test_fsdp_modules_receive_the_strategy_options() -> None:
    cfg = compose_train(["strategy=fsdp", "strategy.cpu_offload=true"])
    chat = build_chat(cfg.model)
    module = build_module(TrainStep.of(cfg), build_model(cfg.model, chat.tokenizer), run_dir=str(cfg.run_dir))
    assert type(module.sharding) is StrategyConfig and module.sharding.cpu_offload is True


@pytest.mark.parametrize(("device_gb", "simulate", "expected"), [(80, False, False), (0.0001, True, True)])
def test_setup_resolves_auto_checkpointing(train_cfg, caplog, device_gb: float, simulate: bool,
                                           expected: bool) -> None:
    """setup() turns model.gradient_checkpointing=auto into the estimate's choice before the model
    is built: the tiny model fits an 80 GB device (off, by the formula) and not a 100 kB one (on,
    by the simulated step; the simulation itself: tests/test_memory_sim.py)."""
    import logging

    from rolemrc.run.train import setup

    cfg = train_cfg("model.gradient_checkpointing=auto", f"runtime.device_memory_gb={device_gb}",
                    f"runtime.simulate_memory={str(simulate).lower()}")
    with caplog.at_level(logging.INFO, logger="rolemrc.sizing.decide"):
        run = setup(cfg)
    assert run.parts.step.model.gradient_checkpointing is expected
    assert run.module.model.is_gradient_checkpointing is expected
    assert f"activation checkpointing: {'on' if expected else 'off'}, auto: " in caplog.text
    assert ("simulated per-rank peak" in caplog.text) is simulate


def test_sizing_is_simulated_once_per_shape(train_cfg, caplog, monkeypatch, tmp_path) -> None:
    """model.gradient_checkpointing=auto: the first start simulates (a real child process), a
    second start of the same run, and a sweep job that changes only what no step's memory depends
    on (optim.lr), take the stored decision; a bigger device (runtime.device_memory_gb) decides
    anew from the stored peak without simulating; another shape has another key."""
    import logging

    from rolemrc.run.build import build_module
    from rolemrc.sizing import decide
    from rolemrc.sizing.decide import sizing_cache_dir
    from rolemrc.run.train import setup

    monkeypatch.setenv("ROLEMRC_CACHE_DIR", str(tmp_path / "cache"))
    real = decide.simulate_in_subprocess
    calls: list[int] = []

    def counted(cfg, **kwargs):
        assert kwargs["build"] is build_module and kwargs["world"] == 1  # what the run hands the simulator
        calls.append(cfg.data.max_length)
        return real(cfg, **kwargs)

    monkeypatch.setattr(decide, "simulate_in_subprocess", counted)
    small = ("model.gradient_checkpointing=auto", "runtime.device_memory_gb=0.0001")
    with caplog.at_level(logging.INFO, logger="rolemrc.sizing.decide"):
        for overrides in (small, small, (*small, "optim.lr=0.5")):  # two starts, then a sweep job
            assert setup(train_cfg(*overrides)).parts.step.model.gradient_checkpointing is True
        assert len(calls) == 1
        assert len(list(sizing_cache_dir().glob("*.json"))) == 1
        assert caplog.text.count("simulated per-rank peak") == 3 and caplog.text.count("; stored in ") == 2
        from rolemrc.sizing.decide import resolve_checkpointing, sizing_key

        assert resolve_checkpointing(TrainStep.of(train_cfg("model.gradient_checkpointing=auto")), build=build_module,
                                     world=1) is False  # 80 GB: fits
        assert len(calls) == 1
    # Another shape is another key (simulated at its first start); a longer run is the same.
    key = sizing_key(TrainStep.of(train_cfg(*small)))[0]
    assert sizing_key(TrainStep.of(train_cfg(*small, "data.max_length=32")))[0] != key
    assert sizing_key(TrainStep.of(train_cfg(*small, "data.batch_size=2")))[0] != key
    assert sizing_key(TrainStep.of(train_cfg(*small, "trainer.max_steps=7", "seed=1")))[0] == key
    # The builder travels to the child process by its import name; one without (a lambda) cannot.
    assert decide.builder_name(build_module) == "rolemrc.run.build:build_module"
    with pytest.raises(decide.SimulationUnavailable, match="not importable by that name"):
        decide.builder_name(lambda cfg, model: None)


def test_importing_the_recipe_loads_no_simulator() -> None:
    """The simulator (torch-private trackers, fake process groups) is a tool the recipe calls when
    a decision is missing, not part of its import chain."""
    import subprocess
    import sys

    code = "import sys, rolemrc.run.train; print(sorted(m for m in sys.modules if m.startswith('rolemrc.sizing.simulate')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_recipe_types_the_config_at_its_door_and_hands_on_only_parts(train_cfg) -> None:
    """Followed through setup() of a DPO run (every project function called with the root config as
    an argument, seen by a profiler): setup() hands the whole config only to the door, that is the
    checks (check_train_config, all of them, once), the model sources' rewrite (resolve_model_sources)
    and the typing (TrainParts.of, TrainStep.of); the builders, the sizing and the module get parts.
    (tests/test_import_graph.py's test_no_function_below_the_entries_takes_the_whole_config checks
    every function of src/ statically.)"""
    import sys

    from omegaconf import DictConfig

    from rolemrc.run.train import setup

    roots = {"model", "objective", "data", "trainer", "strategy", "optim"}
    handed: list[tuple[str, str]] = []

    def profile(frame, event, arg) -> None:
        module = frame.f_globals.get("__name__", "")
        if event != "call" or not module.startswith("rolemrc."):
            return
        code = frame.f_code
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        if not any(isinstance(v, DictConfig) and roots <= set(v.keys()) for v in map(frame.f_locals.get, names)):
            return
        caller = frame.f_back
        while caller is not None and not caller.f_globals.get("__name__", "").startswith("rolemrc."):
            caller = caller.f_back
        if caller is not None:
            handed.append((caller.f_globals["__name__"], f"{module}.{code.co_name}"))

    cfg = train_cfg("objective=dpo")
    sys.setprofile(profile)
    try:
        setup(cfg)
    finally:
        sys.setprofile(None)
    from_setup = sorted({b for a, b in handed if a == "rolemrc.run.train"})
    assert from_setup == ["rolemrc.config.check_train_config", "rolemrc.config.of",
                          "rolemrc.models.source.resolve_model_sources"], from_setup  # of: TrainParts's, TrainStep's
    below = sorted({b for a, b in handed if a != "rolemrc.run.train" and not a.startswith("rolemrc.config")})
    assert not below, below
