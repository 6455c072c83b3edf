"""ORPO (Hong et al. 2024, arXiv 2403.07691): odds-ratio preference optimisation, reference-free.

With the average log-probs per response token ``a_w``, ``a_l`` (the paper's ``log P(y|x)``, as
TRL's ORPOTrainer and the authors' code compute them), the log odds ``log(P / (1 - P))`` and

    log_odds = (a_w - a_l) - (log(1 - e^a_w) - log(1 - e^a_l)),

the per-pair preference term is ``-beta * logsigmoid(log_odds)`` (the paper's ``lambda * L_OR``);
the step adds the NLL of the chosen sequences (:func:`~rolemrc.objectives.logprobs.token_nll`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from rolemrc.objectives.dpo import average_logps

__all__ = ["ORPOOutput", "log1mexp", "orpo_loss"]


class ORPOOutput(NamedTuple):
    """Per-pair ``[B]``: ``losses`` (``-beta * log_odds_ratio``, differentiable), ``log_odds_ratio``
    (``logsigmoid(log_odds)``), ``log_odds_chosen`` (``log_odds``), ``chosen_rewards`` /
    ``rejected_rewards`` (``beta`` x the average log-probs, detached), as TRL names them."""

    losses: Tensor
    log_odds_ratio: Tensor
    log_odds_chosen: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor


def log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurate on both sides of ``-ln 2`` (Maechler 2012)."""
    return torch.where(x < -math.log(2.0), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(chosen_logps: Tensor, rejected_logps: Tensor, chosen_tokens: Tensor, rejected_tokens: Tensor, *,
              beta: float = 0.1) -> ORPOOutput:
    """The odds-ratio term per pair from SUMMED response log-probs and token counts (all ``[B]``)."""
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    # at least float32: 1 - e^a cancels badly in half precision
    dtype = torch.promote_types(chosen_logps.dtype, torch.float32)
    a_w = average_logps(chosen_logps, chosen_tokens).to(dtype)
    a_l = average_logps(rejected_logps, rejected_tokens).to(dtype)
    log_odds = (a_w - a_l) - (log1mexp(a_w) - log1mexp(a_l))
    ratio = F.logsigmoid(log_odds)
    return ORPOOutput(-beta * ratio, ratio, log_odds, beta * a_w.detach(), beta * a_l.detach())
