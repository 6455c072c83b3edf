"""The DPO loss family as pure functions over per-sequence log-probs.

Inputs are ``[B]`` tensors of summed sequence log-probs, e.g. from
:func:`rolemrc.objectives.logprobs.sequence_logprobs`. With the log-ratios ``c = pi_chosen -
ref_chosen``, ``r = pi_rejected - ref_rejected`` and the implicit reward margin ``h = c - r``, the
losses per pair are TRL 1.16's ``DPOTrainer`` loss types (each formula beside its case in
:func:`_pair_loss`), among them

* ``sigmoid`` (DPO; Rafailov et al. 2023), conservative with label smoothing ``eps``
  (the preference label is flipped with probability ``eps``; TRL 1.16's sigmoid has no smoothing,
  its ``robust`` is the unbiased variant): ``-(1 - eps) * logsigmoid(beta * h) - eps * logsigmoid(-beta * h)``;
* ``ipo`` (Azar et al. 2023): ``(h_avg - 1 / (2 * beta)) ** 2`` over log-ratios averaged over each
  response's tokens (give the token counts, or pass averaged log-probs);
* ``hinge`` (SLiC-style): ``relu(1 - beta * h)``;
* ``exo_pair``, ``nca_pair``, ``robust``, ``bco_pair``, ``sppo_hard``, ``aot``, ``aot_unpaired``,
  ``apo_zero``, ``apo_down``, ``discopop``, ``sigmoid_norm``; ``sft`` is the chosen NLL term.

A list of loss types with ``loss_weights`` is their weighted sum (TRL's MPO).

:func:`preference_loss` reduces the per-pair losses to the objective a step minimises: their
mean (:func:`pair_mean`) plus, RoleMRC/RPO-style, ``sft_weight`` x the chosen responses' token-mean
NLL (:func:`rolemrc.objectives.logprobs.token_nll`); both divide by totals the caller gives,
which lets a training step divide by its global batch's pairs and chosen tokens.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from rolemrc.objectives.logprobs import token_nll

LossType = Literal["sigmoid", "ipo", "hinge", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                   "aot_unpaired", "apo_zero", "apo_down", "discopop", "sigmoid_norm", "sft"]
# TRL 1.16's DPOTrainer loss types. "sft" is the chosen responses' token-mean NLL: not a per-pair
# loss, it is preference_loss's sft_weight term (see split_sft).
LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo", "hinge", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
                               "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sigmoid_norm", "sft")
# Older TRL names still accepted (TRL < 1.0 called the unpaired AOT loss "aot_pair").
LOSS_TYPE_ALIASES: dict[str, str] = {"aot_pair": "aot_unpaired"}
# Losses that read label_smoothing (sigmoid: conservative DPO; the others as TRL 1.16).
SMOOTHED: tuple[str, ...] = ("sigmoid", "robust", "exo_pair", "aot", "aot_unpaired")
# Losses over length-averaged log-probs (token counts needed, or averaged inputs given).
LENGTH_NORMALISED: tuple[str, ...] = ("ipo", "sigmoid_norm")

__all__ = ["LOSS_TYPES", "LOSS_TYPE_ALIASES", "DPOOutput", "LossType", "average_logps", "dpo_loss", "loss_terms",
           "pair_mean", "preference_loss", "split_sft"]


class DPOOutput(NamedTuple):
    """Per-pair results, all ``[B]``.

    ``losses``: differentiable per-pair loss (the weighted sum over the loss types; reduce it
    yourself, usually ``.mean()``).
    ``chosen_rewards`` / ``rejected_rewards``: ``beta * (pi - ref)`` of the log-probs given,
    detached (summed log-probs give TRL's ``rewards/*``; length-averaged ones per-token rewards).
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


def loss_terms(loss_type: str | list[str] | tuple[str, ...],
               loss_weights: list[float] | tuple[float, ...] | None = None) -> list[tuple[str, float]]:
    """``(loss type, weight)`` pairs of a single type or a weighted combination (TRL's MPO:
    ``loss_type=[sigmoid, bco_pair]``, ``loss_weights=[0.8, 0.2]``; weights default to 1 each).
    Old names are mapped (:data:`LOSS_TYPE_ALIASES`); an unknown name or a length mismatch is a
    ValueError."""
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    if not types:
        raise ValueError("loss_type names no loss")
    types = [LOSS_TYPE_ALIASES.get(t, t) for t in types]
    for t in types:
        if t not in LOSS_TYPES:
            raise ValueError(f"unknown loss_type {t!r}; expected one of {', '.join(LOSS_TYPES)}")
    if len(set(types)) != len(types):
        raise ValueError(f"loss_type lists a loss twice: {types}")
    weights = [1.0] * len(types) if loss_weights is None else [float(w) for w in loss_weights]
    if len(weights) != len(types):
        raise ValueError(f"loss_weights has {len(weights)} weights for {len(types)} loss types")
    return list(zip(types, weights))


def split_sft(terms: list[tuple[str, float]], sft_weight: float = 0.0) -> tuple[list[tuple[str, float]], float]:
    """The per-pair terms, and the weight of the chosen responses' token-mean NLL: ``sft_weight``
    plus the weight of loss type ``sft`` (TRL's, which is that NLL over the batch)."""
    pair = [(t, w) for t, w in terms if t != "sft"]
    return pair, sft_weight + sum(w for t, w in terms if t == "sft")


def check_settings(beta: float, types: list[str], label_smoothing: float, discopop_tau: float,
                   key: str = "") -> None:
    """The DPO family's settings, checked once for the loss functions and the config schema
    (``key``: the prefix its messages name them with, ``objective.``): ValueError naming the setting."""
    if not beta > 0:
        raise ValueError(f"{key}beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"{key}label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing and not set(types) & set(SMOOTHED):
        raise ValueError(f"{key}label_smoothing only applies to {key}loss_type={'|'.join(SMOOTHED)}, "
                         f"not {', '.join(types)}")
    if "exo_pair" in types and not label_smoothing > 0:
        raise ValueError(f"{key}loss_type=exo_pair needs {key}label_smoothing > 0 (the EXO paper: 1e-3)")
    if not discopop_tau > 0:
        raise ValueError(f"{key}discopop_tau must be > 0, got {discopop_tau}")


def _validate(tensors: tuple[Tensor, ...], beta: float, terms: list[tuple[str, float]], label_smoothing: float,
              discopop_tau: float) -> None:
    types = [t for t, _ in terms]
    if "sft" in types:
        raise ValueError("loss_type 'sft' is not a per-pair loss: give its weight to preference_loss's sft_weight "
                         "(split_sft)")
    check_settings(beta, types, label_smoothing, discopop_tau)
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1:
        raise ValueError(f"all four log-prob tensors must share one shape, got {sorted(shapes)}")


def _smoothed(x: Tensor, eps: float) -> Tensor:
    """``-(1 - eps) * logsigmoid(x) - eps * logsigmoid(-x)``: the logistic loss of a label flipped
    with probability ``eps``."""
    losses = -(1.0 - eps) * F.logsigmoid(x)
    return losses - eps * F.logsigmoid(-x) if eps else losses


def _pair_loss(kind: str, beta: float, c: Tensor, r: Tensor, pol_diff: Tensor, ref_diff: Tensor,
               c_avg: Tensor, r_avg: Tensor, eps: float, tau: float) -> Tensor:
    """One loss type per pair. ``c``/``r``: chosen/rejected log-ratios ``pi - ref`` (summed);
    ``pol_diff``/``ref_diff``: ``pi_c - pi_r``, ``ref_c - ref_r``; ``c_avg``/``r_avg``: the
    log-ratios of length-averaged log-probs."""
    h = c - r
    if kind == "sigmoid":
        return _smoothed(beta * h, eps)
    if kind == "hinge":
        return torch.relu(1.0 - beta * h)
    if kind == "ipo":  # (Azar et al. 2023, eq. 17) over per-token log-ratios
        return (c_avg - r_avg - 1.0 / (2.0 * beta)) ** 2
    if kind == "sigmoid_norm":
        return -F.logsigmoid(beta * (c_avg - r_avg))
    if kind == "exo_pair":  # EXO (Ji et al. 2024, eq. 16): KL(softmax(beta h) || [1 - eps, eps]) for K = 2
        x = beta * h
        return (torch.sigmoid(x) * (F.logsigmoid(x) - math.log1p(-eps))
                + torch.sigmoid(-x) * (F.logsigmoid(-x) - math.log(eps)))
    if kind == "nca_pair":  # NCA (Chen et al. 2024)
        return -F.logsigmoid(beta * c) - 0.5 * F.logsigmoid(-beta * c) - 0.5 * F.logsigmoid(-beta * r)
    if kind == "robust":  # rDPO (Chowdhury et al. 2024): unbiased under label noise eps
        return (-(1.0 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1.0 - 2.0 * eps)
    if kind == "bco_pair":  # BCO on pairs, without the running reward shift
        return -F.logsigmoid(beta * c) - F.logsigmoid(-beta * r)
    if kind == "sppo_hard":  # SPPO (Wu et al. 2024) with hard win probabilities 1 / 0
        return (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2
    if kind == "aot":  # AOT (Melnyk et al. 2024), paired: sorted policy vs sorted reference log-ratios
        return _smoothed(beta * (torch.sort(pol_diff, dim=0)[0] - torch.sort(ref_diff, dim=0)[0]), eps)
    if kind == "aot_unpaired":  # AOT, unpaired: sorted chosen vs sorted rejected log-ratios
        return _smoothed(beta * (torch.sort(c, dim=0)[0] - torch.sort(r, dim=0)[0]), eps)
    if kind == "apo_zero":  # APO (D'Oosterlinck et al. 2024, eq. 7)
        return 1.0 - torch.sigmoid(beta * c) + torch.sigmoid(beta * r)
    if kind == "apo_down":  # APO eq. 8
        return torch.sigmoid(beta * c) + 1.0 - torch.sigmoid(beta * h)
    if kind == "discopop":  # DiscoPOP (Chris Lu et al. 2024, eq. 5): log-ratio-modulated loss
        x = beta * h
        mix = torch.sigmoid(x / tau)
        return -F.logsigmoid(x) * (1.0 - mix) + torch.exp(-x) * mix
    raise ValueError(f"unknown loss_type {kind!r}")


def dpo_loss(policy_chosen_logps: Tensor, policy_rejected_logps: Tensor, ref_chosen_logps: Tensor,
             ref_rejected_logps: Tensor, *, beta: float = 0.1,
             loss_type: LossType | list[str] | tuple[str, ...] = "sigmoid",
             loss_weights: list[float] | tuple[float, ...] | None = None, label_smoothing: float = 0.0,
             chosen_tokens: Tensor | None = None, rejected_tokens: Tensor | None = None,
             discopop_tau: float = 0.05) -> DPOOutput:
    """The DPO loss family per preference pair; all inputs ``[B]``. ``loss_type`` is one type or a
    list combined with ``loss_weights`` (see :func:`loss_terms`); ``chosen_tokens`` /
    ``rejected_tokens``: the responses' token counts, for the length-averaged losses (``ipo``,
    ``sigmoid_norm``); without them those losses take the log-probs given as already averaged.
    ``aot`` and ``aot_unpaired`` sort over the batch given (as TRL: per device micro-batch).

    The reference log-probs are treated as constants (detached here): the reference model is
    fixed by definition, and a reference computed from the same weights with a LoRA adapter
    disabled would otherwise route gradients into the policy.
    """
    terms = loss_terms(loss_type, loss_weights)
    _validate((policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps), beta, terms,
              label_smoothing, discopop_tau)
    ref_chosen_logps = ref_chosen_logps.detach()
    ref_rejected_logps = ref_rejected_logps.detach()
    c = policy_chosen_logps - ref_chosen_logps
    r = policy_rejected_logps - ref_rejected_logps
    c_avg, r_avg = c, r
    if chosen_tokens is not None and rejected_tokens is not None:
        c_avg, r_avg = average_logps(c, chosen_tokens), average_logps(r, rejected_tokens)
    pol_diff = policy_chosen_logps - policy_rejected_logps
    ref_diff = ref_chosen_logps - ref_rejected_logps
    losses = sum(w * _pair_loss(t, beta, c, r, pol_diff, ref_diff, c_avg, r_avg, label_smoothing, discopop_tau)
                 for t, w in terms)
    return DPOOutput(losses, beta * c.detach(), beta * r.detach(), pol_diff - ref_diff)


def pair_mean(values: Tensor, num_pairs: Tensor | None = None) -> Tensor:
    """The mean over pairs of per-pair ``values`` ``[B]``: ``values.mean()``, or with
    ``num_pairs`` ``values.sum() / max(num_pairs, 1)``. Given an optimizer step's pairs, counted
    over all of its micro-batches and ranks, this is the micro-batch's share of the step's mean
    (the shares add up to the global-batch mean however the batch is cut)."""
    if num_pairs is None:
        return values.mean()
    total = values.sum()
    return total / num_pairs.to(total.dtype).clamp(min=1)


def preference_loss(losses: Tensor, chosen_logps: Tensor, *, sft_weight: float = 0.0, num_pairs: Tensor | None = None,
                    num_chosen_tokens: Tensor | int | None = None) -> tuple[Tensor, Tensor | None]:
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
