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
EXPERIMENTS = sorted(p.stem for p in (ROOT / "experiments").glob("*.yaml"))


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
    extra = ["model.path=/ckpt/sft_export"] if experiment.endswith("dpo") else []
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
