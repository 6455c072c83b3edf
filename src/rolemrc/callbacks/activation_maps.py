"""``callbacks=activation_maps``: at the end of every N-th validation round, the activation-frequency
maps (paper §7) of the model in training on a fixed, task-balanced subset of the test prompts, as
heatmaps, plus (``compare_to_start``) their discrepancy against the maps at the start of training.

    python train.py callbacks=[default,activation_maps] logger=wandb

Written into ``<out_dir>`` (default ``<run_dir>/callbacks/activation_maps``), rank 0 only:

- ``start.npz`` / ``start.png``: the maps when training started (with ``compare_to_start``);
- ``step_<n>.png``: the frequency maps at global step n, one panel per dimension and ALL;
- ``step_<n>_discrepancy.png``: maps now minus maps at the start (with ``compare_to_start``);
- ``step_<n>.npz`` (:func:`rolemrc.probing.save_maps`): with ``compare_to_start`` ``freq_a`` holds
  the start and ``freq_b`` step n (``names`` says so), plus ``diff`` = b - a and ``layer_change``;
  without it ``freq_a`` is step n.

Logged: W&B images ``activation_maps/frequency`` and ``activation_maps/discrepancy``, and to every
logger ``activation_maps/<G>/mean_abs_change`` (mean |now - start| over layers and neurons, per
group G) and ``activation_maps/seconds``.

The start maps are part of the callback's checkpointed state, so after a resume the discrepancy is
still against the start of the whole run, not of the resumed part.

Ranks: single device / DDP: rank 0 alone runs the probe forwards. FSDP2: every forward all-gathers
weights from every rank, so every rank runs the same forwards (same prompts, same batches) and only
rank 0 writes and logs.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers import WandbLogger

# Helpers both callbacks share (rank handling, test sources, the chat format).
from rolemrc.callbacks.judge_scores import chat_of, is_sharded, test_sources
from rolemrc.data.readers import read_examples
from rolemrc.probing.capture import check_site
from rolemrc.probing.maps import (
    RANK_BY,
    FrequencyMaps,
    compute_frequency_maps,
    discrepancy,
    save_maps,
)
from rolemrc.probing.plots import plot_maps
from rolemrc.tasks import TASKS, balanced_subset

log = logging.getLogger(__name__)


def maps_to_state(maps: FrequencyMaps) -> dict[str, Any]:
    """Plain types and float64 tensors (exact, and loadable with ``torch.load(weights_only=True)``)."""
    return {"freq": {g: torch.from_numpy(f.copy()) for g, f in maps.freq.items()}, "n_cases": dict(maps.n_cases),
            "site": maps.site, "top_fraction": maps.top_fraction, "rank_by": maps.rank_by}


def maps_from_state(state: dict[str, Any]) -> FrequencyMaps:
    return FrequencyMaps({g: t.numpy() for g, t in state["freq"].items()}, dict(state["n_cases"]), state["site"],
                         float(state["top_fraction"]), state["rank_by"])


class ActivationMaps(L.Callback):
    """Frequency maps of the live model every ``every_n_val`` validation rounds.

    Args:
        every_n_val: run on every N-th validation round (sanity checks are not counted).
        n_items: test prompts, taken round-robin over the RoleMRC tasks (``balanced_subset``).
        site, top_fraction, rank_by, batch_size, max_prompt_length: as in ``conf/probe.yaml``.
        compare_to_start: also map the model when training starts and log the discrepancy.
        test: test sources (``[{path: ...}]``); None: the training config's ``data.test``.
        out_dir: where the files go; None: ``<run_dir>/callbacks/activation_maps``.
        max_columns: heatmap columns at most (wider layers are pooled, see ``plot_maps``).
        image_key: prefix of the W&B image keys and scalar names.
    """

    def __init__(
        self,
        every_n_val: int = 1,
        n_items: int = 36,
        site: str = "mlp_out",
        top_fraction: float = 0.2,
        rank_by: str = "value",
        batch_size: int = 4,
        max_prompt_length: int | None = None,
        compare_to_start: bool = True,
        test: Any = None,
        out_dir: str | None = None,
        max_columns: int = 1024,
        image_key: str = "activation_maps",
    ) -> None:
        if every_n_val < 1 or n_items < 1 or batch_size < 1:
            raise ValueError("activation_maps: every_n_val, n_items and batch_size must be >= 1")
        check_site(site)
        if not 0.0 < top_fraction <= 1.0:
            raise ValueError(f"activation_maps.top_fraction must be in (0, 1], got {top_fraction}")
        if rank_by not in RANK_BY:
            raise ValueError(f"activation_maps.rank_by must be one of {RANK_BY}, got {rank_by!r}")
        self.every_n_val, self.n_items, self.compare_to_start, self.test = every_n_val, n_items, compare_to_start, test
        self.site, self.top_fraction, self.rank_by = site, top_fraction, rank_by
        self.batch_size, self.max_prompt_length = batch_size, max_prompt_length
        self.out_dir, self.max_columns, self.image_key = out_dir, max_columns, image_key
        self.rounds = 0  # validation rounds seen
        self.start: FrequencyMaps | None = None  # maps when training started (checkpointed)
        self._items: list[Any] = []
        self._chat: Any = None
        self._out = Path(".")

    # ---- lifecycle -----------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._chat = chat_of(trainer)
        sources, on_error = test_sources(self.test, trainer)
        items, _ = read_examples(sources, "test", on_error)
        # Maps are grouped by the judged dimensions: only RoleMRC tasks have them.
        items = [it for it in items if it.task in TASKS]
        if not items:
            raise ValueError("activation_maps: no test item of a RoleMRC task in the test sources")
        self._items = balanced_subset(items, self.n_items)
        default_out = Path(trainer.default_root_dir) / "callbacks" / "activation_maps"
        self._out = Path(self.out_dir) if self.out_dir else default_out

    def state_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "start": maps_to_state(self.start) if self.start is not None else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rounds = int(state_dict.get("rounds", 0))
        start = state_dict.get("start")
        self.start = maps_from_state(start) if start is not None else None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.compare_to_start or self.start is not None:  # restored from a checkpoint
            return
        self.start = self.compute(trainer, pl_module)
        if self.start is not None and trainer.is_global_zero:
            save_maps(self._out / "start.npz", self.start, names=("start", ""))
            plot_maps(self.start.freq, self._out / "start.png", f"Activation frequency at the start ({self.setting})",
                      max_columns=self.max_columns)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.rounds += 1
        if self.rounds % self.every_n_val == 0:
            self.map_and_log(trainer, pl_module)

    # ---- one round -----------------------------------------------------------------------
    @property
    def setting(self) -> str:
        return f"site {self.site}, top {self.top_fraction:.0%} by {self.rank_by}, {len(self._items)} prompts"

    def compute(self, trainer: L.Trainer, pl_module: L.LightningModule) -> FrequencyMaps | None:
        """The live model's maps on the ranks that run the forwards (None on the others)."""
        model = pl_module.model
        if not (is_sharded(model) or trainer.is_global_zero):
            return None
        # The run's precision (autocast under *-mixed) for start and later maps alike.
        with trainer.precision_plugin.forward_context():
            return compute_frequency_maps(
                model, self._chat, self._items, site=self.site, top_fraction=self.top_fraction,
                batch_size=self.batch_size, rank_by=self.rank_by, max_prompt_length=self.max_prompt_length,
            )

    def map_and_log(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float] | None:
        """Compute, write and log one round; returns the scalars on rank 0 (None elsewhere)."""
        began = time.perf_counter()
        maps = self.compute(trainer, pl_module)
        if maps is None or not trainer.is_global_zero:
            return None
        step = trainer.global_step
        stem = self._out / f"step_{step}"
        images = {"frequency": plot_maps(maps.freq, f"{stem}.png", f"Activation frequency at step {step} "
                                         f"({self.setting})", max_columns=self.max_columns)}
        scalars: dict[str, float] = {}
        if self.compare_to_start and self.start is not None:
            diff = discrepancy(self.start, maps)
            save_maps(f"{stem}.npz", self.start, maps, names=("start", f"step {step}"))
            images["discrepancy"] = plot_maps(diff, f"{stem}_discrepancy.png", f"Step {step} minus start "
                                              f"({self.setting})", diverging=True, max_columns=self.max_columns)
            scalars.update({f"{self.image_key}/{g}/mean_abs_change": float(np.abs(d).mean()) for g, d in diff.items()})
        else:
            save_maps(f"{stem}.npz", maps, names=(f"step {step}", ""))
        scalars[f"{self.image_key}/seconds"] = time.perf_counter() - began
        for lg in trainer.loggers:
            lg.log_metrics(scalars, step=step)
            if isinstance(lg, WandbLogger):
                for name, path in images.items():
                    lg.log_image(key=f"{self.image_key}/{name}", images=[str(path)], step=step,
                                 caption=[f"step {step}: {self.setting}"])
            lg.save()
        log.info("activation_maps at step %d: %s", step, stem)
        return scalars
