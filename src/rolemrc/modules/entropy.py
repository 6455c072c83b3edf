"""GRPO's entropy bonus state (:class:`EntropyControl`, in every checkpoint): its coefficient and,
for adaptive control (Skywork-OR1, as TRL), the entropy of the last optimizer step."""

from __future__ import annotations

import math
from typing import Any

from rolemrc.objectives.grpo import adaptive_entropy_coef

ENTROPY_KEY = "grpo_entropy_control"  # top-level checkpoint entry: the entropy bonus's coefficient


class EntropyControl:
    """The entropy bonus's coefficient (``entropy_coef``) and, for adaptive control, the token-mean
    entropy of the last optimizer step (``inf`` before the first: no bonus yet, as TRL); in every
    checkpoint (a :func:`run_state_parts` part), so a resumed run applies what the uninterrupted one does.
    ``objective``: the grpo node."""

    per_rank = False  # pooled over every rank: one state

    def __init__(self, objective: Any) -> None:
        self.objective = objective
        self.coef, self.last_entropy = float(objective.entropy_coef), math.inf

    @classmethod
    def of(cls, objective: Any) -> EntropyControl | None:
        """The bonus's state (``entropy_coef != 0`` or ``use_adaptive_entropy``), else None."""
        if objective.entropy_coef == 0.0 and not objective.use_adaptive_entropy:
            return None
        return cls(objective)

    def update(self, per_rank: list[list[dict[str, Any]]]) -> float:
        """After the optimizer step: adaptive control moves the coefficient by the step's token-mean
        entropy over every micro-batch and rank (``per_rank[r][j]["entropy_window"]``: the entropy sum and
        token count the bonus acted on) and keeps that entropy for the next step's gate. Returns the
        coefficient (TRL logs it as ``entropy_coef``)."""
        o = self.objective
        if o.use_adaptive_entropy:
            windows = [e["entropy_window"] for part in per_rank for e in part if "entropy_window" in e]
            entropy = sum(w[0] for w in windows) / max(sum(w[1] for w in windows), 1.0)
            self.coef = adaptive_entropy_coef(self.coef, entropy, target=o.entropy_target, delta=o.entropy_coef_delta,
                                              coef_min=o.entropy_coef_min, coef_max=o.entropy_coef_max)
            self.last_entropy = entropy
        return self.coef

    def state_dict(self) -> dict[str, Any]:
        return {ENTROPY_KEY: {"entropy_coef": self.coef, "last_entropy": self.last_entropy}}

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(ENTROPY_KEY)
        if state:
            self.coef, self.last_entropy = float(state["entropy_coef"]), float(state["last_entropy"])
