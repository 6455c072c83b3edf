"""Every shipped config composes; typos fail at compose time with Hydra's message."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from tests.conftest import CONF, ROOT, compose_train


def resolve(cfg):
    """Resolve every interpolation outside the (read-only) hydra node."""
    return OmegaConf.create({k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
                             for k in cfg if k != "hydra"})


MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
OBJECTIVES = sorted(p.stem for p in (CONF / "objective").glob("*.yaml"))
DATA = sorted(p.stem for p in (CONF / "data").glob("*.yaml"))
ALL_EXPERIMENTS = sorted(p.stem for p in (ROOT / "experiments").glob("*.yaml"))


def _recipe_objective(name: str) -> str:
    """The objective a recipe composes with (its ``override /objective: X`` default; else train.yaml's)."""
    import re

    found = re.search(r"override /objective:\s*(\w+)", (ROOT / "experiments" / f"{name}.yaml").read_text())
    return found.group(1) if found else "sft"


# A recipe whose objective is not registered on this branch yet (objective=grpo, issue 33) is left out
# of the composition tests below and named by test_every_recipes_objective_exists (a skip, not a pass).
EXPERIMENTS = [e for e in ALL_EXPERIMENTS if (CONF / "objective" / f"{_recipe_objective(e)}.yaml").exists()]


def test_groups_exist() -> None:
    assert {"llama", "qwen", "tiny", "tiny_qwen"} <= set(MODELS)
    assert {"sft", "dpo"} <= set(OBJECTIVES)
    assert {"rolemrc", "rolemrc_mix", "sample", "local"} <= set(DATA)
    assert {"rolemrc_llama_sft", "rolemrc_qwen_sft", "rolemrc_llama_dpo", "rolemrc_qwen_dpo"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("model,objective,data", list(itertools.product(MODELS, OBJECTIVES, DATA)))
def test_every_combination_composes(model: str, objective: str, data: str) -> None:
    extra = ["data.dir=/some/folder"] if data == "local" else []
    cfg = compose_train([f"model={model}", f"objective={objective}", f"data={data}", *extra])
    cfg = resolve(cfg)
    assert cfg.model.name == model and cfg.objective.name == objective and cfg.data.name == data


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiments_compose(experiment: str) -> None:
    extra = ["model.path=/ckpt/sft_export"] if experiment.endswith(("dpo", "simpo", "kto", "grpo", "rloo")) else []
    cfg = compose_train([f"experiment={experiment}", *extra])
    cfg = resolve(cfg)
    assert cfg.task_name == experiment
    assert cfg.trainer.precision == "bf16-mixed"


def test_paper_recipes() -> None:
    sft = compose_train(["experiment=rolemrc_llama_sft"])
    assert sft.model.path == "meta-llama/Llama-3.1-8B"
    assert (sft.optim.lr, sft.optim.scheduler, sft.optim.warmup_ratio) == (2e-5, "cosine", 0.04)
    assert sft.data.batch_size * sft.trainer.accumulate_grad_batches * sft.trainer.devices == 64
    assert sft.data.max_length == 4200
    dpo = compose_train(["experiment=rolemrc_qwen_dpo", "model.path=/x"])
    assert dpo.model.path == "/x" and dpo.objective.beta == 0.1 and dpo.objective.loss_type == "sigmoid"
    assert (dpo.optim.lr, dpo.optim.scheduler, dpo.optim.warmup_ratio) == (4e-7, "linear", 0.1)
    assert dpo.data.batch_size * dpo.trainer.accumulate_grad_batches * dpo.trainer.devices == 64
    assert dpo.data.max_length == 3000 and dpo.data.max_prompt_length == 2250


@pytest.mark.parametrize("model", ["llama", "qwen"])
def test_kto_recipes(model: str) -> None:
    """The KTO authors' HALOs settings (each value's source is in the recipe), on an SFT export."""
    cfg = compose_train([f"experiment=rolemrc_{model}_kto", "model.path=/x"])
    check_train_config(cfg)
    o = cfg.objective
    assert (o.name, o.loss_type, o.beta, o.desirable_weight, o.undesirable_weight, o.reference) == \
        ("kto", "kto", 0.1, 1.0, 1.0, "copy")
    assert (cfg.optim.lr, cfg.optim.scheduler, cfg.optim.warmup_ratio, cfg.optim.weight_decay, cfg.optim.eps) == \
        (5e-6, "constant", 0.1, 0.01, 1e-5)
    assert cfg.data.batch_size * cfg.trainer.accumulate_grad_batches * cfg.trainer.devices == 32
    assert cfg.data.batch_size >= 4 and cfg.trainer.max_epochs == 1 and cfg.trainer.gradient_clip_val == 1.0


def test_every_recipes_objective_exists() -> None:
    missing = {e: _recipe_objective(e) for e in ALL_EXPERIMENTS if e not in EXPERIMENTS}
    if missing:
        pytest.skip(f"recipes whose objective is not on this branch yet (not composed here): {missing}")


@pytest.mark.parametrize("family", ["llama", "qwen"])
def test_grpo_recipes(family: str) -> None:
    """The GRPO recipes (issue 33): TRL 1.16 / DAPO values, the verifier reward, data=rolemrc_rl."""
    from rolemrc.rewards import VerifierReward, build_rewards

    name = f"rolemrc_{family}_grpo"
    if name not in EXPERIMENTS:
        pytest.skip("objective=grpo is not on this branch yet")
    cfg = compose_train([f"experiment={name}", "model.path=/ckpt/dpo_export"])
    o = cfg.objective
    assert (cfg.model.name, cfg.model.path, o.name, cfg.data.name) == (family, "/ckpt/dpo_export", "grpo", "rolemrc_rl")
    assert (o.loss_type, o.beta, o.epsilon, o.epsilon_high, o.num_iterations, o.scale_rewards) == (
        "dapo", 0.0, 0.2, 0.28, 1, "group")
    assert (o.num_generations, o.temperature, o.top_p, o.top_k, o.max_completion_length) == (8, 1.0, 1.0, 0, 256)
    assert o.mask_truncated_completions is True and o.rollout == "hf"
    rewards = build_rewards(OmegaConf.to_container(o.rewards, resolve=True))
    assert list(rewards.rewards) == ["verifier"] and isinstance(rewards.rewards["verifier"], VerifierReward)
    assert rewards.rewards["verifier"].mode == "all" and rewards.weights == {"verifier": 1.0}
    assert (cfg.optim.lr, cfg.optim.scheduler) == (1e-6, "constant")
    assert cfg.data.batch_size * cfg.trainer.accumulate_grad_batches * cfg.trainer.devices == 32


def test_typo_in_key_fails_at_compose() -> None:
    with pytest.raises(ConfigCompositionException) as err:
        compose_train(["objective.lr=1e-5"])
    assert "lr" in str(err.value.__cause__ or err.value)


def test_wrong_type_fails_at_compose() -> None:
    with pytest.raises(ConfigCompositionException):
        compose_train(["optim.lr=fast"])


def test_unknown_group_option_fails() -> None:
    with pytest.raises(ConfigCompositionException, match="qwn"):
        compose_train(["model=qwn"])


def test_cfg_job_prints_resolved_config() -> None:
    out = subprocess.run(
        [sys.executable, "train.py", "model=qwen", "objective=dpo", "--cfg", "job", "--resolve"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    cfg = OmegaConf.create(out)
    assert cfg.model.path == "Qwen/Qwen2.5-7B" and cfg.objective.name == "dpo"
    # Only live keys: the deprecated aliases and the removed key are left out when not given.
    assert "matmul_precision" not in cfg.trainer and "checkpoint_every_n_steps" not in cfg.trainer
    assert "activation_checkpointing" not in cfg.strategy and "safe_serialization" not in cfg.export
    assert cfg.runtime.checkpoint_every_n_steps == 0


def test_cfg_job_shows_a_deprecated_key_that_is_given_and_help_offers_no_schema() -> None:
    given = subprocess.run([sys.executable, "train.py", "trainer.checkpoint_every_n_steps=5", "--cfg", "job"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert OmegaConf.create(given).trainer.checkpoint_every_n_steps == 5
    shown = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout
    # the shipped objective files, as Hydra lists a group's options (sorted), and no schema entry
    shipped = sorted(p.stem for p in (CONF / "objective").glob("*.yaml"))
    assert len(shipped) >= 5 and f"objective: {', '.join(shipped)}\n" in shown and "_schema" not in shown
    # and the registered names of every extension point, read from the registries themselves
    from rolemrc.registry import all_registries

    listed = shown.split("== Extension points ==")[1].split("== Config ==")[0]
    registries = all_registries()
    assert {"objective.name", "objective.rewards.<name>.type", "rollout engine", "generation.backend",
            "judge.backend", "judge.protocol", "suite", "model_type", "stages"} <= set(registries)
    for key, registry in registries.items():
        assert f"\n{key}: {', '.join(registry)}\n" in listed, key


def test_schema_option_is_not_an_objective() -> None:
    with pytest.raises(ConfigError, match=r"^objective=dpo_schema is the schema of objective=dpo's file, not an "
                                          r"objective: use objective=dpo$"):
        check_train_config(compose_train(["objective=dpo_schema"]))


# ---------------------------------------------------------------- config keys mirror code (issue 14.3)

import copy  # noqa: E402
import dataclasses  # noqa: E402
import inspect  # noqa: E402
import logging  # noqa: E402
import re  # noqa: E402

import lightning as L  # noqa: E402

from rolemrc.config import (  # noqa: E402
    MOVED_TO_RUNTIME,
    OBJECTIVE_SCHEMAS,
    DPOObjectiveConfig,
    ExportConfig,
    ModelConfig,
    ObjectiveConfig,
    RuntimeConfig,
    SFTObjectiveConfig,
    StrategyConfig,
    TrainConfig,
    TrainerConfig,
    check_train_config,
    lightning_trainer_args,
    upgrade_train_config,
)
from rolemrc.errors import ConfigError  # noqa: E402

DPO_ONLY = sorted({f.name for f in dataclasses.fields(DPOObjectiveConfig)} - {f.name for f in dataclasses.fields(ObjectiveConfig)})
TRAINERS = sorted(p.stem for p in (CONF / "trainer").glob("*.yaml"))
STRATEGIES = sorted(p.stem for p in (CONF / "strategy").glob("*.yaml"))


def _sample_value(schema: type, key: str) -> str:
    value = {f.name: f.default for f in dataclasses.fields(schema)}[key]
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def test_each_objective_has_its_own_schema() -> None:
    assert {"beta", "loss_type", "reference", "share_prompt", "label_smoothing", "sft_weight",
            "reference_cache_dir"} <= set(DPO_ONLY)
    for name, schema in OBJECTIVE_SCHEMAS.items():
        cfg = compose_train([f"objective={name}"])
        assert OmegaConf.get_type(cfg.objective) is schema
        assert set(cfg.objective) == {f.name for f in dataclasses.fields(schema)}


@pytest.mark.parametrize("key", DPO_ONLY)
def test_sft_refuses_dpo_keys_at_compose(key: str) -> None:
    value = _sample_value(DPOObjectiveConfig, key)
    with pytest.raises(ConfigCompositionException) as err:
        compose_train(["objective=sft", f"objective.{key}={value}"])
    assert f"Key '{key}' not in 'SFTObjectiveConfig'" in str(err.value.__cause__ or err.value)
    cfg = compose_train(["objective=dpo", f"objective.{key}={value}"])  # dpo keeps every key
    assert str(cfg.objective[key]).lower() == value.lower() or (value == "null" and cfg.objective[key] is None)


def test_sft_with_dpo_key_exits_naming_the_key() -> None:
    proc = subprocess.run([sys.executable, "train.py", "objective=sft", "objective.beta=0.1", "--cfg", "job"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: objective.beta is not a config key (SFTObjectiveConfig); its keys: name, logprob_chunk_size; "
        "beta is a key of objective=dpo|simpo|orpo|kto|grpo|rloo"], proc.stderr


def test_dpo_sweep_composes_and_runs(tmp_path) -> None:
    """The README's sweep (`-m objective.beta=... objective=dpo`), one real step per job, on Hydra's
    basic launcher (each job's folder, saved config and metrics)."""
    proc = subprocess.run(
        [sys.executable, "train.py", "-m", "objective.beta=0.05,0.2", "objective=dpo", "trainer.max_steps=1",
         "data.max_length=128", "data.max_prompt_length=96", "data.val_fraction=0", "callbacks=none",
         "trainer.enable_progress_bar=false", "export.enabled=false", f"hydra.sweep.dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for i, beta in enumerate((0.05, 0.2)):
        saved = OmegaConf.load(tmp_path / str(i) / ".hydra" / "config.yaml")
        assert saved.objective.name == "dpo" and saved.objective.beta == beta
        assert (tmp_path / str(i) / "csv" / "metrics.csv").read_text().count("\n") >= 2


def _trainer_signature() -> set[str]:
    return set(inspect.signature(L.Trainer).parameters) - {"self"}


def test_trainer_schema_holds_lightning_arguments_only() -> None:
    fields = {f.name for f in dataclasses.fields(TrainerConfig)} - set(MOVED_TO_RUNTIME)
    assert fields <= _trainer_signature(), fields - _trainer_signature()
    assert not set(MOVED_TO_RUNTIME) & _trainer_signature()  # really not Trainer arguments
    runtime = {f.name for f in dataclasses.fields(RuntimeConfig)}
    assert set(MOVED_TO_RUNTIME) <= runtime and not runtime & _trainer_signature()  # rolemrc's own settings


@pytest.mark.parametrize("overrides", [[f"trainer={t}"] for t in TRAINERS]
                         + [[f"experiment={e}", "model.path=/x"] for e in EXPERIMENTS])
def test_lightning_accepts_the_trainer_args_of_every_shipped_config(overrides: list[str]) -> None:
    cfg = compose_train(overrides)
    check_train_config(cfg)
    args = lightning_trainer_args(cfg.trainer)
    assert set(args) <= _trainer_signature() and not set(args) & set(MOVED_TO_RUNTIME)
    assert None not in args.values()
    inspect.signature(L.Trainer).bind(**args)  # every key accepted, each once
    if args.get("accelerator") != "gpu":  # a GPU trainer is only buildable on a GPU node
        trainer = L.Trainer(**{**args, "logger": False, "enable_checkpointing": False}, default_root_dir=cfg.run_dir)
        assert trainer.max_epochs == args["max_epochs"]


@pytest.mark.parametrize("overrides", [[]] + [[f"trainer={t}"] for t in TRAINERS] + [[f"strategy={s}"] for s in STRATEGIES]
                         + [[f"experiment={e}", "model.path=/x"] for e in EXPERIMENTS])
def test_shipped_configs_use_no_deprecated_key(overrides: list[str], caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="rolemrc.config"):
        check_train_config(compose_train(overrides))
    assert "deprecated" not in caplog.text and "removed" not in caplog.text


def test_old_trainer_keys_move_to_runtime_with_a_warning(caplog) -> None:
    old = ["trainer.checkpoint_every_n_steps=3", "trainer.device_memory_gb=40", "trainer.matmul_precision=medium"]
    cfg = compose_train(old)
    with caplog.at_level(logging.WARNING, logger="rolemrc.config"):
        check_train_config(cfg)
    assert (cfg.runtime.checkpoint_every_n_steps, cfg.runtime.device_memory_gb, cfg.runtime.matmul_precision) == (3, 40, "medium")
    assert all(cfg.trainer[k] is None for k in MOVED_TO_RUNTIME)
    for key in MOVED_TO_RUNTIME:
        assert f"trainer.{key} is deprecated" in caplog.text and f"use runtime.{key}" in caplog.text
    assert not set(lightning_trainer_args(cfg.trainer)) & set(MOVED_TO_RUNTIME)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rolemrc.config"):
        check_train_config(cfg)  # idempotent: warned once
    assert caplog.text == "" and cfg.runtime.checkpoint_every_n_steps == 3
    new = compose_train(["runtime.checkpoint_every_n_steps=3", "runtime.device_memory_gb=40"])
    assert (new.runtime.checkpoint_every_n_steps, new.runtime.device_memory_gb) == (3, 40)


def test_one_activation_checkpointing_switch(caplog) -> None:
    assert compose_train(["strategy=fsdp"]).strategy.activation_checkpointing is None  # fsdp.yaml: not the alias
    for value in (True, False):
        cfg = compose_train(["strategy=fsdp", f"model.gradient_checkpointing={not value}",
                             f"strategy.activation_checkpointing={value}"])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rolemrc.config"):
            check_train_config(cfg)
        assert cfg.model.gradient_checkpointing is value and cfg.strategy.activation_checkpointing is None
        assert "strategy.activation_checkpointing is deprecated" in caplog.text
        assert "model.gradient_checkpointing" in caplog.text
    # The recipes leave it to the memory estimate through the one key (rolemrc.sizing.formula.choose_checkpointing).
    for experiment in EXPERIMENTS:
        assert compose_train([f"experiment={experiment}", "model.path=/x"]).model.gradient_checkpointing == "auto"


def test_removed_key_is_named_not_ignored(caplog) -> None:
    cfg = compose_train(["export.safe_serialization=true"])
    with caplog.at_level(logging.WARNING, logger="rolemrc.config"):
        check_train_config(cfg)
    assert "export.safe_serialization was removed" in caplog.text
    with pytest.raises(ConfigError, match="export.safe_serialization=false is no longer supported"):
        check_train_config(compose_train(["export.safe_serialization=false"]))


def test_removed_key_exits_with_one_line(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "train.py", "export.safe_serialization=false", f"hydra.run.dir={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "error: export.safe_serialization=false is no longer supported" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "checkpoints").exists()


# Keys kept only as deprecated aliases (read by upgrade_train_config, nothing else).
ALIASES = {(TrainerConfig, k) for k in MOVED_TO_RUNTIME} | {(StrategyConfig, "activation_checkpointing"),
                                                            (ExportConfig, "safe_serialization")}


def _schema_fields() -> list[tuple[type, str]]:
    seen, todo, out = set(), [TrainConfig, SFTObjectiveConfig, DPOObjectiveConfig], []
    while todo:
        schema = todo.pop()
        if schema in seen:
            continue
        seen.add(schema)
        for f in dataclasses.fields(schema):
            out.append((schema, f.name))
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            if dataclasses.is_dataclass(default):
                todo.append(type(default))
        if schema is TrainConfig:
            todo += [ModelConfig, __import__("rolemrc.config", fromlist=["DataConfig"]).DataConfig,
                     __import__("rolemrc.config", fromlist=["SourceConfig"]).SourceConfig]
    return out


def test_no_dead_keys() -> None:
    """Every key of the train schema is read somewhere outside config.py (attribute, item or get),
    except the deprecated aliases; Trainer arguments are read by Lightning (checked above)."""
    src = "\n".join(p.read_text() for p in (ROOT / "src" / "rolemrc").rglob("*.py") if p.name != "config.py")
    src += "\n".join(p.read_text() for p in (CONF / "hydra").rglob("*.yaml"))  # task_name: the run folder
    dead = []
    for schema, key in _schema_fields():
        if (schema, key) in ALIASES or schema is TrainerConfig:
            continue
        if not re.search(rf"\.{key}\b|[\"']{key}[\"']|\${{{key}}}|\b{key}=", src):
            dead.append(f"{schema.__name__}.{key}")
    assert not dead, dead


@pytest.mark.parametrize("overrides", [[f"objective={o}"] for o in OBJECTIVES]
                         + [[f"experiment={e}", "model.path=/x"] for e in EXPERIMENTS])
def test_typed_config_is_the_dataclasses(overrides: list[str]) -> None:
    from rolemrc.config import OptimConfig, typed
    from tests.test_memory import check

    cfg = compose_train([*overrides, "trainer.checkpoint_every_n_steps=5"])  # an alias: mapped in the copy only
    up = upgrade_train_config(copy.deepcopy(cfg))
    assert up.runtime.checkpoint_every_n_steps == 5  # cfg itself untouched:
    assert cfg.trainer.checkpoint_every_n_steps == 5 and cfg.runtime.checkpoint_every_n_steps == 0
    for group, schema in (("trainer", TrainerConfig), ("runtime", RuntimeConfig), ("model", ModelConfig),
                          ("optim", OptimConfig), ("objective", OBJECTIVE_SCHEMAS[cfg.objective.name])):
        assert type(typed(up[group])) is schema, group
    assert typed(up.model).tokenizer == up.model.tokenizer  # interpolations resolved
    assert lightning_trainer_args(typed(up.trainer)) == lightning_trainer_args(up.trainer)
    assert check(up) == check(cfg)


def test_objective_node_without_its_schema_is_checked_before_the_run() -> None:
    from omegaconf import open_dict

    cfg = compose_train(["objective=sft"])
    with open_dict(cfg):
        cfg.objective = OmegaConf.create({"name": "sft", "beta": 0.1})  # e.g. a user's file with no schema default
    with pytest.raises(ConfigError, match=r"objective.beta is not a key of objective=sft \(SFTObjectiveConfig\)"):
        check_train_config(cfg)
    with open_dict(cfg):
        cfg.objective = OmegaConf.create({"name": "ppo"})
    with pytest.raises(ConfigError, match="objective.name must be one of"):
        check_train_config(cfg)


def test_key_added_to_a_typed_objective_is_refused_not_dropped() -> None:
    """``+objective.beta=0.1`` composes onto objective=sft (``+`` adds keys even to a schema's
    node) and typed() would drop it without a word: check_train_config names it."""
    cfg = compose_train(["objective=sft", "+objective.beta=0.1"])
    assert OmegaConf.get_type(cfg.objective) is SFTObjectiveConfig  # still the schema's node
    with pytest.raises(ConfigError, match=r"objective.beta is not a key of objective=sft \(SFTObjectiveConfig\)"):
        check_train_config(cfg)
    cfg = compose_train(["objective=dpo", "+objective.sft_weigth=0.5"])  # a typo'd key is named too
    with pytest.raises(ConfigError, match=r"objective.sft_weigth is not a key of objective=dpo"):
        check_train_config(cfg)
    check_train_config(compose_train(["objective=sft"]))  # the schema's own keys pass
