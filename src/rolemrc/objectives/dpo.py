"""The DPO loss family as pure functions over per-sequence log-probs.

Inputs are ``[B]`` tensors of summed (or, for IPO, length-averaged) sequence log-probs, e.g. from
:func:`rolemrc.objectives.logprobs.sequence_logprobs`. With the implicit reward margin

    h = (pi_chosen - pi_rejected) - (ref_chosen - ref_rejected)

the losses per pair are

* ``sigmoid`` (DPO; Rafailov et al. 2023), conservative with label smoothing ``eps``
  (the preference label is flipped with probability ``eps``):
  ``-(1 - eps) * logsigmoid(beta * h) - eps * logsigmoid(-beta * h)``;
* ``ipo`` (Azar et al. 2023): ``(h - 1 / (2 * beta)) ** 2``. The paper's log-likelihoods are
  averaged over the sequence's tokens, not summed: the CALLER passes length-normalised log-probs
  (see :func:`average_logps`); this function does not know the lengths;
* ``hinge`` (SLiC-style): ``relu(1 - beta * h)``.

:func:`preference_loss` reduces the per-pair losses to the objective a step minimises: their
mean (:func:`pair_mean`) plus, RoleMRC/RPO-style, ``sft_weight`` x the chosen responses' token-mean
NLL (:func:`rolemrc.objectives.logprobs.token_nll`); both divide by totals the caller gives,
which lets a training step divide by its global batch's pairs and chosen tokens.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from rolemrc.objectives.logprobs import token_nll

LossType = Literal["sigmoid", "ipo", "hinge"]
LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo", "hinge")

__all__ = ["LOSS_TYPES", "DPOOutput", "LossType", "average_logps", "dpo_loss", "pair_mean",
           "preference_loss"]


class DPOOutput(NamedTuple):
    """Per-pair results, all ``[B]``.

    ``losses``: differentiable per-pair loss (reduce it yourself, usually ``.mean()``).
    ``chosen_rewards`` / ``rejected_rewards``: ``beta * (pi - ref)`` of the log-probs given,
    detached (for IPO the caller gives length-averaged ones: these are then per-token rewards,
    not TRL's ``rewards/*``, which are always from summed log-probs).
    ``logits``: the margin ``h`` above (before ``beta``), still attached to the graph.
    """

    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor
    logits: Tensor


def average_logps(logps: Tensor, num_tokens: Tensor) -> Tensor:
    """Length-normalise summed sequence log-probs ``[S]`` by token counts ``[S]`` (for IPO).

    Empty sequences (0 tokens) give 0 instead of NaN.
    """
    return logps / num_tokens.clamp_min(1).to(logps.dtype)


def _validate(
    tensors: tuple[Tensor, ...], beta: float, loss_type: str, label_smoothing: float
) -> None:
    if loss_type not in LOSS_TYPES:
        options = ", ".join(LOSS_TYPES)
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {options}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError(f"label_smoothing only applies to loss_type='sigmoid', not {loss_type!r}")
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1:
        raise ValueError(f"all four log-prob tensors must share one shape, got {sorted(shapes)}")


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    loss_type: LossType = "sigmoid",
    label_smoothing: float = 0.0,
) -> DPOOutput:
    """DPO / conservative DPO / IPO / hinge loss per preference pair; all inputs ``[B]``.

    The reference log-probs are treated as constants (detached here): the reference model is
    fixed by definition, and a reference computed from the same weights with a LoRA adapter
    disabled would otherwise route gradients into the policy.
    """
    _validate(
        (policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps),
        beta,
        loss_type,
        label_smoothing,
    )
    ref_chosen_logps = ref_chosen_logps.detach()
    ref_rejected_logps = ref_rejected_logps.detach()

    h = (policy_chosen_logps - policy_rejected_logps) - (ref_chosen_logps - ref_rejected_logps)
    if loss_type == "sigmoid":
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h)
        if label_smoothing:
            losses = losses - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:  # hinge
        losses = torch.relu(1.0 - beta * h)

    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps).detach()
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps).detach()
    return DPOOutput(losses, chosen_rewards, rejected_rewards, h)


def pair_mean(values: Tensor, num_pairs: Tensor | None = None) -> Tensor:
    """The mean over pairs of per-pair ``values`` ``[B]``: ``values.mean()``, or with
    ``num_pairs`` ``values.sum() / max(num_pairs, 1)``. Given an optimizer step's pairs, counted
    over all of its micro-batches and ranks, this is the micro-batch's share of the step's mean
    (the shares add up to the global-batch mean however the batch is cut)."""
    if num_pairs is None:
        return values.mean()
    total = values.sum()
    return total / num_pairs.to(total.dtype).clamp(min=1)


def preference_loss(
    losses: Tensor,
    chosen_logps: Tensor,
    *,
    sft_weight: float = 0.0,
    num_pairs: Tensor | None = None,
    num_chosen_tokens: Tensor | int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The preference objective of a batch: ``pair_mean(losses, num_pairs)`` plus, when
    ``sft_weight > 0``, ``sft_weight * nll_chosen`` with ``nll_chosen = token_nll(chosen_logps,
    num_chosen_tokens)`` (the chosen responses' summed log-probs ``[B]`` over their tokens).

    Returns ``(loss, nll_chosen)``, ``nll_chosen`` None without the SFT term. ``losses``: the
    per-pair :attr:`DPOOutput.losses`; ``num_pairs`` / ``num_chosen_tokens``: see
    :func:`pair_mean` and :func:`~rolemrc.objectives.logprobs.token_nll`.
    """
    loss = pair_mean(losses, num_pairs)
    if not sft_weight > 0:
        return loss, None
    if num_chosen_tokens is None:
        raise ValueError("sft_weight > 0 needs num_chosen_tokens (the chosen responses' token count)")
    nll = token_nll(chosen_logps, num_chosen_tokens)
    return loss + sft_weight * nll, nll
