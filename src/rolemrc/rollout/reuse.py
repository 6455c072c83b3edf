"""The step's rollouts between the micro-batches that train on them, and their reuse over
``num_iterations`` optimizer steps (:class:`RolloutReuse`, in every checkpoint)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

REUSE_KEY = "grpo_rollouts"  # top-level checkpoint entry: a generation batch still to be reused


class RolloutReuse:
    """The step's rollouts, one part per micro-batch, handed out in order (:meth:`take`); with
    ``num_iterations > 1`` (the old log-probs recorded in each part at its first use) kept for the
    following ``num_iterations - 1`` steps, with how many uses they had; in every checkpoint taken
    while uses remain (a :func:`run_state_parts` part, each rank's its own), so a run resumed
    mid-reuse trains on the same rollouts."""

    per_rank = True  # each rank keeps its own prompts' rollouts

    def __init__(self, num_iterations: int) -> None:
        self.num_iterations = num_iterations
        self.parts: list[dict[str, Any]] | None = None
        self.uses = 0
        self.metrics: dict[str, float] = {}  # their rollout metrics, logged again at each reuse
        self.buffer: list[dict[str, Any]] = []  # the step's parts not trained yet

    def take(self, batch: dict[str, Any], roll: Callable[[dict[str, Any]], list[dict[str, Any]]]) -> dict[str, Any]:
        """Lay this micro-batch's share of the step's rollouts into ``batch`` (in place, so callbacks
        count the sequences trained): ``roll(batch)`` makes the step's parts at its first micro-batch,
        or, on a reuse (``step_use > 0``), the kept ones come back with their old log-probs. Returns
        the part (its first use records its old log-probs there)."""
        if "step_batch" in batch or not self.buffer:
            use = int(batch.get("step_use", 0))
            if use > 0 and self.parts is not None and self.uses == use:
                device = batch["index"].device
                self.buffer = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in p.items()
                                if k != "rollout_stats"} for p in self.parts]  # logged at the first use
            else:
                if use > 0:  # not expected: a checkpoint holds the rollouts it is in the middle of reusing
                    log.warning("GRPO: use %d of a rollout batch that is not kept (%s): sampling a new one",
                                use, "none kept" if self.parts is None else f"{self.uses} uses kept")
                parts = roll(batch)
                self.buffer = list(parts)  # popped; the kept list (the same parts) is not
                self.parts, self.uses = (parts if self.num_iterations > 1 else None), 0
        part = self.buffer.pop(0)
        if not torch.equal(part["index"].cpu(), batch["index"].cpu()):
            raise RuntimeError(f"GRPO: the micro-batch's prompts {batch['index'].tolist()} are not the ones rolled "
                               f"out for it ({part['index'].tolist()}): the step's prompts came out of order")
        batch.update({k: v for k, v in part.items() if k != "index"})
        if not self.buffer and self.parts is not None:
            self.uses += 1  # the step's last micro-batch: one more use of its rollouts
        return part

    def state_dict(self) -> dict[str, Any]:
        if self.parts is None or self.uses >= self.num_iterations:
            return {}
        parts = [{k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in p.items()
                  if k != "rollout_stats"} for p in self.parts]
        return {REUSE_KEY: {"parts": parts, "uses": self.uses, "metrics": dict(self.metrics)}}

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(REUSE_KEY)
        self.parts, self.uses = (state["parts"], int(state["uses"])) if state else (None, 0)
        self.metrics = dict(state.get("metrics", {})) if state else {}
