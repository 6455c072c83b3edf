"""Config -> parts. Every entry point builds what it needs here, in pipeline order:

    parts = TrainParts.of(cfg)                         # the config typed once (rolemrc.config)
    chat = build_chat(parts.step.model)                # tokenizer + the one chat format
    datamodule = build_datamodule(parts.step, chat, seed=parts.seed, report_dir=parts.run_dir)
    model = build_model(parts.step.model, chat.tokenizer)  # HF model, dtype, attention, PEFT/QLoRA
    module = build_module(parts.step, model, datamodule, run_dir=parts.run_dir)  # the objective's module
    trainer = build_trainer(parts.step, logger=parts.logger, callbacks=parts.callbacks, run_dir=parts.run_dir)

Each builder takes the parts it reads, never the composed config.

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
from rolemrc.config import TrainStep, lightning_trainer_args, objective_settings, typed
from rolemrc.data.datamodule import ChatDataModule
from rolemrc.data.templates import ChatFormat
from rolemrc.models.loading import count_parameters
from rolemrc.models.precision import precision_policy
from rolemrc.modules.reference import make_reference
from rolemrc.parts import build_chat, build_loggers, build_model, make_loggers
from rolemrc.run.requeue import SlurmRequeue
from rolemrc.run.state import RunState
from rolemrc.run.strategies import build_strategy

log = logging.getLogger(__name__)

__all__ = ["build_callbacks", "build_chat", "build_datamodule", "build_loggers", "build_model", "build_module",
           "build_trainer", "import_object"]


def build_datamodule(step: TrainStep, chat: ChatFormat, *, seed: int, report_dir: str) -> ChatDataModule:
    """SFT conversations or preference pairs, as the objective needs (the pair layout, shared
    prompt or not, is an objective setting)."""
    kind = step.entry.data
    share_prompt = kind == "pairs" and bool(step.objective.get("share_prompt", False))
    data = typed(step.data)  # DataConfig
    repeat = int(step.objective.get("num_iterations", 1)) if kind == "prompts" else 1  # GRPO's rollout reuse
    return ChatDataModule(data, kind, chat, seed=seed, report_dir=report_dir, share_prompt=share_prompt,
                          step_repeat=repeat)


def build_module(step: TrainStep, model: nn.Module, datamodule: ChatDataModule | None = None, *,
                 run_dir: str) -> L.LightningModule:
    """The LightningModule of ``objective.name``; DPO gets its reference built from the initial
    weights here, before any checkpoint is restored into them (a precomputed reference's tables
    in ``<run_dir>/ref_cache`` unless ``objective.reference_cache_dir`` names a folder)."""
    policy = precision_policy(step.trainer.precision, step.model.dtype)
    trainable, total = count_parameters(model)
    log.info("training %s of %s parameters", f"{trainable:,}", f"{total:,}")
    # Typed settings (the schema dataclasses), not config nodes: modules never see the whole config.
    objective, optim = objective_settings(step.objective), typed(step.optim)
    sharding = typed(step.strategy) if step.strategy.name == "fsdp" else None
    entry = step.entry
    module_class = import_object(entry.module)
    parts: dict[str, Any] = {"sharding": sharding, "packed_attention": step.model.packed_attention}
    if objective.rolls_conversations and step.env is not None and step.env.name != "none":
        env = typed(step.env)  # EnvConfig; the length cap defaults to data.max_length
        parts["env"] = env if env.max_tokens is not None else dataclasses.replace(env, max_tokens=int(step.data.max_length))
    if entry.reference and objective.needs_reference:  # GRPO: only when beta > 0
        share_prompt = bool(step.objective.get("share_prompt", False))  # an objective without the key: never
        if datamodule is not None and share_prompt != datamodule.share_prompt:
            raise ValueError(f"objective.share_prompt={share_prompt} but the datamodule lays pairs out "
                             f"with share_prompt={datamodule.share_prompt}: build it with build_datamodule(step, chat)")
        param_dtype = step.strategy.get("param_dtype") if step.strategy.name == "fsdp" else None
        parts["reference"] = make_reference(
            model, objective.reference, read_checkpoint=read_checkpoint_entries, batch_size=step.data.batch_size,
            cache_dir=step.objective.get("reference_cache_dir") or os.path.join(run_dir, "ref_cache"),
            settings=f"{step.trainer.precision}|{step.model.attn_implementation}|{param_dtype}",
            sync=((float(objective.ref_model_mixup_alpha), int(objective.ref_model_sync_steps))
                  if step.objective.get("sync_ref_model", False) else None),
        )
    return module_class(model, objective, optim, policy, **parts)


def import_object(spec: str) -> Any:
    """``"package.module:Name"`` -> the object (the registry names modules, imported when built)."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def build_callbacks(callbacks: Any, *, run_dir: str, every_n_steps: int = 0, has_logger: bool = True) -> list[Any]:
    """``callbacks`` (the config's ``{name: {_target_: ...}}``) instantiated, checkpointing also every
    ``every_n_steps`` optimizer steps when > 0 (``runtime.checkpoint_every_n_steps``). A selection without a ``ModelCheckpoint`` (``callbacks=none``)
    still checkpoints to ``<run_dir>/checkpoints/last.ckpt``, where ``ckpt_path=last`` and
    ``export.py`` look (Lightning's own default would write into the logger's folder); the
    checkpoints by time (``runtime.checkpoint_every_minutes``) are :class:`~rolemrc.run.state.RunState`'s. Without a
    logger (``logger=none``) the learning-rate monitor, which needs one, is left out."""
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    built = []
    every = every_n_steps
    for name, spec in (callbacks or {}).items():
        if spec is None:
            continue
        if name == "checkpoint" and every:
            spec = OmegaConf.merge(spec, {"every_n_train_steps": every})
        callback = hydra.utils.instantiate(spec)
        if isinstance(callback, LearningRateMonitor) and not has_logger:
            log.info("logger=none: callbacks.%s (a LearningRateMonitor) left out, it needs a logger", name)
            continue
        built.append(callback)
    if not any(isinstance(c, ModelCheckpoint) for c in built):
        dirpath = os.path.join(run_dir, "checkpoints")
        log.info("callbacks has no ModelCheckpoint: checkpointing to %s/last.ckpt", dirpath)
        built.append(ModelCheckpoint(dirpath=dirpath, save_last=True, save_top_k=0,
                                     every_n_train_steps=every or None, enable_version_counter=False))
    return built


def _one_process(trainer: Any) -> bool:
    """The run is one process: one device on one node (``trainer``: the trainer group)."""
    devices = trainer.get("devices", 1)
    one_device = devices in (1, "1") or (not isinstance(devices, (int, str)) and len(devices) == 1)
    return one_device and int(trainer.get("num_nodes", 1) or 1) == 1


def build_trainer(step: TrainStep, *, logger: Any, callbacks: Any, run_dir: str) -> L.Trainer:
    """Strategy (checked against the model options), loggers, callbacks, atomic checkpoint IO,
    and on SLURM the preemption handling (checkpoint at a step boundary, then requeue).
    ``logger``, ``callbacks``: the config's groups (``{name: {_target_: ...}}``)."""
    runtime = step.runtime
    strategy = build_strategy(step.strategy, step.model, step.trainer)
    plugins: list[Any] = [] if step.strategy.name == "fsdp" else [AtomicCheckpointIO()]
    loggers = make_loggers(logger)
    callbacks = [*build_callbacks(callbacks, run_dir=run_dir, has_logger=bool(loggers),
                                  every_n_steps=runtime.checkpoint_every_n_steps),
                 RunState(checkpoint_every_minutes=runtime.checkpoint_every_minutes),
                 RunSummary(),  # a final validation at max_steps; the end-of-run figures
                 ModelSummaryWithoutFlops()]  # Lightning's own would print "Total FLOPs: 0"
    srun_advice = {"message": r"The `srun` command is available on your system but is not used",
                   "module": r"lightning\.fabric\.plugins\.environments\.slurm"}
    if _one_process(step.trainer):
        # Lightning warns that `srun` "is available but not used" wherever SLURM is installed: advice
        # against parallel jobs hanging, which a one-process run cannot do (a login node's test run).
        warnings.filterwarnings("ignore", **srun_advice)
    on_slurm = SLURMEnvironment.detect()  # gives Lightning's srun advice where it applies, once:
    warnings.filterwarnings("ignore", **srun_advice)  # the Trainer and fit repeat it
    if on_slurm:
        plugins.append(SLURMEnvironment(auto_requeue=False))
        callbacks.append(SlurmRequeue())
    return L.Trainer(
        **lightning_trainer_args(step.trainer),
        strategy=strategy,
        logger=loggers or False,
        callbacks=callbacks,
        enable_model_summary=False,  # ModelSummaryWithoutFlops prints it (Lightning would add its own beside)
        default_root_dir=run_dir,
        use_distributed_sampler=False,  # ResumableSampler splits data across ranks itself
        plugins=plugins,
    )
