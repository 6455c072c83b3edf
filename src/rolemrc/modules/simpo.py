"""SimPO: reference-free preference optimisation over length-normalised log-probs
(:func:`rolemrc.objectives.simpo.simpo_loss`); no reference model is built, loaded or sharded
(its registry entry has ``reference=False``).

Logged as TRL's CPO trainer (``loss_type=simpo``) logs it: ``rewards/*`` are ``beta`` x the average
log-probs, ``logps/*`` the average log-probs, ``nll_loss`` the chosen NLL when ``sft_weight``
(TRL's ``cpo_alpha``) is on.
"""

from __future__ import annotations

import torch

from rolemrc.modules.base import REWARD_METRICS, PairModule, reward_terms
from rolemrc.objectives.simpo import simpo_loss


class SimPOModule(PairModule):
    """``objective``: the simpo node (beta, gamma, label_smoothing, sft_weight, logprob_chunk_size)."""

    pair_metrics = REWARD_METRICS

    sft_weight = property(lambda self: self.objective.sft_weight)

    def pair_terms(self, batch: dict[str, torch.Tensor], stage: str) -> dict[str, torch.Tensor]:
        o = self.objective
        b = batch["index"].shape[0]
        logps, counts = self.pair_logps(self.model, batch)
        out = simpo_loss(logps[:b], logps[b:], counts[:b], counts[b:], beta=o.beta, gamma=o.gamma,
                         label_smoothing=o.label_smoothing)
        return {**reward_terms(out, logps, counts), "chosen_sum": logps[:b], "chosen_tokens": counts[:b]}
