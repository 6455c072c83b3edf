"""Reward-model training: the Bradley-Terry pairwise loss over scalar rewards.

A reward model gives each prompt + response one score ``r``. For a pair with chosen score ``r_c``
and rejected score ``r_r`` the loss is ``-log sigmoid(r_c - r_r - m)``, with ``m`` the pair's
optional ``margin`` (0 without one; Llama 2's margin loss, Touvron et al. 2023, arXiv 2307.09288),
averaged over the pairs. ``center_rewards_coefficient`` ``c`` adds ``c * mean((r_c + r_r)^2)``,
which pulls the rewards towards zero mean (Eisenstein et al. 2023, arXiv 2312.09244). These are
TRL 1.16's ``RewardTrainer`` loss and its ``RewardConfig.center_rewards_coefficient`` (default
None: no centring term).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["RewardOutput", "bradley_terry_loss", "reward_step_loss"]


class RewardOutput(NamedTuple):
    """Per-pair terms (all ``[B]``): ``losses`` the Bradley-Terry losses, ``centering`` the
    ``(r_c + r_r)^2`` terms (before the coefficient), ``margins`` ``r_c - r_r`` (detached),
    ``accuracies`` 1.0 where ``r_c > r_r`` (TRL's ``accuracy``: ties count as wrong)."""

    losses: Tensor
    centering: Tensor
    margins: Tensor
    accuracies: Tensor


def bradley_terry_loss(chosen_rewards: Tensor, rejected_rewards: Tensor, margin: Tensor | None = None) -> RewardOutput:
    """Per-pair Bradley-Terry terms from the scores of the chosen and rejected sequences (``[B]``
    each) and an optional per-pair target ``margin`` ``[B]``."""
    if chosen_rewards.shape != rejected_rewards.shape:
        raise ValueError(f"chosen and rejected rewards differ in shape: {tuple(chosen_rewards.shape)} vs "
                         f"{tuple(rejected_rewards.shape)}")
    diff = chosen_rewards - rejected_rewards
    logits = diff if margin is None else diff - margin.to(diff.dtype)
    losses = -F.logsigmoid(logits)
    centering = (chosen_rewards + rejected_rewards) ** 2
    return RewardOutput(losses, centering, diff.detach(), (diff > 0).detach().to(diff.dtype))


def reward_step_loss(out: RewardOutput, center_rewards_coefficient: float | None = None,
                     num_pairs: Tensor | int | None = None) -> Tensor:
    """The mean pair loss plus ``center_rewards_coefficient`` x the mean centring term, over
    ``num_pairs`` pairs (a step's global batch, of which ``out`` holds some: this is their share;
    None: ``out``'s own pairs)."""
    n = out.losses.shape[0] if num_pairs is None else num_pairs
    n = torch.as_tensor(n, dtype=out.losses.dtype, device=out.losses.device).clamp(min=1)
    loss = out.losses.sum() / n
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * out.centering.sum() / n
    return loss
