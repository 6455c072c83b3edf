"""The training recipe behind ``python train.py``: :func:`setup` builds the parts from the
config (:mod:`rolemrc.run.build`), :func:`fit` trains them and exports the result.

    run = setup(cfg)     # checks, the config typed once (TrainParts), chat format, data, trainer, model, module
    result = fit(run)    # trainer.fit (resuming from ckpt_path), then the HF export

:func:`setup` is the door: it checks the composed config and resolves it into
:class:`rolemrc.config.TrainParts` (the step's typed groups, :class:`rolemrc.config.TrainStep`, and
the run's own); every function it calls after that is handed the parts it reads, never ``cfg``.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.accelerators import CPUAccelerator
from omegaconf import DictConfig

from rolemrc.callbacks.run_summary import RunSummary
from rolemrc.checkpointing import full_state_dict, read_checkpoint_entries
from rolemrc.checkpointing.verify import check_checkpoint, reading
from rolemrc.config import TrainParts, TrainStep, check_train_config, source_group
from rolemrc.data.datamodule import ChatDataModule
from rolemrc.data.readers import local_files, source_config
from rolemrc.data.templates import ChatFormat
from rolemrc.errors import ConfigError, DestinationError, InputNotFound, StorageError
from rolemrc.fileio import atomic_write_json, partial_path
from rolemrc.models.export import check_replaceable, export_pretrained, export_state
from rolemrc.models.loading import check_model_cfg
from rolemrc.models.precision import check_policy
from rolemrc.models.source import resolve_model_sources
from rolemrc.run.build import build_chat, build_datamodule, build_model, build_module, build_trainer
from rolemrc.run.resume import chosen_checkpoint, continue_command, record_continuation, run_folder_lock
from rolemrc.run.state import RunInterrupted, RunState, completed_epochs
from rolemrc.run.strategies import world_size
from rolemrc.sizing.decide import resolve_checkpointing
from rolemrc.sizing.formula import log_estimate
from rolemrc.warnings import hf_progress_bars

log = logging.getLogger(__name__)


@dataclass
class TrainRun:
    """Everything one training run is made of, built by :func:`setup`."""

    parts: TrainParts
    chat: ChatFormat
    datamodule: ChatDataModule
    trainer: L.Trainer
    module: L.LightningModule
    ckpt_path: str | None


def resolve_ckpt_path(ckpt_path: str | None, run_dir: str, strategy: str, last: Path | None = None) -> str | None:
    """``ckpt_path=last`` -> the run folder's last checkpoint if there is one (None on a
    fresh run, so the same command starts and resumes; ``last``: already looked up and checked
    by :func:`run`). Under SLURM with no ckpt_path, Lightning itself resumes from the
    preemption checkpoint (``hpc_ckpt_*``). ``strategy``: ``strategy.name``."""
    if ckpt_path in (None, ""):
        return None
    if ckpt_path == "last":
        if last is None:
            last = last_checkpoint(run_dir)
        return str(last) if last is not None else None
    if not Path(ckpt_path).exists():
        raise InputNotFound(f"ckpt_path not found: {ckpt_path}")
    check_checkpoint(ckpt_path)  # truncated or corrupt: named here, not an EOFError from Lightning
    if Path(ckpt_path).is_dir() and strategy != "fsdp":
        raise ConfigError(f"ckpt_path={ckpt_path} is a sharded (FSDP) checkpoint: resume it with strategy=fsdp, "
                          f"or start from its weights with model.path={ckpt_path}")
    return ckpt_path


def check_files(step: TrainStep, *, ckpt_path: str | None, run_dir: str, export: Any) -> None:
    """The files a run reads, named before anything loads (a missing one would otherwise be found
    after the model, minutes for an 8B one): the objective's local data files (hub datasets are
    the readers' business), an explicit ``ckpt_path`` and a precomputed reference's cache folder
    (:func:`check_reference_cache`); and that the end-of-run export (``export.dir``) would replace
    nothing but a previous export (:func:`rolemrc.models.export.check_replaceable`)."""
    kind = source_group(step.entry.data, step.data)
    for group in (kind, f"{kind}_val"):
        for i, source in enumerate(step.data[group]):
            try:
                local_files(source_config(source))
            except InputNotFound as err:
                raise InputNotFound(f"data.{group}[{i}].path: {err}") from None
    if ckpt_path not in (None, "", "last") and not Path(ckpt_path).exists():
        raise InputNotFound(f"ckpt_path not found: {ckpt_path}")
    if step.entry.reference and step.objective.get("reference") == "precomputed":
        given = step.objective.get("reference_cache_dir")
        check_reference_cache(Path(given or Path(run_dir) / "ref_cache"), given=bool(given))
    if export.enabled:  # the end-of-run export replaces only a previous export: refused now, not after training
        try:
            check_replaceable(Path(run_dir) / export.dir)
        except DestinationError as err:
            raise ConfigError(f"export.dir={export.dir}: {err}") from None


def check_accelerator(trainer: Any, strategy: Any) -> None:
    """``trainer.accelerator=gpu`` (the GPU recipes, ``trainer=gpu``) on a machine where torch sees
    no GPU, refused before the memory sizing, the data and the model (Lightning would refuse it
    when the trainer is built, after them)."""
    from lightning.fabric.accelerators.cuda import num_cuda_devices  # Lightning's own test (fork-safe)
    from lightning.fabric.accelerators.mps import MPSAccelerator

    accelerator = str(trainer.accelerator).lower()
    if accelerator not in ("gpu", "cuda") or num_cuda_devices() > 0:
        return
    if accelerator == "gpu" and MPSAccelerator.is_available():  # Lightning's "gpu" on Apple silicon
        return
    cpu = "trainer.accelerator=cpu"
    if strategy.name != "single" or str(trainer.devices) != "1":
        cpu += " trainer.devices=1 strategy=single"
    if str(trainer.precision).startswith("16"):  # fp16 autocast is a GPU feature; bf16 runs on CPUs
        cpu += " trainer.precision=32-true"
    raise ConfigError(f"trainer.accelerator={trainer.accelerator} but this machine has no GPU that torch can use "
                      f"(no CUDA device found): run it on a GPU node (e.g. sbatch slurm/train.sbatch "
                      f"...), or train on the CPU with {cpu}")


REFERENCE_TABLES = "ref_logps-*.safetensors"  # rolemrc.modules.reference.PrecomputedReference.cache_path


def check_reference_cache(folder: Path, given: bool) -> None:
    """``objective.reference=precomputed``'s cache folder, before the model loads (a bad one would
    otherwise be found after the model and the reference pass): a file, a run folder (its cache is
    its ``ref_cache``) or a table that is not one of ours is named. A folder that is not there yet is
    this run's to fill; which table serves is known once the initial weights are fingerprinted."""
    from safetensors import SafetensorError, safe_open

    key = "objective.reference_cache_dir" if given else "the reference cache"
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{key}={folder} is a file, not a folder of reference log-probs")
    if not folder.is_dir():
        return
    tables = sorted(folder.glob(REFERENCE_TABLES))
    if not tables and (folder / "ref_cache").is_dir():
        raise ConfigError(f"{key}={folder} is a run folder; its reference log-probs are in {folder / 'ref_cache'}")
    for table in tables:
        try:
            with safe_open(str(table), framework="pt") as f:
                names = list(f.keys())
        except (SafetensorError, OSError) as err:
            raise ConfigError(f"{key}: {table} is not a readable safetensors file ({err}); delete it to "
                              "have the reference log-probs computed again") from None
        if names != ["logps"]:
            raise ConfigError(f"{key}: {table} holds {names}, not reference log-probs ('logps'): a file of "
                              "another program; move it out of the cache folder")


def last_checkpoint(run_dir: str | Path) -> Path | None:
    """The run folder's newest checkpoint, checked (a truncated or corrupt one is named here, before
    the model loads), or None: the one lookup of a ``ckpt_path=last`` start (the folder chosen
    before Hydra started was looked up there: :func:`rolemrc.run.resume.chosen_checkpoint`)."""
    found = chosen_checkpoint(run_dir)
    return check_checkpoint(found) if found is not None else None


def grpo_cpu_hint(o: Any, data: Any, trainer: Any) -> str:
    """How long GRPO (or RLOO) takes on a CPU, said when it starts: sampling dominates its steps
    (``o``, ``data``, ``trainer``: the objective, data and trainer groups)."""
    n = int(data.batch_size) * int(trainer.accumulate_grad_batches) * int(o.num_generations)
    name = str(o.get("name", "grpo")).upper()
    return (f"{name} on CPU: each step samples {n} completions of up to {o.max_completion_length} tokens "
            "before it learns; at make demo-rl's settings (32 of 48 tokens, the tiny model) a step takes 10-20 s on 2 "
            "busy cores, a larger model far longer")


def setup(cfg: DictConfig, last: Path | None = None) -> TrainRun:
    """The door: check the composed config and resolve it into :class:`TrainParts` (typed once),
    then build the parts in pipeline order, each builder handed the parts it reads. Impossible
    combinations (strategy vs quantization, precision vs dtype, lengths) fail here, before weights
    load. ``last``: ``ckpt_path=last``'s checkpoint, when :func:`run` looked it up."""
    check_train_config(cfg)
    check_model_cfg(cfg.model)
    check_files(TrainStep.of(cfg), ckpt_path=cfg.ckpt_path, run_dir=str(cfg.run_dir), export=cfg.export)
    check_accelerator(cfg.trainer, cfg.strategy)  # a GPU recipe on a machine without one: before the sizing and the data
    cfg, _ = resolve_model_sources(cfg)  # model.path=<a checkpoint or run of ours>: start from its weights
    parts = TrainParts.of(cfg)  # the config typed once: below here, each function gets the parts it reads
    step = parts.step
    if step.runtime.matmul_precision:
        torch.set_float32_matmul_precision(step.runtime.matmul_precision)
    L.seed_everything(parts.seed, workers=True)
    # model.gradient_checkpointing=auto -> on only where memory needs it; the simulator gets the
    # run's module builder and world size from here
    resolve_checkpointing(step, build=build_module, world=world_size(step.trainer))
    log_estimate(step)  # the per-device estimate, logged (a warning when too big) before any weight loads
    if step.trainer.get("enable_progress_bar") is False:  # transformers' loading/saving bars off too
        hf_progress_bars(False)

    chat = build_chat(step.model)
    datamodule = build_datamodule(step, chat, seed=parts.seed, report_dir=parts.run_dir)
    # the strategy refuses impossible combinations before loading weights
    trainer = build_trainer(step, logger=parts.logger, callbacks=parts.callbacks, run_dir=parts.run_dir)
    policy = check_policy(step.trainer.precision, step.model.dtype, full_finetune=not step.model.peft.enabled)
    log.info("precision: trainable weights and optimizer states %s, frozen weights %s, compute %s",
             *(str(d).removeprefix("torch.") for d in (policy.master, policy.frozen, policy.compute)))
    if step.entry.data == "prompts" and isinstance(trainer.accelerator, CPUAccelerator):
        log.info(grpo_cpu_hint(step.objective, step.data, step.trainer))
    model = build_model(step.model, chat.tokenizer, head=step.entry.head)
    module = build_module(step, model, datamodule, run_dir=parts.run_dir)
    ckpt = resolve_ckpt_path(parts.ckpt_path, parts.run_dir, step.strategy.name, last)
    return TrainRun(parts, chat, datamodule, trainer, module, ckpt)


def fit(run: TrainRun) -> dict[str, Any]:
    """Train (resuming from ``run.ckpt_path``), then export; returns the paths written and the
    final logged metrics. Ctrl-C (SIGINT) or SIGTERM during training: a checkpoint at the step
    boundary (:class:`rolemrc.run.state.RunState`), the command that continues,
    exit status 128 + the signal's number."""
    parts, trainer = run.parts, run.trainer
    try:
        trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=run.ckpt_path)
    except RunInterrupted as stop:
        if trainer.is_global_zero:
            print(f"{stop}; to continue: {continue_command(parts.run_dir)}", file=sys.stderr, flush=True)
        raise SystemExit(128 + stop.signum) from None
    except StorageError as err:  # a full disk while saving a checkpoint: the command that continues, once there is room
        raise StorageError(f"{err}; then continue it: {continue_command(parts.run_dir)} (with the folder's new path "
                           "if moved)") from None
    summary = next((c for c in trainer.callbacks if isinstance(c, RunSummary)), None)
    if summary is not None and not summary.figures:  # resumed at its end: Lightning trained nothing and
        # ended no training (killed during the final validation or the export): finish what is missing
        state = next(c for c in trainer.callbacks if isinstance(c, RunState))
        if state.restored_before_validation:
            trainer.validate(run.module, datamodule=run.datamodule, verbose=False)
        summary.figures = summary.summarise(trainer, run.module)
    result: dict[str, Any] = {"run_dir": parts.run_dir,
                              "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}}
    if parts.export.enabled:
        out = Path(parts.run_dir) / parts.export.dir
        result["export"] = str(export_after_fit(parts.step, trainer, run.module, out))
    result["summary"] = end_of_run(parts.run_dir, trainer, result.get("export"))
    return result


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train as configured: ``fit(setup(cfg))``, holding the run folder's lock (a second process
    training the same folder stops with one error line). ``ckpt_path=last`` on a finished run
    whose end-of-run work is done says so (and how to extend it) and does nothing; a finished run
    whose export or summary is missing (killed during them) completes them."""
    with run_folder_lock(cfg.run_dir):
        last = None
        if cfg.ckpt_path == "last":
            last = last_checkpoint(cfg.run_dir)
            finished = finished_run(cfg.trainer, cfg.run_dir, last) if last is not None else None
            if finished is not None:
                missing = missing_end_of_run_work(str(cfg.run_dir), cfg.export, finished.step)
                if not missing:
                    print(finished.message, flush=True)
                    return {"run_dir": str(cfg.run_dir), "finished": True}
                print(f"ckpt_path=last: {cfg.run_dir} finished training at step {finished.step}; completing its "
                      f"end-of-run work ({', '.join(missing)})", flush=True)
            record_continuation(cfg)
        return fit(setup(cfg, last))


@dataclass
class Finished:
    """A run whose newest checkpoint reached its config's end: what to say, and at which step."""

    message: str
    step: int
    checkpoint: Path


def finished_run(trainer: Any, run_dir: str | Path, checkpoint: Path) -> Finished | None:
    """For ``ckpt_path=last`` on a run whose newest checkpoint already reached this config's end
    (``trainer.max_steps``, or ``trainer.max_epochs`` of complete epochs): what to say instead of
    training (which would only save the same checkpoint again and redo the export), naming how
    to extend it. None when there is more to train (or no checkpoint). Whether its end-of-run
    work (export, summary) was done is the recipe's to check (:func:`run`).
    ``checkpoint``: the run's newest, looked up and checked by the recipe."""
    with reading(checkpoint):
        state = read_checkpoint_entries(checkpoint, ("global_step", "loops"))
    step = int(state.get("global_step", 0))
    epochs = completed_epochs(state)  # an epoch max_steps cut short is not complete
    max_steps = trainer.get("max_steps", -1)
    max_epochs = trainer.get("max_epochs", None)
    by_steps = max_steps is not None and max_steps >= 0 and step >= max_steps
    by_epochs = max_epochs is not None and max_epochs >= 0 and epochs >= max_epochs
    if not (by_steps or by_epochs):
        return None
    reached = (f"trainer.max_steps={max_steps} reached at step {step}" if by_steps
               else f"trainer.max_epochs={max_epochs} complete epoch(s) at step {step}")
    # A folder continued by name runs its own saved command line (see the module), so the advised
    # command holds whichever overrides this one had; every limit reached is raised (no loop)
    raise_ = ([f"trainer.max_steps={max(step * 2, step + 1)}"] if by_steps else []) + \
        ([f"trainer.max_epochs={max_epochs + 1}"] if by_epochs else [])
    how = f"to train further: {continue_command(run_dir, *raise_)}"
    return Finished(f"ckpt_path=last: {run_dir} is finished ({reached}; checkpoint {checkpoint}); nothing to do. "
                    f"{how}", step, Path(checkpoint))


def missing_end_of_run_work(run_dir: str, export: Any, step: int) -> list[str]:
    """What a run that trained to ``step`` has not finished of its end (empty: nothing): the
    export (``export.enabled``) and ``run_summary.json`` of that step, which is written last."""
    missing = []
    folder = Path(run_dir) / export.dir
    if export.enabled and (not folder.is_dir() or partial_path(folder).exists()):  # swapped in when complete
        missing.append(f"export {folder}")
    try:
        summary = json.loads((Path(run_dir) / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        summary = None
    if not isinstance(summary, dict) or summary.get("steps") != step:
        missing.append(SUMMARY_FILE)
    return missing


SUMMARY_FILE = "run_summary.json"


def end_of_run(run_dir: str, trainer: L.Trainer, export: str | None) -> dict[str, Any]:
    """The run's figures (:class:`rolemrc.callbacks.run_summary.RunSummary`), printed and written
    to ``<run>/run_summary.json`` (a sweep's summary reads them there)."""

    figures = next((c.figures for c in trainer.callbacks if isinstance(c, RunSummary)), {})
    summary = {**figures, "run_dir": run_dir, "export": export}
    if trainer.is_global_zero:
        atomic_write_json(Path(run_dir) / SUMMARY_FILE, summary)
        print(summary_text(summary), flush=True)
    return summary


def summary_text(summary: dict[str, Any]) -> str:
    def number(key: str, fmt: str) -> str:
        value = summary.get(key)
        return "n/a" if value is None else format(value, fmt)

    steps = summary.get("steps", 0)
    others = summary.get("val_metrics") or {}
    notes = summary.get("notes") or {}

    def figure(key: str, value: float) -> str:  # a reward figure with what it is the mean of
        return f"{key} {value:.4f}" + (f" ({notes[key]})" if notes.get(key) else "")

    if summary.get("val_loss") is not None:
        val = f"val/loss {number('val_loss', '.4f')}"
    elif others:  # an objective that validates something else (GRPO: the reward of sampled completions)
        keys = ["val/reward"] if "val/reward" in others else list(others)[:2]
        val = ", ".join(figure(k, others[k]) for k in keys)
    else:
        val = "val/loss n/a (no validation data)"
    if summary.get("train_reward") is not None:  # GRPO: the training reward, beside the validation figure
        val = f"{figure('train/reward', summary['train_reward'])}, {val}"
    return "\n".join([
        f"run summary: {steps} step{'' if steps == 1 else 's'}, {number('epochs', '.2f')} epochs, "
        f"train/loss {number('train_loss', '.4f')}, {val}, {number('tokens_per_s', ',.0f')} tokens/s",
        f"  run folder: {summary['run_dir']}",
        f"  export: {summary['export'] or 'none (export.enabled=false)'}",
    ])


def export_after_fit(step: TrainStep, trainer: L.Trainer, module: Any, out: Path) -> Path:
    """Write the trained model in HF format, in ``model.dtype`` (the recipes: bf16), rounded once
    from the fp32 masters: the full state (gathered from the shards under FSDP) goes into a
    meta-device skeleton of the run's model (:func:`rolemrc.models.export.export_state`)."""

    if step.model.quantization.load_in_4bit:  # QLoRA (never sharded): the adapter, from the model itself
        if trainer.is_global_zero:
            export_pretrained(module.model, build_chat(step.model).tokenizer, out, step.model.peft.merge_on_export,
                              base=step.model.path)
        state = None
    elif step.strategy.name == "fsdp":
        state = full_state_dict(module.model)  # collective: every rank takes part
    else:
        state = {k: v.detach() for k, v in module.model.state_dict().items()} if trainer.is_global_zero else {}
    if trainer.is_global_zero and state is not None:  # LoRA merges there
        export_state(step.model, state, out, head=step.entry.head)
    trainer.strategy.barrier("export")
    if trainer.is_global_zero:
        log.info("exported model: %s", out)  # on the console once (Hydra's handler) and in the log
    return out
