"""Config -> parts. Every entry point builds what it needs here, in pipeline order:

    chat = build_chat(cfg.model)                       # tokenizer + the one chat format
    datamodule = build_datamodule(cfg, chat)           # read, validate, encode, batch
    model = build_model(cfg.model, chat.tokenizer)     # HF model, dtype, attention, PEFT/QLoRA
    module = build_module(cfg, model, datamodule)      # the objective's LightningModule
    trainer = build_trainer(cfg)                       # strategy, loggers, callbacks, plugins

``rolemrc.run.train.setup`` strings them together for training. :func:`build_chat`, :func:`build_model`
and :func:`build_loggers` live in :mod:`rolemrc.parts` (re-exported here), which evaluation and
probing use without importing Lightning. ``_target_`` instantiation is
kept for what users swap for third-party classes (loggers, callbacks); the rest is plain code.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import warnings
from typing import Any

import hydra
import lightning as L
from lightning.fabric.plugins.environments import SLURMEnvironment
from omegaconf import OmegaConf
from torch import nn

from rolemrc.callbacks.model_summary import ModelSummaryWithoutFlops
from rolemrc.callbacks.run_summary import RunSummary
from rolemrc.checkpointing.io import AtomicCheckpointIO
from rolemrc.checkpointing.state import read_checkpoint_entries
from rolemrc.config import OBJECTIVES, Objective, lightning_trainer_args, objective_settings, typed
from rolemrc.data.datamodule import ChatDataModule
from rolemrc.data.templates import ChatFormat
from rolemrc.models.loading import count_parameters
from rolemrc.models.precision import precision_policy
from rolemrc.modules.reference import make_reference
from rolemrc.parts import build_chat, build_loggers, build_model
from rolemrc.run.requeue import SlurmRequeue
from rolemrc.run.state import RunState
from rolemrc.run.strategies import build_strategy

log = logging.getLogger(__name__)

__all__ = ["build_callbacks", "build_chat", "build_datamodule", "build_loggers", "build_model", "build_module",
           "build_trainer", "import_object", "objective_entry", "runtime_value"]


def build_datamodule(cfg: Any, chat: ChatFormat) -> ChatDataModule:
    """SFT conversations or preference pairs, as the objective needs (the pair layout, shared
    prompt or not, is an objective setting)."""
    kind = objective_entry(cfg).data
    share_prompt = kind == "pairs" and bool(cfg.objective.get("share_prompt", False))
    data = typed(cfg.data)  # DataConfig
    repeat = int(cfg.objective.get("num_iterations", 1)) if kind == "prompts" else 1  # GRPO's rollout reuse
    return ChatDataModule(data, kind, chat, seed=cfg.seed, report_dir=str(cfg.run_dir), share_prompt=share_prompt,
                          step_repeat=repeat)


def build_module(cfg: Any, model: nn.Module, datamodule: ChatDataModule | None = None) -> L.LightningModule:
    """The LightningModule of ``objective.name``; DPO gets its reference built from the initial
    weights here, before any checkpoint is restored into them."""
    policy = precision_policy(cfg.trainer.precision, cfg.model.dtype)
    trainable, total = count_parameters(model)
    log.info("training %s of %s parameters", f"{trainable:,}", f"{total:,}")
    # Typed settings (the schema dataclasses), not config nodes: modules never see the whole config.
    objective, optim = objective_settings(cfg.objective), typed(cfg.optim)
    sharding = typed(cfg.strategy) if cfg.strategy.name == "fsdp" else None
    entry = objective_entry(cfg)
    module_class = import_object(entry.module)
    parts: dict[str, Any] = {"sharding": sharding, "packed_attention": cfg.model.packed_attention}
    if objective.rolls_conversations and cfg.get("env") is not None and cfg.env.name != "none":
        env = typed(cfg.env)  # EnvConfig; the length cap defaults to data.max_length
        parts["env"] = env if env.max_tokens is not None else dataclasses.replace(env, max_tokens=int(cfg.data.max_length))
    if entry.reference and objective.needs_reference:  # GRPO: only when beta > 0
        share_prompt = bool(cfg.objective.get("share_prompt", False))  # an objective without the key: never
        if datamodule is not None and share_prompt != datamodule.share_prompt:
            raise ValueError(f"objective.share_prompt={share_prompt} but the datamodule lays pairs out "
                             f"with share_prompt={datamodule.share_prompt}: build it with build_datamodule(cfg, chat)")
        param_dtype = cfg.strategy.get("param_dtype") if cfg.strategy.name == "fsdp" else None
        parts["reference"] = make_reference(
            model, objective.reference, read_checkpoint=read_checkpoint_entries, batch_size=cfg.data.batch_size,
            cache_dir=cfg.objective.get("reference_cache_dir") or os.path.join(str(cfg.run_dir), "ref_cache"),
            settings=f"{cfg.trainer.precision}|{cfg.model.attn_implementation}|{param_dtype}",
            sync=((float(objective.ref_model_mixup_alpha), int(objective.ref_model_sync_steps))
                  if cfg.objective.get("sync_ref_model", False) else None),
        )
    return module_class(model, objective, optim, policy, **parts)


def objective_entry(cfg: Any) -> Objective:
    """The registry entry (:data:`rolemrc.config.OBJECTIVES`) of ``cfg.objective.name``."""
    entry = OBJECTIVES.get(cfg.objective.name, None)
    if entry is None:
        raise ValueError(f"objective.name must be one of {', '.join(sorted(OBJECTIVES))}, got {cfg.objective.name!r}")
    return entry


def import_object(spec: str) -> Any:
    """``"package.module:Name"`` -> the object (the registry names modules, imported when built)."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def build_callbacks(cfg: Any, has_logger: bool = True) -> list[Any]:
    """``cfg.callbacks`` instantiated. A selection without a ``ModelCheckpoint`` (``callbacks=none``)
    still checkpoints to ``<run_dir>/checkpoints/last.ckpt``, where ``ckpt_path=last`` and
    ``export.py`` look (Lightning's own default would write into the logger's folder); the
    checkpoints by time (``runtime.checkpoint_every_minutes``) are :class:`~rolemrc.run.state.RunState`'s. Without a
    logger (``logger=none``) the learning-rate monitor, which needs one, is left out."""
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    callbacks = []
    every = runtime_value(cfg, "checkpoint_every_n_steps")
    for name, spec in (cfg.callbacks or {}).items():
        if spec is None:
            continue
        if name == "checkpoint" and every:
            spec = OmegaConf.merge(spec, {"every_n_train_steps": every})
        callback = hydra.utils.instantiate(spec)
        if isinstance(callback, LearningRateMonitor) and not has_logger:
            log.info("logger=none: callbacks.%s (a LearningRateMonitor) left out, it needs a logger", name)
            continue
        callbacks.append(callback)
    if not any(isinstance(c, ModelCheckpoint) for c in callbacks):
        dirpath = os.path.join(str(cfg.run_dir), "checkpoints")
        log.info("callbacks has no ModelCheckpoint: checkpointing to %s/last.ckpt", dirpath)
        callbacks.append(ModelCheckpoint(dirpath=dirpath, save_last=True, save_top_k=0,
                                         every_n_train_steps=every or None, enable_version_counter=False))
    return callbacks


def trainer_args(cfg: Any) -> dict[str, Any]:
    """``cfg.trainer`` as ``lightning.Trainer`` keyword arguments."""
    return lightning_trainer_args(cfg)


def runtime_value(cfg: Any, key: str) -> Any:
    """A runtime setting, ``runtime.<key>`` (deprecated ``trainer.<key>`` aliases are moved
    there by :func:`rolemrc.config.check_train_config` before anything is built)."""
    return getattr(cfg.runtime, key)


def _one_process(cfg: Any) -> bool:
    """The run is one process: one device on one node."""
    devices = cfg.trainer.get("devices", 1)
    one_device = devices in (1, "1") or (not isinstance(devices, (int, str)) and len(devices) == 1)
    return one_device and int(cfg.trainer.get("num_nodes", 1) or 1) == 1


def build_trainer(cfg: Any) -> L.Trainer:
    """Strategy (checked against the model options), loggers, callbacks, atomic checkpoint IO,
    and on SLURM the preemption handling (checkpoint at a step boundary, then requeue)."""
    strategy = build_strategy(cfg)
    plugins: list[Any] = [] if cfg.strategy.name == "fsdp" else [AtomicCheckpointIO()]
    loggers = build_loggers(cfg)
    callbacks = [*build_callbacks(cfg, has_logger=bool(loggers)),
                 RunState(checkpoint_every_minutes=runtime_value(cfg, "checkpoint_every_minutes")),
                 RunSummary(),  # a final validation at max_steps; the end-of-run figures
                 ModelSummaryWithoutFlops()]  # Lightning's own would print "Total FLOPs: 0"
    if _one_process(cfg):
        # Lightning warns that `srun` "is available but not used" wherever SLURM is installed: advice
        # against parallel jobs hanging, which a one-process run cannot do (a login node's test run).
        warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system but is not used",
                                module=r"lightning\.fabric\.plugins\.environments\.slurm")
    on_slurm = SLURMEnvironment.detect()  # gives Lightning's srun advice where it applies, once:
    warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system but is not used",
                            module=r"lightning\.fabric\.plugins\.environments\.slurm")  # the Trainer and fit repeat it
    if on_slurm:
        plugins.append(SLURMEnvironment(auto_requeue=False))
        callbacks.append(SlurmRequeue())
    return L.Trainer(
        **trainer_args(cfg),
        strategy=strategy,
        logger=loggers or False,
        callbacks=callbacks,
        enable_model_summary=False,  # ModelSummaryWithoutFlops prints it (Lightning would add its own beside)
        default_root_dir=str(cfg.run_dir),
        use_distributed_sampler=False,  # ResumableSampler splits data across ranks itself
        plugins=plugins,
    )
