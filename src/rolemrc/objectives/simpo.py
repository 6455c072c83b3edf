"""SimPO (Meng et al. 2024, arXiv 2405.14734): a reference-free preference loss over
length-normalised log-probs with a target reward margin.

With the average log-probs per response token ``a_w``, ``a_l`` (summed log-probs over token
counts), the per-pair loss is the logistic loss of ``beta * (a_w - a_l) - gamma``, conservative with
label smoothing ``eps`` as TRL's CPO trainer (``loss_type=simpo``, ``simpo_gamma``):
``-(1 - eps) * logsigmoid(x) - eps * logsigmoid(-x)``. Its rewards are ``beta * a``. The optional
NLL term on the chosen responses (TRL's ``cpo_alpha``) is :func:`~rolemrc.objectives.dpo.preference_loss`'s
``sft_weight``.
"""

from __future__ import annotations

from torch import Tensor

from rolemrc.objectives.dpo import DPOOutput, _smoothed, average_logps

__all__ = ["simpo_loss"]


def simpo_loss(chosen_logps: Tensor, rejected_logps: Tensor, chosen_tokens: Tensor, rejected_tokens: Tensor, *,
               beta: float = 2.0, gamma: float = 1.0, label_smoothing: float = 0.0) -> DPOOutput:
    """Per-pair SimPO loss ``[B]`` from SUMMED log-probs and token counts (all ``[B]``).

    Returns :class:`~rolemrc.objectives.dpo.DPOOutput`: ``chosen_rewards`` / ``rejected_rewards``
    are ``beta`` x the average log-probs (detached), ``logits`` the margin ``a_w - a_l - gamma / beta``.
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    a_w, a_l = average_logps(chosen_logps, chosen_tokens), average_logps(rejected_logps, rejected_tokens)
    logits = a_w - a_l - gamma / beta
    losses = _smoothed(beta * logits, label_smoothing)
    return DPOOutput(losses, beta * a_w.detach(), beta * a_l.detach(), logits)
