"""RLOO (REINFORCE Leave-One-Out; Ahmadian et al. 2024) as TRL 1.16's ``RLOOTrainer`` computes it, as
pure tensor functions (conformance: tests/objectives/test_rloo_trl.py).

Three steps:

* :func:`sequence_kl`: the KL penalty of each completion, the sum over its completion tokens of
  ``old - ref`` (the first-order log-ratio of the policy that sampled it to the reference; it can
  be negative per token). RLOO puts the KL into the REWARD, one number per sequence, where GRPO
  adds a per-token KL term to the loss.
* :func:`rloo_advantages`: rewards ``[N]`` (``N = prompts x num_generations``, group by group),
  clipped to ``reward_clip_range`` when given, minus ``beta x`` the sequence KL, then each reward
  minus the mean of the OTHER completions of its prompt (the leave-one-out baseline, over the ones
  a reward could score: NaN rewards are left out and get advantage 0). ``normalize_advantages``
  then divides by the std over the whole batch (``(A - mean) / (std + 1e-4)``).
* :func:`rloo_loss`: one importance ratio per SEQUENCE, ``exp(sum logp - sum old)`` over its
  completion tokens, the clipped surrogate ``-min(ratio x A, clip(ratio, 1 - eps, 1 + eps_high) x A)``
  per sequence, then the mean over sequences (``num_sequences``: the step's, so micro-batch losses
  add up to the step's). ``old`` is ``None`` when each rollout trains once and no KL was computed:
  the detached current log-probs, ratio 1 in value, the policy gradient intact.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from rolemrc.objectives.grpo import ADVANTAGE_EPS, GroupAdvantages, nanstd

__all__ = ["RLOOOutput", "rloo_advantages", "rloo_loss", "sequence_kl"]


class RLOOOutput(NamedTuple):
    """``loss``: the scalar to back-propagate; ``per_sequence_loss`` ``[B]``; ``metrics``: TRL's
    ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean`` (means over the
    sequences), ``clip_ratio/low_min``, ``clip_ratio/high_max`` (min / max over the sequences);
    ``weights``: each mean metric's count (sequences), to pool micro-batches and ranks."""

    loss: Tensor
    per_sequence_loss: Tensor
    metrics: dict[str, Tensor]
    weights: dict[str, Tensor]


def sequence_kl(old_per_token_logps: Tensor, ref_per_token_logps: Tensor, completion_mask: Tensor) -> Tensor:
    """``[N]``: each completion's sum over its tokens of ``old - ref`` (no gradient is meant: the
    log-probs of the sampling policy and of the reference)."""
    if old_per_token_logps.shape != ref_per_token_logps.shape or old_per_token_logps.shape != completion_mask.shape:
        raise ValueError(f"old {tuple(old_per_token_logps.shape)}, ref {tuple(ref_per_token_logps.shape)} and "
                         f"completion_mask {tuple(completion_mask.shape)} must have one shape [N, T]")
    mask = completion_mask.to(old_per_token_logps.dtype)
    return ((old_per_token_logps - ref_per_token_logps) * mask).sum(-1)


def rloo_advantages(rewards: Tensor, num_generations: int, *, kl: Tensor | None = None, beta: float = 0.0,
                    reward_clip_range: tuple[float, float] | None = None,
                    normalize_advantages: bool = False) -> GroupAdvantages:
    """Leave-one-out advantages of ``rewards`` ``[N]`` (see the module docstring). ``std``/``is_std_zero``:
    the std of each group's penalised rewards (TRL logs the share of zero ones as ``frac_reward_zero_std``)."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if num_generations < 2 or rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of num_generations={num_generations} "
                         "(RLOO needs at least 2 per prompt)")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta != 0 and (kl is None or kl.shape != rewards.shape):
        raise ValueError(f"beta={beta} needs kl of shape {tuple(rewards.shape)}")
    r = rewards
    if reward_clip_range is not None:
        low, high = reward_clip_range
        r = r.clamp(min=low, max=high)
    if beta != 0:
        r = r - beta * kl.to(r.dtype)  # type: ignore[union-attr]
    groups = r.view(-1, num_generations)
    std = nanstd(groups, dim=1).repeat_interleave(num_generations)
    scorable = (~torch.isnan(groups)).sum(dim=1, keepdim=True)
    total = torch.nansum(groups, dim=1, keepdim=True)
    baseline = ((total - groups) / (scorable - 1)).reshape(-1)  # a lone scorable completion: 0/0, NaN -> 0
    advantages = r - baseline
    if normalize_advantages:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + ADVANTAGE_EPS)
    return GroupAdvantages(torch.nan_to_num(advantages, nan=0.0), std, torch.isclose(std, torch.zeros_like(std)))


def rloo_loss(per_token_logps: Tensor, advantages: Tensor, completion_mask: Tensor, *,
              old_logps: Tensor | None = None, epsilon: float = 0.2, epsilon_high: float | None = None,
              num_sequences: Tensor | int | None = None) -> RLOOOutput:
    """RLOO's clipped sequence-level surrogate of one micro-batch (see the module docstring):
    ``per_token_logps`` ``[B, T]`` (with gradient), ``advantages`` ``[B]``, ``completion_mask``
    ``[B, T]``, ``old_logps`` ``[B]`` the sampling policy's SEQUENCE log-probs (``None``: the
    detached current ones)."""
    if per_token_logps.dim() != 2 or completion_mask.shape != per_token_logps.shape:
        raise ValueError(f"per_token_logps and completion_mask must be [B, T] of one shape, got "
                         f"{tuple(per_token_logps.shape)} and {tuple(completion_mask.shape)}")
    b = per_token_logps.shape[0]
    if advantages.shape not in ((b,), (b, 1)) or (old_logps is not None and old_logps.shape != (b,)):
        raise ValueError(f"advantages and old_logps must be [B] = [{b}], got {tuple(advantages.shape)} and "
                         f"{None if old_logps is None else tuple(old_logps.shape)}")
    eps_high = epsilon if epsilon_high is None else epsilon_high
    if not (epsilon >= 0 and eps_high >= 0):
        raise ValueError(f"epsilon and epsilon_high must be >= 0, got {epsilon}, {eps_high}")
    mask = completion_mask.to(per_token_logps.dtype)
    logps = (per_token_logps * mask).sum(-1)
    old = logps.detach() if old_logps is None else old_logps.to(logps.dtype)
    adv = advantages.reshape(-1).to(logps.dtype)
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high)
    per_sequence = -torch.min(ratio * adv, clipped * adv)
    n = b if num_sequences is None else num_sequences
    loss = per_sequence.sum() / torch.as_tensor(n, dtype=logps.dtype, device=logps.device).clamp(min=1)
    with torch.no_grad():
        r = ratio.detach()
        low = ((r < 1 - epsilon) & (adv < 0)).to(mask.dtype)
        high = ((r > 1 + eps_high) & (adv > 0)).to(mask.dtype)
        region = torch.maximum(low, high)
        count = torch.tensor(float(b), dtype=mask.dtype, device=mask.device)
        nan = torch.tensor(float("nan"), dtype=mask.dtype, device=mask.device)
        metrics = {"clip_ratio/low_mean": low.mean() if b else nan, "clip_ratio/high_mean": high.mean() if b else nan,
                   "clip_ratio/region_mean": region.mean() if b else nan,
                   "clip_ratio/low_min": low.min() if b else nan, "clip_ratio/high_max": high.max() if b else nan}
        weights = {k: count for k in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")}
    return RLOOOutput(loss, per_sequence, metrics, weights)
