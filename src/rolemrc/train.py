"""The training pipeline behind ``python train.py``: model -> data -> module -> trainer -> fit -> export."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from omegaconf import DictConfig, OmegaConf

from rolemrc.checkpoints import AtomicCheckpointIO, find_checkpoint, use_checkpoint_as_model
from rolemrc.config import check_train_config
from rolemrc.data.datamodule import ChatDataModule
from rolemrc.data.templates import ChatFormat
from rolemrc.models.loading import check_model_cfg, count_parameters, load_model, load_tokenizer
from rolemrc.models.precision import check_policy
from rolemrc.strategies import build_strategy

log = logging.getLogger(__name__)


def build_loggers(cfg: DictConfig) -> list[Any]:
    loggers = []
    for name, spec in (cfg.logger or {}).items():
        spec = OmegaConf.to_container(spec, resolve=True)
        if spec.get("_target_", "").endswith("WandbLogger") and spec.get("offline") is None:
            # No key: log offline into the run folder rather than failing or prompting.
            spec["offline"] = not os.environ.get("WANDB_API_KEY") and os.environ.get("WANDB_MODE") != "online"
        loggers.append(hydra.utils.instantiate(spec))
    return loggers


def build_callbacks(cfg: DictConfig) -> list[Any]:
    callbacks = []
    for name, spec in (cfg.callbacks or {}).items():
        if spec is None:
            continue
        if name == "checkpoint" and cfg.trainer.checkpoint_every_n_steps:
            spec = OmegaConf.merge(spec, {"every_n_train_steps": cfg.trainer.checkpoint_every_n_steps})
        callbacks.append(hydra.utils.instantiate(spec))
    return callbacks


def build_module(cfg: DictConfig, model: torch.nn.Module, datamodule: ChatDataModule) -> L.LightningModule:
    if cfg.objective.name == "sft":
        from rolemrc.modules.sft import SFTModule

        return SFTModule(model, cfg)
    if cfg.objective.name == "dpo":
        from rolemrc.modules.dpo import DPOModule

        return DPOModule(model, cfg, datamodule)
    raise ValueError(f"objective.name must be sft or dpo, got {cfg.objective.name!r}")


def trainer_kwargs(cfg: DictConfig) -> dict[str, Any]:
    t = OmegaConf.to_container(cfg.trainer, resolve=True)
    for key in ("matmul_precision", "checkpoint_every_n_steps", "device_memory_gb"):
        t.pop(key)
    return {k: v for k, v in t.items() if v is not None}


def resolve_ckpt_path(cfg: DictConfig) -> str | None:
    """``ckpt_path=last`` -> the run folder's last checkpoint if there is one (None on a
    fresh run, so the same command starts and resumes). Under SLURM with no ckpt_path,
    Lightning itself resumes from the preemption checkpoint (``hpc_ckpt_*``)."""
    if cfg.ckpt_path in (None, ""):
        return None
    if cfg.ckpt_path == "last":
        last = find_checkpoint(cfg.run_dir)
        return str(last) if last is not None else None
    if not Path(cfg.ckpt_path).exists():
        raise FileNotFoundError(f"ckpt_path not found: {cfg.ckpt_path}")
    return cfg.ckpt_path


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train as configured; return the paths written and the final logged metrics."""
    check_train_config(cfg)
    check_model_cfg(cfg.model)
    use_checkpoint_as_model(cfg)  # model.path=<a checkpoint or run of ours>: start from its weights
    if cfg.trainer.matmul_precision:
        torch.set_float32_matmul_precision(cfg.trainer.matmul_precision)
    L.seed_everything(cfg.seed, workers=True)
    log.info("memory estimate: %s", cfg.memory_check)  # warns before any weight is loaded
    run_dir = Path(cfg.run_dir)

    tokenizer = load_tokenizer(cfg.model)
    chat = ChatFormat(tokenizer, eot=cfg.model.eot_token)
    kind = "sft" if cfg.objective.name == "sft" else "pairs"
    share_prompt = kind == "pairs" and bool(cfg.objective.share_prompt)  # pair layout: an objective setting
    datamodule = ChatDataModule(cfg.data, kind, chat, seed=cfg.seed, report_dir=str(run_dir),
                                share_prompt=share_prompt)
    strategy = build_strategy(cfg)  # fails on impossible combinations before loading weights
    policy = check_policy(cfg.trainer.precision, cfg.model.dtype, full_finetune=not cfg.model.peft.enabled)
    log.info("precision: trainable weights and optimizer states %s, frozen weights %s, compute %s",
             *(str(d).removeprefix("torch.") for d in (policy.master, policy.frozen, policy.compute)))
    model = load_model(cfg.model, tokenizer)
    trainable, total = count_parameters(model)
    log.info("model %s: %s parameters, %s trainable", cfg.model.name, f"{total:,}", f"{trainable:,}")
    module = build_module(cfg, model, datamodule)

    plugins: list[Any] = [] if cfg.strategy.name == "fsdp" else [AtomicCheckpointIO()]
    callbacks = build_callbacks(cfg)
    if SLURMEnvironment.detect():  # preemption: checkpoint at a step boundary, then requeue
        from rolemrc.callbacks.slurm_requeue import SlurmRequeue

        plugins.append(SLURMEnvironment(auto_requeue=False))
        callbacks.append(SlurmRequeue())
    trainer = L.Trainer(
        **trainer_kwargs(cfg),
        strategy=strategy,
        logger=build_loggers(cfg) or False,
        callbacks=callbacks,
        default_root_dir=str(run_dir),
        use_distributed_sampler=False,  # ResumableSampler splits data across ranks itself
        plugins=plugins,
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=resolve_ckpt_path(cfg))

    result: dict[str, Any] = {"run_dir": str(run_dir), "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}}
    if cfg.export.enabled:
        result["export"] = str(export_after_fit(cfg, trainer, module))
    return result


def export_after_fit(cfg: DictConfig, trainer: L.Trainer, module: Any) -> Path:
    """Write the trained model in HF format, in ``model.dtype`` (the recipes: bf16), rounded once
    from the fp32 masters: the full state (gathered from the shards under FSDP) goes into a
    meta-device skeleton of the run's model (:func:`rolemrc.checkpoints.export_state`)."""
    from rolemrc.checkpoints import export_state, full_state_dict

    out = Path(cfg.run_dir) / cfg.export.dir
    if cfg.model.quantization.load_in_4bit:  # QLoRA (never sharded): the adapter, from the model itself
        from rolemrc.models.export import export_pretrained

        if trainer.is_global_zero:
            export_pretrained(module.model, load_tokenizer(cfg.model), out, cfg.model.peft.merge_on_export)
        state = None
    elif cfg.strategy.name == "fsdp":
        state = full_state_dict(module.model)  # collective: every rank takes part
    else:
        state = {k: v.detach() for k, v in module.model.state_dict().items()} if trainer.is_global_zero else {}
    if trainer.is_global_zero and state is not None:  # LoRA merges there
        export_state(cfg, state, out)
    trainer.strategy.barrier("export")
    if trainer.is_global_zero:
        log.info("exported model: %s", out)
        print(f"exported model: {out}")
    return out
