"""GRPO (Shao et al. 2024) and TRL 1.16's family of GRPO losses as pure tensor functions.

Two steps, as TRL 1.16's ``GRPOTrainer`` computes them (conformance: tests/objectives/test_grpo_trl.py):

* :func:`group_advantages`: rewards ``[N]`` of ``N = prompts x num_generations`` completions, laid out
  group by group, -> advantages ``[N]``: the reward minus its group's mean, divided (``scale_rewards``)
  by the group's std (``"group"``, the default), the whole batch's std (``"batch"``) or by nothing
  (``"none"``, Dr. GRPO), with ``+ 1e-4`` in the denominator. NaN rewards (a completion no reward
  could score) are left out of the means and stds and get advantage 0, never a made-up reward.
  That is ``multi_objective_aggregation="sum_then_normalize"`` (TRL's default: the weighted sum of
  the rewards, normalised); :func:`normalized_sum_advantages` is ``"normalize_then_sum"`` (GDPO).
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

  TRL's other loss types: ``cispo`` (MiniMax-M1: ``-min(ratio, epsilon_high).detach() * A * logp``,
  dapo's normaliser), ``sapo`` (a sigmoid gate ``4/tau sigmoid(tau (ratio - 1))`` for the clip, tau by
  the advantage's sign; grpo's normaliser), ``luspo`` (the clipped surrogate summed per sequence, then
  the mean over sequences) and ``vespo`` (a detached Gamma weight :func:`vespo_weights` of the sequence
  ratio on ``-A * logp``, dapo's normaliser). ``importance_sampling_level="sequence"`` (GSPO) uses one
  ratio per sequence, the exp of its token-mean log-ratio. ``token_mask`` (e.g. :func:`high_entropy_mask`,
  ``top_entropy_quantile``) and ``off_policy_mask_threshold`` (:func:`off_policy_mask`) drop tokens or
  sequences from the policy term, not from the KL term, as TRL.

vLLM rollouts (``vllm_importance_sampling_correction``): :func:`vllm_importance_weights` of the sampled
tokens' log-probs as vLLM returned them and as the trainer scores them, a weight on each token's (or
sequence's) policy term (``importance_sampling_ratio``); :func:`vllm_sampling_stats` what TRL logs of it.

The entropy bonus (``entropy_coef``, TRL 1.16's): ``loss - coef * H`` with ``H`` the token mean of the
per-token entropies (with gradient) over the tokens the policy term acts on (:func:`entropy_term`), never
rescaled by a loss type's normaliser; Skywork-OR1's adaptive control (``use_adaptive_entropy``) applies the
coefficient only while the last step's entropy is at or below ``entropy_target``
(:func:`applied_entropy_coef`) and moves it by ``entropy_coef_delta`` after every optimizer step
(:func:`adaptive_entropy_coef`).

Totals: a training step that splits its batch into micro-batches (or ranks) passes the step's global
``num_sequences`` (``grpo``, ``dr_grpo``) and ``num_tokens`` (``dapo``), so the micro-batch losses add
up to the step's loss; by default the micro-batch's own counts are used. ``bnpo`` is by definition
the local token mean (TRL then divides by the accumulation steps: the caller does that).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

GRPOLossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
GRPO_LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = ("token", "sequence")
VLLM_IMPORTANCE_SAMPLING_MODES: tuple[str, ...] = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
MULTI_OBJECTIVE_AGGREGATIONS: tuple[str, ...] = ("sum_then_normalize", "normalize_then_sum")
ScaleRewards = Literal["group", "batch", "none"]
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")
ADVANTAGE_EPS = 1e-4  # TRL 1.16's constant in the advantages' denominator

__all__ = ["ADVANTAGE_EPS", "GRPO_LOSS_TYPES", "EntropyTerm", "adaptive_entropy_coef", "applied_entropy_coef",
           "entropy_term", "VLLM_IMPORTANCE_SAMPLING_MODES", "vllm_importance_weights", "vllm_sampling_stats", "IMPORTANCE_SAMPLING_LEVELS", "MULTI_OBJECTIVE_AGGREGATIONS",
           "SCALE_REWARDS", "GRPOLossType", "GRPOOutput", "GroupAdvantages", "ScaleRewards", "group_advantages",
           "grpo_loss", "high_entropy_mask", "nanstd", "normalized_sum_advantages", "off_policy_mask", "vespo_weights"]


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
    weights: dict[str, Tensor]  # each mean metric's count (tokens or sequences): how to pool micro-batches, ranks


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


def normalized_sum_advantages(per_reward: Tensor, weights: Tensor, num_generations: int) -> GroupAdvantages:
    """``multi_objective_aggregation="normalize_then_sum"`` (GDPO): each reward ``per_reward[:, k]``
    ``[N, K]`` normalised within its group (minus the group's mean, divided by its std ``+ 1e-4``,
    NaN entries left out), the weighted sum over the rewards (NaN where no reward applies: advantage
    0), then normalised over the whole batch (minus its mean, divided by its std ``+ 1e-4``);
    ``scale_rewards`` plays no part. ``std``/``is_std_zero``: the batch std's. Pass the whole
    generation batch (every rank's completions): the last step is a batch statistic."""
    if per_reward.dim() != 2 or weights.shape != (per_reward.shape[1],):
        raise ValueError(f"per_reward must be [N, K] and weights [K], got {tuple(per_reward.shape)} and "
                         f"{tuple(weights.shape)}")
    n, k = per_reward.shape
    if num_generations < 1 or n % num_generations:
        raise ValueError(f"{n} rewards do not split into groups of num_generations={num_generations}")
    grouped = per_reward.view(-1, num_generations, k)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    std = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean)
    normalised = ((grouped - mean) / (std + ADVANTAGE_EPS)).view(n, k)
    rewards = (normalised * weights.to(normalised.dtype)).nansum(dim=1)
    rewards[torch.isnan(per_reward).all(dim=1)] = float("nan")
    batch_std = nanstd(rewards).expand_as(rewards) if n > 1 else torch.zeros_like(rewards)
    advantages = (rewards - torch.nanmean(rewards)) / (batch_std + ADVANTAGE_EPS)
    return GroupAdvantages(torch.nan_to_num(advantages, nan=0.0), batch_std,
                           torch.isclose(batch_std, torch.zeros_like(batch_std)))


def high_entropy_mask(entropies: Tensor, completion_mask: Tensor, top_entropy_quantile: float,
                      pooled: Tensor | None = None) -> Tensor:
    """``top_entropy_quantile`` (rho, "Beyond the 80/20 rule"): bool ``[B, T]``, the completion tokens
    whose entropy is at least the ``1 - rho`` quantile of ``pooled`` (the completion-token entropies
    over every rank, NaN entries ignored; default: this micro-batch's). ``rho = 1`` keeps every
    token, ``rho = 0`` the highest-entropy ones only."""
    if not 0.0 <= top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {top_entropy_quantile}")
    if entropies.shape != completion_mask.shape:
        raise ValueError(f"entropies has shape {tuple(entropies.shape)}, completion_mask {tuple(completion_mask.shape)}")
    keep = completion_mask.bool()
    if pooled is None:  # NaN outside the completion: nanquantile over the completion tokens, no data-dependent shape
        pooled = torch.where(keep, entropies.float(), torch.full_like(entropies, float("nan"), dtype=torch.float32))
    threshold = torch.nanquantile(pooled.float().reshape(-1), 1.0 - top_entropy_quantile)
    return ((entropies * completion_mask.to(entropies.dtype)) >= threshold) & keep  # no token: NaN, none kept


def off_policy_mask(advantages: Tensor, per_token_logps: Tensor, sampling_per_token_logps: Tensor,
                    completion_mask: Tensor, threshold: float) -> Tensor:
    """``off_policy_mask_threshold`` (DeepSeek-V3.2's off-policy sequence masking): ``[B, 1]`` of 1
    (kept) and 0: a sequence is dropped when its advantage is negative AND the token mean of
    ``sampling - current`` log-probs (a forward-KL estimate; NaN tokens count 0) exceeds ``threshold``."""
    mask = completion_mask.to(per_token_logps.dtype)
    diff = torch.nan_to_num(sampling_per_token_logps - per_token_logps.detach(), nan=0.0)
    mean = (diff * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((advantages.reshape(-1, 1) >= 0) | (mean <= threshold)).to(mask.dtype)


class EntropyTerm(NamedTuple):
    """``mean``: the token mean of the entropies over the tokens counted (with their gradient: what the
    bonus adds); ``total`` and ``tokens``: its detached sum and token count (adaptive control pools
    them over a step's micro-batches and ranks)."""

    mean: Tensor
    total: Tensor
    tokens: Tensor


def entropy_term(entropies: Tensor, completion_mask: Tensor, token_mask: Tensor | None = None) -> EntropyTerm:
    """TRL 1.16's entropy bonus term of one micro-batch: the mean of ``entropies`` ``[B, T]`` over the
    completion tokens, or only over those ``token_mask`` keeps (``top_entropy_quantile < 1``: the tokens
    the policy term acts on), 0 with no token."""
    mask = completion_mask.to(entropies.dtype)
    if token_mask is not None:
        mask = mask * token_mask.to(entropies.dtype)
    total, tokens = (entropies * mask).sum(), mask.sum()
    return EntropyTerm(total / tokens.clamp(min=1.0), total.detach(), tokens.detach())


def applied_entropy_coef(coef: float, last_entropy: float, *, adaptive: bool, target: float) -> float:
    """The coefficient a step's micro-batches apply: ``coef``, or with adaptive control (Skywork-OR1)
    ``coef`` only while the previous optimizer step's entropy was at or below ``target``, else 0 (before
    any step: ``last_entropy = inf``, no bonus)."""
    if not adaptive:
        return coef
    return coef if last_entropy <= target else 0.0


def adaptive_entropy_coef(coef: float, entropy: float, *, target: float, delta: float, coef_min: float,
                          coef_max: float) -> float:
    """Skywork-OR1's update after an optimizer step whose token-mean entropy (over its micro-batches and
    ranks) was ``entropy``: ``coef + delta`` (at most ``coef_max``) when it is at or below ``target``,
    else ``coef - delta`` (at least ``coef_min``)."""
    if entropy <= target:
        return min(coef + delta, coef_max)
    return max(coef - delta, coef_min)


def vllm_importance_weights(old_per_token_logps: Tensor, sampling_per_token_logps: Tensor, completion_mask: Tensor,
                            *, mode: str = "sequence_mask", clip_min: float | None = None,
                            clip_max: float | None = 3.0) -> Tensor:
    """TRL 1.16's vLLM importance-sampling correction (``vllm_importance_sampling_correction``): the
    weights of the rollouts' tokens for the gap between the policy that sampled them as the trainer
    scores them (``old``) and as vLLM scored them (``sampling``). ``token_*`` modes: one ratio per token
    ``exp(old - sampling)`` ``[B, T]``; ``sequence_*``: one per sequence, ``exp`` of the sum of those
    differences over its completion tokens ``[B, 1]`` (a NaN sampling log-prob counts 0: ratio 1).
    ``*_truncate`` clamps the ratios to ``[clip_min, clip_max]`` (truncated IS); ``*_mask`` sets those
    outside it to 0 (masked IS). ``None`` bounds are open. No gradient."""
    if mode not in VLLM_IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"vllm_importance_sampling_mode must be one of {', '.join(VLLM_IMPORTANCE_SAMPLING_MODES)}, "
                         f"got {mode!r}")
    with torch.no_grad():
        diff = torch.nan_to_num((old_per_token_logps - sampling_per_token_logps)
                                * completion_mask.to(old_per_token_logps.dtype), nan=0.0)
        if mode.startswith("sequence"):
            diff = diff.sum(-1, keepdim=True)
        ratio = torch.exp(diff)
        if mode.endswith("truncate"):
            if clip_min is None and clip_max is None:
                raise ValueError(f"vllm_importance_sampling_mode={mode} needs clip_min or clip_max")
            return torch.clamp(ratio, min=clip_min, max=clip_max)
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def vllm_sampling_stats(old_per_token_logps: Tensor, sampling_per_token_logps: Tensor, completion_mask: Tensor,
                        ratio: Tensor) -> dict[str, Tensor]:
    """What TRL logs of the correction (``sampling/*``), as sums and extremes a caller pools over
    micro-batches: ``|old - sampling|`` over the completion tokens vLLM scored (``delta_sum``,
    ``delta_count``, ``delta_max``) and the weights (per token over the completion tokens, or one per
    sequence: ``ratio_sum``, ``ratio_count``, ``ratio_min``, ``ratio_max``)."""
    with torch.no_grad():
        keep = completion_mask.bool()
        delta = torch.abs(old_per_token_logps - sampling_per_token_logps)
        delta = delta[keep & ~torch.isnan(delta)]
        flat = ratio.flatten() if ratio.shape[1] == 1 else ratio[keep]
        none = torch.tensor(float("nan"), dtype=ratio.dtype, device=ratio.device)
        return {"delta_sum": delta.sum(), "delta_count": torch.tensor(float(delta.numel())),
                "delta_max": delta.max() if delta.numel() else none,
                "ratio_sum": flat.sum(), "ratio_count": torch.tensor(float(flat.numel())),
                "ratio_min": flat.min() if flat.numel() else none, "ratio_max": flat.max() if flat.numel() else none}


def vespo_weights(advantages: Tensor, log_ratio: Tensor, completion_mask: Tensor, *, k_pos: float = 2.0,
                  lambda_pos: float = 3.0, k_neg: float = 3.0, lambda_neg: float = 2.0,
                  importance_sampling_ratio: Tensor | None = None) -> Tensor:
    """VESPO's sequence weight ``[B, 1]`` (no gradient): ``phi(w) = exp(lambda + k ln w - lambda w)``
    (``phi(1) = 1``) of the sequence ratio ``w = exp(sum of the token log-ratios)`` (each clamped to
    +-20, the sum to [ln 1e-8, 20]), ``k, lambda`` by the advantage's sign (``>= 0``: the ``_pos`` ones);
    with the vLLM correction's token weights, ``w`` also takes the sum of their logs (each in [ln 1e-8, 20])."""
    with torch.no_grad():
        low = math.log(1e-8)
        seq = (torch.clamp(log_ratio, -20.0, 20.0) * completion_mask.to(log_ratio.dtype)).sum(-1, keepdim=True)
        if importance_sampling_ratio is not None:  # log(pi/pi_old) + log(pi_old/pi_sampler), TRL's sum (unmasked)
            seq = seq + torch.clamp(torch.log(importance_sampling_ratio), low, 20.0).sum(-1, keepdim=True)
        log_w = torch.clamp(seq, low, 20.0)
        nonneg = advantages.reshape(-1, 1) >= 0
        k = torch.where(nonneg, k_pos, k_neg).to(log_w.dtype)
        lam = torch.where(nonneg, lambda_pos, lambda_neg).to(log_w.dtype).clamp(min=1e-4)
        return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _validate(per_token_logps: Tensor, advantages: Tensor, mask: Tensor, others: dict[str, Tensor | None],
              loss_type: str, beta: float, epsilon: float, epsilon_high: float,
              max_completion_length: int | None, importance_sampling_level: str) -> None:
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {', '.join(GRPO_LOSS_TYPES)}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)}, "
                         f"got {importance_sampling_level!r}")
    if per_token_logps.dim() != 2:
        raise ValueError(f"per_token_logps must be [B, T], got shape {tuple(per_token_logps.shape)}")
    for name, t in (("completion_mask", mask), *((k, v) for k, v in others.items() if k != "importance_sampling_ratio")):
        if t is not None and t.shape != per_token_logps.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, per_token_logps {tuple(per_token_logps.shape)}")
    ratio = others.get("importance_sampling_ratio")
    if ratio is not None and ratio.shape not in (per_token_logps.shape, (per_token_logps.shape[0], 1)):
        raise ValueError(f"importance_sampling_ratio must be [B, T] or [B, 1], got {tuple(ratio.shape)}")
    if advantages.shape not in ((per_token_logps.shape[0],), (per_token_logps.shape[0], 1)):
        raise ValueError(f"advantages must be [B] = [{per_token_logps.shape[0]}], got {tuple(advantages.shape)}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta != 0 and others["ref_per_token_logps"] is None:
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
              use_bias_correction_kl: bool = True, importance_sampling_level: str = "token",
              sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
              vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0,
              vespo_lambda_neg: float = 2.0, token_mask: Tensor | None = None,
              off_policy_mask_threshold: float | None = None,
              sampling_per_token_logps: Tensor | None = None,
              importance_sampling_ratio: Tensor | None = None) -> GRPOOutput:
    """The GRPO-family loss (see the module docstring) of one micro-batch."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    _validate(per_token_logps, advantages, completion_mask,
              {"old_per_token_logps": old_per_token_logps, "ref_per_token_logps": ref_per_token_logps,
               "token_mask": token_mask, "sampling_per_token_logps": sampling_per_token_logps,
               "importance_sampling_ratio": importance_sampling_ratio},
              loss_type, beta, epsilon, eps_high, max_completion_length, importance_sampling_level)
    mask = completion_mask.to(per_token_logps.dtype)
    adv = advantages.to(per_token_logps.dtype).reshape(-1, 1)
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    log_ratio = per_token_logps - old
    if importance_sampling_level == "sequence":  # GSPO: one ratio per sequence, exp of its token-mean log-ratio
        log_ratio_used = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        log_ratio_used = log_ratio
    ratio = torch.exp(log_ratio_used)  # [B, T] or [B, 1]
    kl = None
    if beta != 0:
        diff = ref_per_token_logps - per_token_logps  # type: ignore[operator]
        kl = torch.exp(diff) - diff - 1
        if use_bias_correction_kl:  # x the unclipped ratio: value 1 on-policy, gradient not 0
            kl = kl * ratio

    phi = None
    if loss_type == "cispo":  # the ratio clipped from above, no gradient through it: a weight on logp
        per_token_loss = -torch.clamp(ratio, max=eps_high).detach() * adv * per_token_logps
    elif loss_type == "sapo":  # a sigmoid gate instead of the hard clip, its temperature by the advantage's sign
        tau = torch.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg).to(ratio.dtype)
        per_token_loss = -(torch.sigmoid(tau * (ratio - 1)) * 4 / tau) * adv
    elif loss_type == "vespo":
        phi = vespo_weights(adv, log_ratio, mask, k_pos=vespo_k_pos, lambda_pos=vespo_lambda_pos,
                            k_neg=vespo_k_neg, lambda_neg=vespo_lambda_neg,
                            importance_sampling_ratio=importance_sampling_ratio)
        per_token_loss = -phi * adv * per_token_logps
    else:  # the clipped surrogate: grpo, bnpo, dr_grpo, dapo, luspo
        clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high)
        capped = ratio if delta is None else torch.clamp(ratio, max=delta)
        per_token_loss = -torch.min(capped * adv, clipped * adv)
    if off_policy_mask_threshold is not None:
        sampling = old if sampling_per_token_logps is None else sampling_per_token_logps
        per_token_loss = per_token_loss * off_policy_mask(adv, per_token_logps, sampling, mask,
                                                          off_policy_mask_threshold)
    if token_mask is not None:
        per_token_loss = per_token_loss * token_mask.to(per_token_loss.dtype)
    if importance_sampling_ratio is not None and loss_type != "vespo":  # vLLM's correction (vespo: in its weight)
        per_token_loss = per_token_loss * importance_sampling_ratio.to(per_token_loss.dtype)
    if kl is not None:
        per_token_loss = per_token_loss + beta * kl
    per_token_loss = per_token_loss.expand_as(mask)  # [B, 1] (a sequence-level ratio) broadcast over the tokens

    total = (per_token_loss * mask).sum()
    n_seq = per_token_logps.shape[0] if num_sequences is None else num_sequences
    n_seq_t = torch.as_tensor(n_seq, dtype=total.dtype, device=total.device).clamp(min=1)
    if loss_type in ("grpo", "sapo"):
        seq_means = (per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        loss = seq_means.sum() / n_seq_t
    elif loss_type == "luspo":  # each sequence's token sum (its loss x its length), then the mean over sequences
        loss = total / n_seq_t
    elif loss_type == "bnpo":
        loss = total / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = total / (n_seq_t * max_completion_length)
    else:  # dapo, cispo, vespo
        n_tok = mask.sum() if num_tokens is None else num_tokens
        loss = total / torch.as_tensor(n_tok, dtype=total.dtype, device=total.device).clamp(min=1)

    with torch.no_grad():
        metrics, weights = _metrics(ratio.detach(), adv, mask, kl, phi, loss_type, epsilon, eps_high)
    return GRPOOutput(loss, per_token_loss, metrics, weights)


def _metrics(ratio: Tensor, adv: Tensor, mask: Tensor, kl: Tensor | None, phi: Tensor | None, loss_type: str,
             epsilon: float, eps_high: float) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """TRL's loss metrics of one micro-batch and the count each mean is over (its completion tokens;
    its sequences for a per-sequence quantity: a sequence-level ratio, VESPO's weight)."""
    tokens = mask.sum()
    sequences = torch.tensor(float(mask.shape[0]), dtype=mask.dtype, device=mask.device)
    metrics: dict[str, Tensor] = {}
    weights: dict[str, Tensor] = {}

    def mean(name: str, x: Tensor) -> None:
        if x.shape[1] == 1:  # one value per sequence
            metrics[name], weights[name] = x.sum() / sequences.clamp(min=1.0), sequences
        else:
            metrics[name], weights[name] = (x * mask).sum() / tokens.clamp(min=1.0), tokens

    if kl is not None:
        mean("kl", kl.detach())
    if loss_type == "cispo":
        mean("cispo_clip_ratio", ((ratio > eps_high) & (adv > 0)).to(mask.dtype))
    elif loss_type == "vespo":
        assert phi is not None
        mean("vespo/phi_seq_mean", phi)
    elif loss_type != "sapo":
        low = ((ratio < 1 - epsilon) & (adv < 0)).to(mask.dtype)
        high = ((ratio > 1 + eps_high) & (adv > 0)).to(mask.dtype)
        mean("clip_ratio/low_mean", low)
        mean("clip_ratio/high_mean", high)
        mean("clip_ratio/region_mean", torch.maximum(low, high))
        nan = torch.tensor(float("nan"), dtype=mask.dtype, device=mask.device)
        if ratio.shape[1] == 1:  # one value per sequence, every sequence
            low_seq, high_seq = low.squeeze(1), high.squeeze(1)
        else:  # each sequence's token mean, over the sequences with a token (NaN ones skipped, as TRL's nanmin)
            seq_count = mask.sum(-1)
            low_seq = ((low * mask).sum(-1) / seq_count)[seq_count > 0]
            high_seq = ((high * mask).sum(-1) / seq_count)[seq_count > 0]
        metrics["clip_ratio/low_min"] = low_seq.min() if low_seq.numel() else nan
        metrics["clip_ratio/high_max"] = high_seq.max() if high_seq.numel() else nan
    return metrics, weights
