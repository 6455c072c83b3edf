"""GRPO (Shao et al. 2024) and its length-debiased variants as pure tensor functions.

Two steps, as TRL 1.16's ``GRPOTrainer`` computes them (conformance: tests/objectives/test_grpo_trl.py):

* :func:`group_advantages`: rewards ``[N]`` of ``N = prompts x num_generations`` completions, laid out
  group by group, -> advantages ``[N]``: the reward minus its group's mean, divided (``scale_rewards``)
  by the group's std (``"group"``, the default), the whole batch's std (``"batch"``) or by nothing
  (``"none"``, Dr. GRPO), with ``+ 1e-4`` in the denominator. NaN rewards (a completion no reward
  could score) are left out of the means and stds and get advantage 0, never a made-up reward.
* :func:`grpo_loss`: per-token log-probs ``[B, T]`` of the completions under the policy being
  trained, under the policy that sampled them (``old``; ``None`` when each batch is used once,
  ``num_iterations=1``: the detached current ones, ratio 1 with the policy gradient intact) and
  under the reference (``None`` when ``beta=0``), the advantages ``[B]`` and the completion mask
  ``[B, T]`` -> the clipped surrogate

      ratio = exp(logp - old),  l_t = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)
              + beta * ratio * (exp(ref - logp) - (ref - logp) - 1)  (the k3 KL estimate)

  The KL term is weighted by the unclipped ratio (``use_bias_correction_kl=True``, TRL's default,
  DeepSeek-V3.2's unbiased reverse-KL gradient): on-policy the ratio is 1 in value but not in
  gradient (``d/dlogp`` adds the KL itself), on a reuse step (``old`` given) it scales the value too;
  the logged ``kl`` is that weighted term's token mean. ``False`` adds the plain k3 estimate.

  aggregated by ``loss_type``: ``grpo`` (each sequence's token mean, then the mean over sequences),
  ``bnpo`` (sum over the micro-batch's tokens / its token count), ``dr_grpo`` (sum / (sequences x
  ``max_completion_length``)), ``dapo`` (TRL's default: sum / the tokens of the whole step).
  ``delta`` caps the unclipped ratio (two-sided clipping, as TRL's ``delta``).

Totals: a training step that splits its batch into micro-batches (or ranks) passes the step's global
``num_sequences`` (``grpo``, ``dr_grpo``) and ``num_tokens`` (``dapo``), so the micro-batch losses add
up to the step's loss; by default the micro-batch's own counts are used. ``bnpo`` is by definition
the local token mean (TRL then divides by the accumulation steps: the caller does that).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

GRPOLossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
GRPO_LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo")
ScaleRewards = Literal["group", "batch", "none"]
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")
ADVANTAGE_EPS = 1e-4  # TRL 1.16's constant in the advantages' denominator

__all__ = ["ADVANTAGE_EPS", "GRPO_LOSS_TYPES", "SCALE_REWARDS", "GRPOLossType", "GRPOOutput", "GroupAdvantages",
           "ScaleRewards", "group_advantages", "grpo_loss", "nanstd"]


class GroupAdvantages(NamedTuple):
    """``advantages`` ``[N]`` (0 where the reward is NaN); ``std`` ``[N]``: the std each reward was
    (or, for ``"none"``, would be) divided by; ``is_std_zero`` ``[N]`` bool (TRL logs its mean as
    ``frac_reward_zero_std``: groups that teach nothing)."""

    advantages: Tensor
    std: Tensor
    is_std_zero: Tensor


class GRPOOutput(NamedTuple):
    """``loss``: the scalar to back-propagate; ``per_token_loss`` ``[B, T]`` before masking and
    aggregation; ``metrics``: detached scalars under TRL's names, over this micro-batch's completion
    tokens: ``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean`` (token
    means), ``clip_ratio/low_min`` / ``clip_ratio/high_max`` (min / max over sequences of their
    token means) and, when ``beta != 0``, ``kl`` (token mean of the k3 estimate)."""

    loss: Tensor
    per_token_loss: Tensor
    metrics: dict[str, Tensor]


def nanstd(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Bessel-corrected std ignoring NaNs (NaN where fewer than two values are left)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    var = torch.nansum((x - mean) ** 2, dim=dim, keepdim=True) / (count - 1).clamp(min=1)
    std = torch.where(count > 1, var.sqrt(), torch.full_like(var, float("nan")))
    if keepdim:
        return std
    return std.squeeze() if dim is None else std.squeeze(dim)


def _scale_name(scale_rewards: str | bool) -> str:
    # TRL 1.16 accepts the booleans of its older releases: True -> "group", False -> "none"
    name = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)  # type: ignore[arg-type]
    if name not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {', '.join(SCALE_REWARDS)} (or true/false), "
                         f"got {scale_rewards!r}")
    return str(name)


def group_advantages(rewards: Tensor, num_generations: int,
                     scale_rewards: str | bool = "group") -> GroupAdvantages:
    """Group-normalised advantages of ``rewards`` ``[N]`` (``N`` a multiple of ``num_generations``,
    each prompt's completions next to each other)."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of num_generations={num_generations}")
    scale = _scale_name(scale_rewards)
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:
        std = nanstd(groups, dim=1).repeat_interleave(num_generations)
    else:  # one completion per prompt: no spread to measure
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + ADVANTAGE_EPS)
    return GroupAdvantages(torch.nan_to_num(advantages, nan=0.0), std,
                           torch.isclose(std, torch.zeros_like(std)))


def _validate(per_token_logps: Tensor, advantages: Tensor, mask: Tensor, others: tuple[Tensor | None, ...],
              loss_type: str, beta: float, epsilon: float, epsilon_high: float,
              max_completion_length: int | None) -> None:
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {', '.join(GRPO_LOSS_TYPES)}")
    if per_token_logps.dim() != 2:
        raise ValueError(f"per_token_logps must be [B, T], got shape {tuple(per_token_logps.shape)}")
    for name, t in (("completion_mask", mask), *zip(("old_per_token_logps", "ref_per_token_logps"), others)):
        if t is not None and t.shape != per_token_logps.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, per_token_logps {tuple(per_token_logps.shape)}")
    if advantages.shape not in ((per_token_logps.shape[0],), (per_token_logps.shape[0], 1)):
        raise ValueError(f"advantages must be [B] = [{per_token_logps.shape[0]}], got {tuple(advantages.shape)}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta != 0 and others[1] is None:
        raise ValueError(f"beta={beta} needs ref_per_token_logps (beta=0 builds no reference)")
    if not (epsilon >= 0 and epsilon_high >= 0):
        raise ValueError(f"epsilon and epsilon_high must be >= 0, got {epsilon}, {epsilon_high}")
    if loss_type == "dr_grpo" and not (max_completion_length and max_completion_length > 0):
        raise ValueError("loss_type=dr_grpo needs max_completion_length > 0 (its normaliser)")


def grpo_loss(per_token_logps: Tensor, advantages: Tensor, completion_mask: Tensor, *,
              old_per_token_logps: Tensor | None = None, ref_per_token_logps: Tensor | None = None,
              beta: float = 0.0, epsilon: float = 0.2, epsilon_high: float | None = None,
              loss_type: str = "dapo", max_completion_length: int | None = None, delta: float | None = None,
              num_sequences: Tensor | int | None = None, num_tokens: Tensor | int | None = None,
              use_bias_correction_kl: bool = True) -> GRPOOutput:
    """The clipped GRPO surrogate (see the module docstring) of one micro-batch."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    _validate(per_token_logps, advantages, completion_mask, (old_per_token_logps, ref_per_token_logps),
              loss_type, beta, epsilon, eps_high, max_completion_length)
    mask = completion_mask.to(per_token_logps.dtype)
    adv = advantages.to(per_token_logps.dtype).reshape(-1, 1)
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    ratio = torch.exp(per_token_logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high)
    capped = ratio if delta is None else torch.clamp(ratio, max=delta)
    per_token_loss = -torch.min(capped * adv, clipped * adv)
    kl = None
    if beta != 0:
        diff = ref_per_token_logps - per_token_logps  # type: ignore[operator]
        kl = torch.exp(diff) - diff - 1
        if use_bias_correction_kl:  # x the unclipped ratio: value 1 on-policy, gradient not 0
            kl = kl * ratio
        per_token_loss = per_token_loss + beta * kl

    total = (per_token_loss * mask).sum()
    n_seq = per_token_logps.shape[0] if num_sequences is None else num_sequences
    n_seq_t = torch.as_tensor(n_seq, dtype=total.dtype, device=total.device).clamp(min=1)
    if loss_type == "grpo":
        seq_means = (per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        loss = seq_means.sum() / n_seq_t
    elif loss_type == "bnpo":
        loss = total / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = total / (n_seq_t * max_completion_length)
    else:  # dapo
        n_tok = mask.sum() if num_tokens is None else num_tokens
        loss = total / torch.as_tensor(n_tok, dtype=total.dtype, device=total.device).clamp(min=1)

    with torch.no_grad():
        r, a = ratio.detach(), adv.detach()
        low = ((r < 1 - epsilon) & (a < 0)).to(mask.dtype)
        high = ((r > 1 + eps_high) & (a > 0)).to(mask.dtype)
        count = mask.sum().clamp(min=1.0)
        seq_count = mask.sum(-1)

        def seq_mean(x: Tensor) -> Tensor:  # over sequences with at least one token (empty ones: NaN, skipped)
            return ((x * mask).sum(-1) / seq_count)[seq_count > 0]

        low_seq, high_seq = seq_mean(low), seq_mean(high)
        nan = torch.tensor(float("nan"), dtype=mask.dtype, device=mask.device)
        metrics = {
            "clip_ratio/low_mean": (low * mask).sum() / count,
            "clip_ratio/high_mean": (high * mask).sum() / count,
            "clip_ratio/region_mean": (torch.maximum(low, high) * mask).sum() / count,
            "clip_ratio/low_min": low_seq.min() if low_seq.numel() else nan,
            "clip_ratio/high_max": high_seq.max() if high_seq.numel() else nan,
        }
        if kl is not None:
            metrics["kl"] = (kl.detach() * mask).sum() / count
    return GRPOOutput(loss, per_token_loss, metrics)
