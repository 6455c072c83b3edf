"""Everything a resumed run restores beyond the weights, the optimizer and the sampler's place,
saved and restored here through Lightning's public hooks (:class:`RunState`, a callback
``build_trainer`` adds to every trainer):

- **random number generators** (``rng_state``), the **schedule position** (a resumed run with a
  raised ``trainer.max_steps`` follows the longer schedule), **an epoch that ``max_steps`` cut
  short** reopened, and **a checkpoint at the end of training**;
- **an interruption**: Ctrl-C (SIGINT) or SIGTERM writes ``last.ckpt`` at the next step boundary
  and stops with :class:`RunInterrupted` (the recipe prints the command that continues);
- **a checkpoint by time** (``runtime.checkpoint_every_minutes``): ``last.ckpt`` written at the
  first step boundary that long after the previous save, so a kill no signal announces (SIGKILL,
  the OOM killer, a lost node) loses minutes of training, not an epoch; every rank takes the same
  decision (one all-reduce per step, shared with the interruption's);
- **one name per checkpoint**: every save of ``last.ckpt`` goes to that name, never to
  Lightning's versioned ``last-v1.ckpt`` (which ``ckpt_path=last`` does not read);
- **the state of the run's other parts**: each object the LightningModule lists in its
  ``run_state_parts()`` (``state_dict()`` -> top-level checkpoint entries, ``load_state_dict(checkpoint)``):
  the DPO reference's precomputed log-prob tables (:mod:`rolemrc.modules.reference` computes them
  and says which rows they belong to). A part whose state differs by rank (``per_rank = True``:
  GRPO's sampling RNG and the rollouts it keeps for reuse) is gathered from every rank into
  ``per_rank_state`` and each rank restores its own.

The train sampler's place is the sampler's own (:class:`rolemrc.data.sampler.SamplerPlace`, saved
once, with the train loader's state); SLURM's checkpoint-and-requeue is :mod:`rolemrc.run.requeue`.
Two things continue from the run folder rather than the checkpoint, because they start before
any checkpoint is read: which folder ``ckpt_path=last`` continues is decided before Hydra starts
(:mod:`rolemrc.run.resume`), and the loggers continue their files (:mod:`rolemrc.loggers`: the CSV
rows after the resumed step are replaced, the W&B run id is kept in the folder).

One Lightning gap needs its private checkpoint format: at the end of a run stopped by
``max_steps`` Lightning saves its loop state as if the epoch had finished.
:func:`reopen_epoch_stopped_by_max_steps` edits that state, and is the only place that reads
``checkpoint["loops"]``; ``tests/train/test_checkpointing.py`` checks it against a checkpoint
Lightning itself wrote, so a change of Lightning's format fails there.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from rolemrc.checkpointing.state import map_tensors
from rolemrc.rng import rng_state, set_rng_state

log = logging.getLogger(__name__)

RNG_KEY = "rng_state"  # top-level checkpoint entry: dropout etc. continue exactly after a resume


# ---- RNG, schedule position, epochs cut short, a checkpoint at the end ------------------------
def reopen_epoch_stopped_by_max_steps(checkpoint: dict[str, Any]) -> bool:
    """Set a checkpoint's fit-loop state back into the epoch that ``max_steps`` cut short (its
    last batch never reached); True when it did. Checkpoints saved mid-epoch or at a real epoch
    end are left as they are.

    Lightning saves the checkpoint at the end of such a run as if the epoch had finished (its
    epoch counter already advanced), so resuming with a larger ``trainer.max_steps`` would start
    the next epoch, silently skipping the rest of this one's data, or, with ``max_epochs=1``, stop
    at once. The sampler finds its place from :class:`~rolemrc.data.sampler.SamplerPlace`, so only the epoch counter
    needs to be set back. Reads Lightning's private loop format (see the module's docstring)."""
    loop = checkpoint.get("loops", {}).get("fit_loop")
    if not loop:
        return False
    epochs, batches = loop["epoch_progress"], loop["epoch_loop.batch_progress"]
    done = epochs["current"]["completed"]
    if batches.get("is_last_batch", True) or done < 1 or done < epochs["current"]["ready"]:
        return False  # the epoch ran to its end, or the checkpoint was saved inside it
    if batches["current"]["completed"] < 1:
        return False
    for progress in (epochs["current"], epochs["total"]):
        # a run resumed at an epoch's start has that epoch finished but never counted as started
        progress["ready"] = max(progress["ready"], progress["completed"])
        progress["started"] = max(progress["started"], progress["completed"])
        progress["completed"] -= 1
        progress["processed"] = min(progress["processed"], progress["completed"])
    checkpoint["epoch"] = epochs["current"]["completed"]
    return True


def saved_as_a_step_ended(checkpoint: dict[str, Any]) -> bool:
    """Whether a checkpoint was saved as its last step ended (``on_train_batch_end``: before any
    validation of that step), from Lightning's batch progress (the same test as its own restart
    stages): the batch was processed, not yet counted completed."""
    loop = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    total = (loop.get("epoch_loop.batch_progress") or {}).get("total")
    return bool(total) and total["processed"] >= 1 and total["completed"] == total["processed"] - 1


def completed_epochs(checkpoint: dict[str, Any]) -> int:
    """Complete epochs a checkpoint's run trained (an epoch ``max_steps`` cut short is not one);
    ``checkpoint`` is left as it is."""
    if not (checkpoint.get("loops") or {}).get("fit_loop"):
        return 0
    probe = {"loops": copy.deepcopy(checkpoint["loops"])}
    reopen_epoch_stopped_by_max_steps(probe)
    loop = probe["loops"]["fit_loop"]
    done = int(loop["epoch_progress"]["current"]["completed"])
    # saved as the epoch's last step ended (a checkpoint interval that divides the epoch): Lightning
    # counts the epoch complete once it restores it (its restart from on_train_batch_end)
    if loop["epoch_loop.batch_progress"].get("is_last_batch") and saved_as_a_step_ended(checkpoint) \
            and done < loop["epoch_progress"]["current"]["ready"]:
        done += 1
    return done


def redo_validation_of_restored_step(trainer: L.Trainer) -> bool:
    """A checkpoint saved as a step ended (every ``checkpoint_every_n_steps``, an interruption) is
    written before that step's validation runs; resumed from it, Lightning skips that validation
    as if it had run, so a validation killed there would be lost (``metrics.csv`` short of its
    row, the summary's ``val/loss`` empty). Here Lightning is told the validation was cut short,
    so it runs it again before training on (its own path for a checkpoint saved mid-validation);
    only where it would validate at that step. Reads Lightning's private loop state (its restart
    stages), like :func:`reopen_epoch_stopped_by_max_steps`; ``tests/train/test_resume_promises.py``
    checks the row comes back."""
    from lightning.pytorch.loops.evaluation_loop import RestartStage

    epoch_loop = trainer.fit_loop.epoch_loop
    if not epoch_loop.restarted_on_train_batch_end:
        return False
    epoch_loop.val_loop._restart_stage = RestartStage.RESTARTED_MID_EVALUATION
    epoch_loop.val_loop.restarting = False  # a whole validation, from its first batch
    return True


def lr_from_schedule(trainer: L.Trainer) -> None:
    """Each learning rate as this run's schedule gives it at the current step. A no-op on a fresh
    run and on a resume with the same config; after a resume with a raised ``trainer.max_steps`` (a
    longer schedule) the restored optimizer's rate, the saved run's, is replaced."""
    for config in trainer.lr_scheduler_configs:
        sched = config.scheduler
        if isinstance(sched, torch.optim.lr_scheduler.LambdaLR):
            for group, base, lam in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
                group["lr"] = base * lam(sched.last_epoch)


PER_RANK_KEY = "per_rank_state"  # top-level checkpoint entry: every rank's entries of its per-rank parts, by rank


def gather_per_rank(entries: dict[str, Any], world_size: int) -> list[dict[str, Any]]:
    """Every rank's ``entries`` (a per-rank part's state: GRPO's sampling RNG, which is seeded by
    rank, and the rollouts each rank keeps for reuse), in rank order. Whichever rank writes the
    checkpoint (rank 0 under DDP, rank 0's objects under FSDP2's distributed checkpoint) holds all
    of them; a collective, as every rank saves together. Tensors go to the CPU first."""
    entries = map_tensors(entries, lambda t: t.detach().cpu())
    if world_size <= 1 or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [entries]
    gathered: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(gathered, entries)
    return gathered


def per_rank_entries(checkpoint: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """This rank's entries of :func:`gather_per_rank` in ``checkpoint``. A checkpoint from before
    per-rank entries holds one copy at its top level (rank 0's), returned as it is. One saved by
    another number of ranks cannot give each rank its own: the per-rank parts start afresh, said."""
    saved = checkpoint.get(PER_RANK_KEY)
    if saved is None:
        return checkpoint
    if len(saved) != world_size:
        log.warning("the checkpoint was saved by %d rank(s) and this run has %d: per-rank state (GRPO's sampling "
                    "RNG, rollouts kept for reuse) starts afresh, so rollouts differ from the run that saved it",
                    len(saved), world_size)
        return {}
    return saved[rank]


class RunInterrupted(Exception):
    """Training stopped by SIGINT (Ctrl-C) or SIGTERM after a checkpoint at a step boundary;
    the recipe prints how to continue and exits with status 128 + ``signum``."""

    def __init__(self, signum: int, step: int, checkpoint: str) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"interrupted by {signal.Signals(signum).name} at step {step}: checkpoint {checkpoint}")


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _last_of(callback: ModelCheckpoint) -> str:
    """The path a ``save_last`` ModelCheckpoint names ``last.ckpt``, as Lightning itself spells it."""
    try:
        return callback.format_checkpoint_name({}, callback.CHECKPOINT_NAME_LAST)
    except Exception:  # a CHECKPOINT_NAME_LAST with metric placeholders: the plain name
        return os.path.join(str(callback.dirpath), f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}")


def _last_savers(trainer: L.Trainer) -> list[ModelCheckpoint]:
    return [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.save_last and c.dirpath]


def last_checkpoint_path(trainer: L.Trainer) -> str:
    """Where ``last.ckpt`` goes: the ``save_last`` ModelCheckpoint's (``build_callbacks`` always adds one)."""
    for callback in _last_savers(trainer):
        return _last_of(callback)
    return os.path.join(trainer.default_root_dir, "checkpoints", "last.ckpt")


def keep_last_checkpoint_names(trainer: L.Trainer) -> None:
    """Each ``save_last`` ModelCheckpoint treats its ``last.ckpt`` as its own: Lightning writes
    ``last-v1.ckpt`` beside a ``last.ckpt`` it does not know it wrote (one saved by an interruption,
    by another process of the same run, or in the folder before it was moved), and ``ckpt_path=last``
    reads ``last.ckpt`` only. ``last_model_path`` is the callback's public record of that file."""
    for callback in _last_savers(trainer):
        callback.last_model_path = _last_of(callback)


def any_rank(trainer: L.Trainer, *flags: bool) -> list[bool]:
    """Each of ``flags``, true on every rank when it is true on any: one all-reduce for them all
    (none in a one-process run), so every rank takes the same decision."""
    if trainer.world_size <= 1:
        return [bool(f) for f in flags]
    counts = torch.tensor([int(bool(f)) for f in flags], device=trainer.strategy.root_device)
    counts = trainer.strategy.reduce(counts, reduce_op="sum")
    return [bool(c) for c in counts.tolist()]


SAVE_COST_FACTOR = 10  # a checkpoint by time waits at least this many times as long as the previous save took


class RunState(L.Callback):
    """Saves the RNG states, and the state of the module's ``run_state_parts()`` (declared with its
    default on :class:`rolemrc.modules.base.PolicyModule`), with every checkpoint and restores
    them (the parts' as Lightning restores the checkpoint, the RNG states
    when training starts, after Lightning's own setup consumed random numbers); puts the learning
    rate where this run's schedule has it; reopens an epoch ``max_steps`` cut short; and saves
    ``last.ckpt`` of each ``save_last`` ModelCheckpoint when training ends at a step no checkpoint holds yet
    (``every_n_train_steps`` saves on those steps only: a run of 10 steps checkpointed every 4
    would end with step 8's). Every rank runs it: the save is collective under FSDP.

    ``checkpoint_every_minutes`` > 0: ``last.ckpt`` is also saved at the first optimizer-step
    boundary that many minutes after the previous save (any save: an epoch end's too), and at
    least :data:`SAVE_COST_FACTOR` times as long after it as the previous save of this callback
    took (a slow save, an 8B model's optimizer state, is not repeated so often that saving
    dominates). Each rank looks at its own clock; the ranks save when any of them finds it due
    (:func:`any_rank`), so they all save at the same step.

    Ctrl-C (SIGINT) and SIGTERM while training only set a flag (a second one acts as usual, at
    once): at the next optimizer-step boundary every rank saves ``last.ckpt`` and training stops
    with :class:`RunInterrupted` once that step's row is logged (before a validation or the next
    batch). Saving in the handler could meet another rank inside a
    collective (see :class:`rolemrc.run.requeue.SlurmRequeue`)."""

    def __init__(self, checkpoint_every_minutes: float = 0.0) -> None:
        self.every_s = float(checkpoint_every_minutes) * 60.0
        self._last_save = time.monotonic()  # the previous save's time (or training's start)
        self._save_took = 0.0  # how long this callback's previous save took
        self._saved_step = -1
        self._rng_to_restore: dict[str, Any] | None = None
        self._signum: int | None = None
        self._handlers: dict[int, Any] = {}
        self._redoing_validation = False
        self.restored_before_validation = False
        self._interrupted: RunInterrupted | None = None
        self._rank = 0  # the global rank, set when training starts

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._stop_if_interrupted()
        if self._redoing_validation:  # the restored step's (see redo_validation_of_restored_step)
            self._redoing_validation = False
            # Lightning counted the restored step as a new one when it restored it, and counts it
            # again after this validation: the rows keep the step the uninterrupted run logs
            trainer.fit_loop.epoch_loop._batches_that_stepped -= 1

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._stop_if_interrupted()
        self._redoing_validation = False  # no validation was due at the restored step

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signum = signum
        signal.signal(signum, self._handlers.get(signum, signal.SIG_DFL))  # a second one: at once
        if self._rank == 0:  # Ctrl-C reaches every rank of the terminal's process group: said once
                print(f"\n{signal.Signals(signum).name}: stopping at the end of this optimizer step with a checkpoint "
                  f"(again: stop now, losing the steps since the last checkpoint)", file=sys.stderr, flush=True)

    def _restore_handlers(self) -> None:
        for signum, handler in self._handlers.items():
            signal.signal(signum, handler)
        self._handlers = {}

    def _save_due(self) -> bool:
        """This rank's clock says a checkpoint by time is due."""
        if self.every_s <= 0:
            return False
        return time.monotonic() - self._last_save >= max(self.every_s, SAVE_COST_FACTOR * self._save_took)

    def _save_last(self, trainer: L.Trainer, path: str) -> None:
        """Save ``last.ckpt`` at ``path``, recorded as every ``save_last`` callback's own first
        (the record is part of what is saved), and time the save."""
        for callback in _last_savers(trainer):
            if _last_of(callback) == path:
                callback.last_model_path = path
        started = time.monotonic()
        trainer.save_checkpoint(path, weights_only=False)
        self._save_took = time.monotonic() - started
        self._last_save = time.monotonic()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not bool(batch["step_end"]):  # mid-accumulation: a partial step's gradients are in no checkpoint
            return
        signalled, due = any_rank(trainer, self._signum is not None, self._save_due())
        if not (signalled or due):
            return
        path = last_checkpoint_path(trainer)
        if trainer.global_step != self._saved_step:
            self._save_last(trainer, path)
            if not signalled:
                log.info("step %d: checkpoint %s (runtime.checkpoint_every_minutes=%g; the save took %.1f s)",
                         trainer.global_step, path, self.every_s / 60, self._save_took)
        if not signalled:
            return
        signum = trainer.strategy.broadcast(self._signum or signal.SIGTERM, src=0)
        # Stopped at the next hook: Lightning logs this step's row after this one (a resume
        # starts after it), and a validation due now is left to the resume, which redoes it
        self._interrupted = RunInterrupted(int(signum), trainer.global_step, path)

    def _stop_if_interrupted(self) -> None:
        if self._interrupted is not None:
            stop, self._interrupted = self._interrupted, None
            self._restore_handlers()
            raise stop

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop_if_interrupted()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore_handlers()

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint[RNG_KEY] = rng_state()
        own: dict[str, Any] = {}
        for part in pl_module.run_state_parts():
            (own if part.per_rank else checkpoint).update(part.state_dict())
        if any(part.per_rank for part in pl_module.run_state_parts()):
            checkpoint[PER_RANK_KEY] = gather_per_rank(own, trainer.world_size)
        self._saved_step = trainer.global_step
        self._last_save = time.monotonic()  # any save (an epoch end's too) restarts the clock

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        # callbacks see the checkpoint before Lightning restores its loops
        if reopen_epoch_stopped_by_max_steps(checkpoint):
            log.info("resuming at step %d inside epoch %d, which trainer.max_steps had stopped",
                     checkpoint.get("global_step", -1), checkpoint["epoch"])
        self._rng_to_restore = checkpoint.get(RNG_KEY)
        self._saved_step = int(checkpoint.get("global_step", -1))  # nothing new to save at this step
        self.restored_before_validation = saved_as_a_step_ended(checkpoint)
        per_rank = per_rank_entries(checkpoint, trainer.global_rank, trainer.world_size)
        for part in pl_module.run_state_parts():
            part.load_state_dict(per_rank if getattr(part, "per_rank", False) else checkpoint)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._rng_to_restore is not None:
            set_rng_state(self._rng_to_restore)
            self._rng_to_restore = None
        lr_from_schedule(trainer)
        self._redoing_validation = redo_validation_of_restored_step(trainer)
        self._rank = trainer.global_rank
        keep_last_checkpoint_names(trainer)  # after the callbacks' state was restored from the checkpoint
        self._last_save = time.monotonic()
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self._signum = None
            for signum in STOP_SIGNALS:
                self._handlers[signum] = signal.getsignal(signum)
                signal.signal(signum, self._on_signal)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore_handlers()  # what follows (the export) is interrupted as usual; a resume redoes it
        if trainer.global_step == self._saved_step or trainer.global_step == 0:
            return
        for callback in _last_savers(trainer):
            path = _last_of(callback)
            log.info("end of training at step %d: checkpoint %s", trainer.global_step, path)
            self._save_last(trainer, path)
