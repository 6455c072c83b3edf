"""Direct preference optimisation with three ways to get the reference log-probs
(``objective.reference``, see :mod:`rolemrc.modules.reference`):

- ``copy``: a frozen copy of the starting policy (sharded and cast like it);
- ``adapter``: the policy's own base weights with the LoRA adapter switched off (no copy);
- ``precomputed``: one pass before training from the initial weights, cached on disk (keyed by
  model, data, template, precision and attention) and carried in every checkpoint; no reference
  weights are held during training.

``objective.share_prompt``: prompt, chosen and rejected in one sequence (rejected sees the prompt,
not chosen), for the policy and every reference mode, the precomputed pass included. The
log-probs equal the separate computation, so one precomputed cache serves both layouts (its key
does not include share_prompt).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from rolemrc.models.precision import PrecisionPolicy
from rolemrc.modules.base import REWARD_METRICS, PairModule, reward_metrics
from rolemrc.modules.reference import Reference
from rolemrc.objectives.dpo import LENGTH_NORMALISED, average_logps, dpo_loss, loss_terms, split_sft

log = logging.getLogger(__name__)


class DPOModule(PairModule):
    """``objective``: the dpo objective node (beta, loss_type, label_smoothing, sft_weight,
    share_prompt, logprob_chunk_size); ``reference``: where the reference log-probs come from,
    built from the initial weights before any checkpoint is restored
    (:func:`rolemrc.modules.reference.make_reference`)."""

    no_grad_passes: tuple[str, ...] = ("reference_logps",)
    nll_metric = "nll_chosen"

    def __init__(self, model: nn.Module, objective: Any, optim: Any, policy: PrecisionPolicy,
                 reference: Reference, sharding: Any = None, packed_attention: str = "auto") -> None:
        super().__init__(model, objective, optim, policy, sharding, packed_attention)
        self.reference = reference

    def packs_with_context(self) -> bool:
        return bool(self.objective.share_prompt)

    def reference_logps(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        """Summed reference log-probs ``[2B]`` (chosen then rejected), without gradient."""
        return self.reference.logps(self, batch, stage)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.reference.on_fit_start(self)

    # ---- steps -----------------------------------------------------------------------------
    def pair_terms(self, batch: dict[str, torch.Tensor], stage: str) -> dict[str, torch.Tensor]:
        """Per-pair loss terms and metrics of one micro-batch (all ``[B]``)."""
        o = self.objective
        b = batch["index"].shape[0]
        policy, counts = self.pair_logps(self.model, batch)
        ref = self.reference_logps(batch, stage)
        pair_terms, _ = split_sft(loss_terms(o.loss_type, o.loss_weights))
        if pair_terms:
            out = dpo_loss(policy[:b], policy[b:], ref[:b], ref[b:], beta=o.beta,
                           loss_type=[t for t, _ in pair_terms], loss_weights=[w for _, w in pair_terms],
                           label_smoothing=o.label_smoothing, chosen_tokens=counts[:b], rejected_tokens=counts[b:],
                           discopop_tau=o.discopop_tau)
            losses = out.losses
        else:  # loss_type=sft alone: the NLL term is the whole loss
            losses = policy[:b] * 0.0
        # rewards/* as TRL logs them whatever the loss: beta * (policy - reference) of the SUMMED
        # log-probs. IPO's length-normalised rewards (what its loss compares) get names of their own.
        chosen = o.beta * (policy[:b] - ref[:b]).detach()
        rejected = o.beta * (policy[b:] - ref[b:]).detach()
        terms = {"loss": losses, **reward_metrics(chosen, rejected), "logps/chosen": policy[:b],
                 "logps/rejected": policy[b:], "chosen_sum": policy[:b], "chosen_tokens": counts[:b]}
        if self._per_token:
            terms.update(reward_metrics(average_logps(chosen, counts[:b]), average_logps(rejected, counts[b:]),
                                        "rewards_per_token"))
        return terms

    @property
    def _per_token(self) -> bool:
        """Whether a loss compares length-averaged log-probs (ipo, sigmoid_norm): their rewards are logged too."""
        return any(t in LENGTH_NORMALISED for t, _ in loss_terms(self.objective.loss_type))

    @property
    def sft_weight(self) -> float:
        """The chosen NLL term's weight: ``sft_weight`` plus loss type ``sft``'s weight."""
        o = self.objective
        return split_sft(loss_terms(o.loss_type, o.loss_weights), o.sft_weight)[1]

    @property
    def pair_metrics(self) -> tuple[str, ...]:  # type: ignore[override]
        """The per-pair means logged as train/<name>, val/<name>."""
        return REWARD_METRICS + (_PER_TOKEN_METRICS if self._per_token else ())


# ipo / sigmoid_norm only: beta * (policy - reference) of the length-averaged log-probs their losses compare.
_PER_TOKEN_METRICS = ("rewards_per_token/chosen", "rewards_per_token/rejected", "rewards_per_token/accuracies",
                      "rewards_per_token/margins")
