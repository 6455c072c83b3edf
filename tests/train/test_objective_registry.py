"""A new objective is its schema, its module and one registry line (rolemrc.config.OBJECTIVES):
nothing in build.py or train.py changes for it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf, open_dict

from rolemrc.config import OBJECTIVES, Objective, ObjectiveConfig, TrainStep, check_train_config
from rolemrc.errors import ConfigError
from rolemrc.modules.sft import SFTModule
from rolemrc.run.train import fit, setup
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
    steps = 0  # step_loss calls: the memory simulation runs the objective's own step

    def step_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        type(self).steps += 1
        loss, shares = super().step_loss(batch)
        return loss * self.objective.scale, {**shares, "train/toy_scale": torch.tensor(self.objective.scale)}


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(OBJECTIVES, "toy", Objective(ToyObjectiveConfig, f"{__name__}:ToyModule", data="sft"))


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
    assert len(series(run.parts.run_dir, "train/loss")) == 2
    assert series(run.parts.run_dir, "train/toy_scale") == [0.25, 0.25]  # its own step's metrics, logged


def test_the_memory_simulation_runs_the_objectives_own_step(toy, train_cfg) -> None:
    """``python -m rolemrc.memory ... --simulate`` builds the module the entry names and runs its
    ``step_loss``: the toy objective is simulated as itself, not as SFT."""
    from tests.test_memory_sim import simulate

    cfg = train_cfg("data.batch_size=2", "data.max_length=64")
    with_objective(cfg, OmegaConf.structured(ToyObjectiveConfig(scale=0.25)))
    before = ToyModule.steps
    sim = simulate(cfg, checkpointing=False)
    assert ToyModule.steps - before == 2  # the warm-up step and the tracked one
    assert sim.rows == 2 and sim.tokens == 2 * 64 and sim.peak_bytes > 0


STEP_SOURCE = """from rolemrc.modules.sft import SFTModule


class EditedModule(SFTModule):
    def step_loss(self, batch):
        loss, shares = super().step_loss(batch)
        return loss * {scale}, shares
"""


def test_editing_an_objectives_step_is_another_sizing_key(train_cfg, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The stored sizing decision (rolemrc.sizing.decide) is keyed by the objective's step as well as
    by the simulator: an edited ``step_loss`` is simulated again at its next start, the same source
    finds the stored decision, and what else the key holds is unchanged by the edit."""
    from rolemrc.sizing.decide import sizing_key

    source = tmp_path / "edited_objective.py"
    source.write_text(STEP_SOURCE.format(scale=2), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(OBJECTIVES, "toy", Objective(ToyObjectiveConfig, "edited_objective:EditedModule", data="sft"))
    cfg = train_cfg()
    with_objective(cfg, OmegaConf.structured(ToyObjectiveConfig(scale=0.25)))
    key, parts = sizing_key(TrainStep.of(cfg))
    assert str(source.resolve()) in parts["code"]["step"] and "modules/sft.py" in parts["code"]["step"]
    assert "objectives/logprobs.py" in parts["code"]["step"]
    source.write_text(STEP_SOURCE.format(scale=3), encoding="utf-8")  # the step edited
    edited, edited_parts = sizing_key(TrainStep.of(cfg))
    assert edited != key
    assert {k: v for k, v in edited_parts.items() if k != "code"} == {k: v for k, v in parts.items() if k != "code"}
    source.write_text(STEP_SOURCE.format(scale=2), encoding="utf-8")
    assert sizing_key(TrainStep.of(cfg))[0] == key


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
    with pytest.raises(ConfigError, match=r"objective.name must be one of \['dpo', 'grpo', 'kto', 'orpo', 'reward', 'rloo', 'sft', 'simpo'\], got 'toy'"):
        check_train_config(cfg)


@pytest.mark.parametrize(("objective", "names"), [
    ("simpo", ("rewards/chosen", "rewards/margins", "logps/chosen")),
    ("orpo", ("nll_loss", "log_odds_ratio", "log_odds_chosen", "rewards/accuracies")),
])
def test_reference_free_objectives_train_without_a_reference(train_cfg, objective: str, names) -> None:
    """SimPO and ORPO through the builders: pairs, no reference built, TRL's metric names logged."""
    run = setup(train_cfg(f"objective={objective}", "trainer.max_steps=2", "export.enabled=false",
                          "data.max_length=160", "data.max_prompt_length=96", "data.val_fraction=0.2"))
    assert run.datamodule.kind == "pairs"
    assert run.module.reference is None and run.module.models_to_shard() == [run.module.model]
    fit(run)
    for name in ("loss", *names):
        values = series(run.parts.run_dir, f"train/{name}")
        assert len(values) == 2 and all(v == v for v in values), name  # logged each step, no NaN
        assert len(series(run.parts.run_dir, f"val/{name}")) >= 1, name  # the final validation, same names


def test_a_simpo_recipe_is_simulated_without_a_reference_copy() -> None:
    """The memory simulation of SimPO holds the policy's shards only; DPO's copy adds its own."""
    from tests.conftest import compose_train
    from tests.test_memory_sim import TINY, _shard_bytes, simulate

    base = [*TINY, "data.max_prompt_length=128", "model.dtype=bfloat16", "trainer.precision=bf16-mixed",
            "strategy.param_dtype=bfloat16", "strategy.reduce_dtype=float32"]
    simpo = simulate(compose_train([*base, "objective=simpo"]), checkpointing=False)
    shards, _ = _shard_bytes(compose_train(base), 2)
    assert simpo.after_backward["Sharded Param"] == shards  # fp32 masters only: no reference copy
    assert simpo.rows == 2 * 2 and simpo.tokens == 4 * 256  # chosen and rejected rows


def test_an_objectives_rule_across_groups_is_checked_before_anything_loads(train_cfg) -> None:
    """ORPO's prompt NLL needs unpacked pairs: refused by check_train_config (the schema's check_run)."""
    with pytest.raises(ConfigError, match="objective.nll_on_prompt=true .* needs unpacked pairs"):
        check_train_config(train_cfg("objective=orpo", "data.packing=true"))
    check_train_config(train_cfg("objective=orpo", "data.packing=true", "objective.nll_on_prompt=false"))


@pytest.mark.parametrize("mode", ["copy", "adapter"])
def test_kto_trains_on_split_pairs_with_a_reference(train_cfg, mode: str) -> None:
    """KTO through the builders: pairs split into a desirable and an undesirable example, DPO's
    reference modes, TRL's metric names logged each step and at validation."""
    extra = ["model.peft.enabled=true"] if mode == "adapter" else []
    run = setup(train_cfg("objective=kto", f"objective.reference={mode}", *extra, "trainer.max_steps=2",
                          "export.enabled=false", "data.max_length=160", "data.max_prompt_length=96",
                          "data.val_fraction=0.2"))
    assert run.datamodule.kind == "pairs" and run.module.reference.mode == mode
    assert len(run.module.models_to_shard()) == (2 if mode == "copy" else 1)
    fit(run)
    for name in ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
                 "logps/rejected"):
        values = series(run.parts.run_dir, f"train/{name}")
        assert len(values) == 2 and all(v == v for v in values), name
        assert len(series(run.parts.run_dir, f"val/{name}")) >= 1, name


def test_kto_trains_on_unpaired_examples(train_cfg, tmp_path: Path, caplog) -> None:
    """data.unpaired given: its {prompt, completion, label} examples are the batch rows (not
    data.pairs), unbalanced labels, TRL's metric names logged each step and at validation."""
    from tests.data.test_unpaired_records import split_sample_pairs

    path = split_sample_pairs(tmp_path, keep=60)  # 60 desirable, 80 undesirable
    run = setup(train_cfg("objective=kto", f"data.unpaired=[{{path: '{path}'}}]", "trainer.max_steps=2",
                          "export.enabled=false", "data.max_length=160", "data.max_prompt_length=96",
                          "data.val_fraction=0.1"))
    assert run.datamodule.kind == "unpaired"
    # The KL rows come with the batch from the module's hook, built on the host before the batch
    # moves (Lightning calls only the DataModule's hook, which hands it on), not in the step.
    arrived_with_kl_rows = []
    terms = type(run.module)._terms

    def spy(self, batch, stage):
        arrived_with_kl_rows.append("kl_input_ids" in batch)
        return terms(self, batch, stage)

    run.module._terms = spy.__get__(run.module)
    with caplog.at_level(logging.WARNING, logger="rolemrc.modules.kto"):
        fit(run)
    assert arrived_with_kl_rows and all(arrived_with_kl_rows)
    # unbalanced labels (about 60:80) at weights 1 and 1: TRL's imbalance warning
    assert "outside the KTO paper's range" in caplog.text
    assert run.datamodule.report["train"]["examples"] == 126 and len(run.datamodule.val_rows) == 14
    for name in ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
                 "logps/rejected"):
        values = series(run.parts.run_dir, f"train/{name}")
        assert len(values) == 2 and all(v == v for v in values), name
        assert len(series(run.parts.run_dir, f"val/{name}")) >= 1, name


@pytest.mark.parametrize(("loss_type", "data"), [("apo_zero_unpaired", "pairs"), ("apo_zero_unpaired", "unpaired"),
                                               ("kto", "pairs"), ("kto", "unpaired")])
def test_kto_with_a_precomputed_reference_equals_the_copy(train_cfg, tmp_path: Path, loss_type: str, data: str) -> None:
    """The reference is per example (kto: each example's KL row is fixed too), so a precomputed
    table is exact: the first steps' losses (and kto's kl) equal those against a reference copy
    (pairs split and unpaired examples, shuffled)."""
    from tests.data.test_unpaired_records import split_sample_pairs

    extra = [f"data.unpaired=[{{path: '{split_sample_pairs(tmp_path, keep=50)}'}}]"] if data == "unpaired" else []
    losses = {}
    for mode in ("copy", "precomputed"):
        run = setup(train_cfg("objective=kto", f"objective.loss_type={loss_type}", f"objective.reference={mode}",
                              *extra, "trainer.max_steps=2", "export.enabled=false", "data.max_length=160",
                              "data.max_prompt_length=96", "data.val_fraction=0.1", "data.shuffle=true",
                              f"run_dir={tmp_path / mode}"))
        fit(run)
        losses[mode] = [*series(run.parts.run_dir, "train/loss"), *series(run.parts.run_dir, "val/loss"),
                        *series(run.parts.run_dir, "train/kl"), *series(run.parts.run_dir, "val/kl")]
        if mode == "precomputed":
            assert run.module.reference.models() == [] and set(run.module.reference.tables) == {"train", "val"}
            width = run.module.reference.tables["train"].shape[1]
            assert width == (2 if data == "pairs" else 1) * (2 if loss_type == "kto" else 1)
    assert len(losses["copy"]) == 6 and losses["precomputed"] == pytest.approx(losses["copy"], rel=1e-5, abs=1e-6)
    if loss_type == "kto":
        assert any(v != 0 for v in losses["copy"][3:])  # the KL term is in play, a comparison that can fail


@pytest.mark.parametrize("data", ["pairs", "unpaired"])
def test_kto_kl_rows_are_fixed_per_example_as_trls(train_cfg, tmp_path: Path, data: str) -> None:
    """TRL fixes each example's KL completion once (consecutive chunks of the per-device batch
    size, rotated by one): unshuffled, each of our micro-batches is such a chunk, and the fixed
    pairing is its own rows rotated (TRL's batch); shuffled, every example keeps that KL row."""
    from rolemrc.modules.kto import fixed_kl_completions, mismatched
    from tests.data.test_unpaired_records import split_sample_pairs

    extra = [f"data.unpaired=[{{path: '{split_sample_pairs(tmp_path, keep=23)}'}}]"] if data == "unpaired" else []
    run = setup(train_cfg("objective=kto", *extra, "data.batch_size=5", "data.shuffle=false", "data.max_length=160",
                          "data.max_prompt_length=96"))
    dm = run.datamodule
    dm.setup("fit")
    rows, pairs = dm.train_rows, data == "pairs"
    assert len(rows) % 5  # a last, shorter chunk is rotated within itself, as TRL's last map batch
    seen: dict[int, list[int]] = {}
    for batch in dm.train_dataloader():
        index = batch["index"].tolist()
        fixed = fixed_kl_completions(rows, index, 5, pairs)
        rotated = mismatched(batch)
        for j, completion in enumerate(fixed):
            assert rotated["labels"][j][rotated["labels"][j] != -100].tolist() == list(completion)
        seen.update(zip(index, map(list, fixed[: len(index)])))
    assert len(seen) == len(rows)
    # shuffled batches: each example's KL completion is the one above, whatever its batch
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    for start in range(0, len(order), 5):
        index = order[start:start + 5]
        fixed = fixed_kl_completions(rows, index, 5, pairs)
        assert [list(c) for c in fixed[: len(index)]] == [seen[i] for i in index]


def test_kto_metrics_of_a_step_without_desirable_examples_are_nan() -> None:
    """TRL logs no rewards/chosen for a batch without a desirable example; a 0 would read as a value."""
    from rolemrc.modules.kto import KTOModule

    terms = {"desirable": torch.tensor([False, False]), "reward": torch.tensor([0.5, 1.5]),
             "logps": torch.tensor([-3.0, -5.0])}
    out = KTOModule._metrics(terms, torch.tensor(4.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))
    assert out["rewards/chosen"].isnan() and out["logps/chosen"].isnan() and out["rewards/margins"].isnan()
    assert float(out["rewards/rejected"]) == 0.5 and float(out["logps/rejected"]) == -2.0  # shares of 4 examples


def test_kto_unpaired_val_needs_unpaired_train_sources(train_cfg, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data.unpaired_val is set but data.unpaired is empty"):
        check_train_config(train_cfg("objective=kto", f"data.unpaired_val=[{{path: '{tmp_path}/v.jsonl'}}]"))


@pytest.mark.parametrize(("overrides", "match"), [
    (["data.packing=true"], "objective=kto needs unpacked examples"),
    (["objective.desirable_weight=0"], "objective.desirable_weight must be > 0, got 0"),
    (["data.batch_size=1"], "objective=kto needs data.batch_size >= 2, got 1"),
    (["objective.loss_type=sigmoid"], "objective.loss_type must be one of kto, apo_zero_unpaired, got 'sigmoid'"),
])
def test_kto_settings_are_checked_before_anything_loads(train_cfg, overrides, match) -> None:
    with pytest.raises(ConfigError, match=match):
        check_train_config(train_cfg("objective=kto", *overrides))
    if overrides == ["data.batch_size=1"]:  # without the KL term a batch of one is fine
        check_train_config(train_cfg("objective=kto", *overrides, "objective.loss_type=apo_zero_unpaired"))


def test_kto_is_simulated_as_itself() -> None:
    """KTO's step in the memory simulation: DPO's reference copy, plus the KL rows' passes."""
    from tests.conftest import compose_train
    from tests.test_memory_sim import TINY, simulate

    base = [*TINY, "data.max_prompt_length=128"]
    kto = simulate(compose_train([*base, "objective=kto"]), checkpointing=False)
    dpo = simulate(compose_train([*base, "objective=dpo"]), checkpointing=False)
    assert kto.after_backward["Sharded Param"] == dpo.after_backward["Sharded Param"]  # policy + reference copy
    assert kto.peak_bytes > dpo.peak_bytes  # the KL rows' forwards run in the simulated step
    apo = simulate(compose_train([*base, "objective=kto", "objective.loss_type=apo_zero_unpaired"]),
                   checkpointing=False)
    assert apo.peak_bytes < kto.peak_bytes  # no KL rows
    # data.unpaired: batch_size examples, one row each (not a pair's two): less than the pairs' step
    unpaired = simulate(compose_train([*base, "objective=kto", "data.unpaired=[{path: /nowhere/u.jsonl}]"]),
                        checkpointing=False)
    assert unpaired.after_backward["Sharded Param"] == kto.after_backward["Sharded Param"]
    assert dpo.peak_bytes < kto.peak_bytes and unpaired.peak_bytes < kto.peak_bytes
    # a precomputed reference (both layouts, with the KL rows' columns): no reference copy held
    for extra in ([], ["data.unpaired=[{path: /nowhere/u.jsonl}]"]):
        pre = simulate(compose_train([*base, "objective=kto", "objective.reference=precomputed", *extra]),
                       checkpointing=False)
        assert 2 * pre.after_backward["Sharded Param"] == kto.after_backward["Sharded Param"]


def _kl_on_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from rolemrc.modules.kto import _rank_mean
    from rolemrc.objectives.kto import kto_kl

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        # rank 0's estimate 0.3, rank 1's -0.5: TRL averages (-0.1), then clamps -> 0 on both ranks
        diff = torch.tensor([0.3, -0.5], dtype=torch.float64)[rank]
        kl = kto_kl(diff.reshape(1), torch.zeros(1, dtype=torch.float64), rank_mean=_rank_mean)
        torch.save(kl, f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_kto_kl_is_averaged_over_ranks_before_the_clamp(tmp_path: Path) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_kl_on_rank, args=(port, str(tmp_path)), nprocs=2)
    assert [float(torch.load(tmp_path / f"{r}.pt")) for r in (0, 1)] == [0.0, 0.0]  # per rank: 0.3 and 0
