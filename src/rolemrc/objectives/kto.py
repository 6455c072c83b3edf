"""KTO (Ethayarajh et al. 2024, arXiv 2402.01306): Kahneman-Tversky optimisation over unpaired
desirable / undesirable examples, against a reference, as TRL 1.16's KTOTrainer computes it.

With the summed response log-probs of the policy ``pi`` and the reference ``ref``, the log ratio
``r = pi - ref`` and the batch's KL estimate ``z`` (:func:`kto_kl`), each example's loss is

    desirable:    desirable_weight   * (1 - sigmoid(beta * (r - z)))
    undesirable:  undesirable_weight * (1 - sigmoid(beta * (z - r)))

(``loss_type=kto``, the paper's eqn 7), or with ``loss_type=apo_zero_unpaired`` (no KL term)
``1 - sigmoid(beta * r)`` and ``sigmoid(beta * r)``. The step's loss is the mean over its examples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["KTO_LOSS_TYPES", "KTOOutput", "kto_kl", "kto_loss", "weight_advice"]

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")  # TRL 1.16's KTOConfig.loss_type


class KTOOutput(NamedTuple):
    """Per example ``[N]``: ``losses`` (weighted, differentiable) and ``rewards`` (``beta * r``, detached)."""

    losses: Tensor
    rewards: Tensor


def kto_kl(kl_logps: Tensor, ref_kl_logps: Tensor, rank_mean: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """The batch's KL estimate from mismatched (prompt, completion) pairs: the mean of policy minus
    reference summed log-probs, detached, averaged over ranks by ``rank_mean`` (TRL gathers each
    rank's mean and averages them), then clamped at 0 (a scalar)."""
    kl = (kl_logps - ref_kl_logps).mean().detach()
    if rank_mean is not None:
        kl = rank_mean(kl)
    return kl.clamp(min=0)


def kto_loss(policy_logps: Tensor, ref_logps: Tensor, desirable: Tensor, kl: Tensor | float = 0.0, *,
             beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
             loss_type: str = "kto") -> KTOOutput:
    """Each example's loss from SUMMED response log-probs ``[N]`` and its label ``desirable`` ``[N]`` (bool)."""
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(KTO_LOSS_TYPES)}, got {loss_type!r}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    r = policy_logps - ref_logps
    if loss_type == "kto":
        good = 1 - torch.sigmoid(beta * (r - kl))
        bad = 1 - torch.sigmoid(beta * (kl - r))
    else:
        good = 1 - torch.sigmoid(beta * r)
        bad = torch.sigmoid(beta * r)
    losses = torch.where(desirable.bool(), desirable_weight * good, undesirable_weight * bad)
    return KTOOutput(losses, beta * r.detach())


def weight_advice(n_desirable: int, n_undesirable: int, desirable_weight: float,
                  undesirable_weight: float) -> str | None:
    """A warning when unbalanced data meets weights outside the paper's range (its eqn 8, as TRL's
    KTOTrainer checks it): ``desirable_weight * n_D : undesirable_weight * n_U`` should lie in
    [1, 4/3]. None when the counts are equal or either weight is in its range. With one label missing
    no weight can balance it: the advice says so, and what to do instead."""
    if n_desirable + n_undesirable and not (n_desirable and n_undesirable):
        has, lacks, label = (("desirable", "undesirable", "false") if n_desirable
                             else ("undesirable", "desirable", "true"))
        return (f"the training data has {n_desirable} desirable and {n_undesirable} undesirable examples: no "
                f"objective.desirable_weight / undesirable_weight can balance a label that is missing (the "
                f"weights only scale the examples there are), so this run trains on "
                f"{has} examples alone; add {lacks} examples (\"label\": {label}) to data.unpaired"
                + (", or train on these with objective=sft" if n_desirable else ""))
    n_d, n_u = max(n_desirable, 1), max(n_undesirable, 1)
    if n_d == n_u:
        return None
    d_low, d_high = round(n_u * undesirable_weight / n_d, 2), round(n_u * undesirable_weight / n_d * 1.33, 2)
    u_low, u_high = round(n_d * desirable_weight / n_u / 1.33, 2), round(n_d * desirable_weight / n_u, 2)
    if d_low <= desirable_weight <= d_high or u_low <= undesirable_weight <= u_high:
        return None
    return (f"{n_desirable} desirable and {n_undesirable} undesirable examples, but objective.desirable_weight="
            f"{desirable_weight} and objective.undesirable_weight={undesirable_weight} are outside the KTO paper's "
            f"range (eqn 8): set EITHER objective.desirable_weight in [{d_low}, {d_high}] OR "
            f"objective.undesirable_weight in [{u_low}, {u_high}]")
