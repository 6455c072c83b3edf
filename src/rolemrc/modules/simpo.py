"""SimPO: reference-free preference optimisation over length-normalised log-probs
(:func:`rolemrc.objectives.simpo.simpo_loss`); no reference model is built, loaded or sharded
(its registry entry has ``reference=False``).

Logged as TRL's CPO trainer (``loss_type=simpo``) logs it: ``rewards/*`` are ``beta`` x the average
log-probs, ``logps/*`` the average log-probs, ``nll_loss`` the chosen NLL when ``sft_weight``
(TRL's ``cpo_alpha``) is on.
"""

from __future__ import annotations

import torch

from rolemrc.modules.base import PolicyModule
from rolemrc.objectives.dpo import average_logps, pair_mean, preference_loss
from rolemrc.objectives.simpo import simpo_loss

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


class SimPOModule(PolicyModule):
    """``objective``: the simpo node (beta, gamma, label_smoothing, sft_weight, logprob_chunk_size)."""

    def _pair_terms(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-pair loss terms and metrics of one micro-batch (all ``[B]``)."""
        o = self.objective
        b = batch["index"].shape[0]
        logps, counts = self.sequence_logps(self.model, batch, 2 * b)  # chosen then rejected
        out = simpo_loss(logps[:b], logps[b:], counts[:b], counts[b:], beta=o.beta, gamma=o.gamma,
                         label_smoothing=o.label_smoothing)
        avg = average_logps(logps, counts).detach()
        return {"loss": out.losses, "rewards/chosen": out.chosen_rewards, "rewards/rejected": out.rejected_rewards,
                "rewards/accuracies": (out.chosen_rewards > out.rejected_rewards).double(),
                "rewards/margins": out.chosen_rewards - out.rejected_rewards,
                "logps/chosen": avg[:b], "logps/rejected": avg[b:], "chosen_sum": logps[:b], "chosen_tokens": counts[:b]}

    def step_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Mean pair loss plus ``sft_weight`` x the chosen responses' token-mean NLL, each over the
        step's global batch (its totals of pairs and chosen tokens)."""
        terms = self._pair_terms(batch)
        loss, nll = preference_loss(terms["loss"], terms["chosen_sum"], sft_weight=self.objective.sft_weight,
                                    num_pairs=batch["step_pairs"], num_chosen_tokens=batch["step_chosen_tokens"])
        shares = {f"train/{k}": pair_mean(terms[k].detach().double(), batch["step_pairs"]) for k in METRICS}
        if nll is not None:
            shares["train/nll_loss"] = nll
        return loss, shares

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        terms = self._pair_terms(batch)
        self.collect_val(batch["index"], torch.stack([terms[k].detach().double() for k in _VAL], dim=-1))

    def val_metrics(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        cols = dict(zip(_VAL, values.unbind(-1)))
        out = {k: pair_mean(cols[k]) for k in METRICS}
        out["loss"], nll = preference_loss(cols["loss"], cols["chosen_sum"], sft_weight=self.objective.sft_weight,
                                           num_chosen_tokens=cols["chosen_tokens"].sum())
        if nll is not None:
            out["nll_loss"] = nll
        return out


_VAL = ("loss", *METRICS, "chosen_sum", "chosen_tokens")
