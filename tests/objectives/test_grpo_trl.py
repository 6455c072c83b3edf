"""GRPO loss and advantages against TRL 1.16 on the same tensors, for every option.

The loss: TRL's own ``GRPOTrainer._compute_loss`` is called, unbound, on a stand-in trainer whose
forward returns the test's per-token log-probs (and entropies), its attributes set from GRPOConfig's
defaults and the test's options (one process, no accumulation, no vLLM, no entropy bonus), and its
loss, gradient and logged metrics are compared with :func:`grpo_loss` (every loss type, token and
sequence-level ratios, the KL term on- and off-policy, the entropy and off-policy masks).
The advantages are computed inline in TRL's ``_generate_and_score_completions``, not a callable:
:func:`trl_advantages` restates those lines (trl/trainer/grpo_trainer.py 2757-2797 in TRL 1.16.0,
``multi_objective_aggregation="sum_then_normalize"``; :func:`trl_normalize_then_sum` its
``normalize_then_sum`` branch), using TRL's ``nanstd``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl")
from trl import GRPOConfig  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import nanstd as trl_nanstd  # noqa: E402

from rolemrc.objectives.grpo import (  # noqa: E402
    adaptive_entropy_coef,
    applied_entropy_coef,
    entropy_term,
    group_advantages,
    grpo_loss,
    high_entropy_mask,
    normalized_sum_advantages,
    off_policy_mask,
    vllm_importance_weights,
    vllm_sampling_stats,
)

assert trl.__version__ == "1.16.0", "these tests restate TRL 1.16.0's lines; re-read them for another version"

B, T, MAX_LEN = 6, 7, 9
F64 = torch.float64


class _Accelerator:
    num_processes = 1
    sync_gradients = True  # every call ends an optimizer step (no accumulation)

    def reduce(self, x, reduction="sum"):
        return x

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


# GRPOConfig's defaults: the stand-in trainer runs TRL at its defaults unless a test says otherwise
TRL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GRPOConfig) if f.default is not dataclasses.MISSING}


def trl_trainer(logps: torch.Tensor, entropies: torch.Tensor | None = None, **config) -> SimpleNamespace:
    """A stand-in for ``GRPOTrainer`` with the attributes ``_compute_loss`` reads, set from ``config``
    over GRPOConfig's defaults as GRPOTrainer.__init__ sets them (lines 782-983); one process, no
    accumulation, HF generation (no vLLM), no MoE auxiliary loss. Its forward returns ``logps``."""
    args = SimpleNamespace(**{**TRL_DEFAULTS, "steps_per_generation": 1, **config})
    entropy_on = args.entropy_coef != 0.0 or args.use_adaptive_entropy
    trainer = SimpleNamespace(
        args=args, loss_type=args.loss_type, beta=args.beta, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high,
        importance_sampling_level=args.importance_sampling_level, top_entropy_quantile=args.top_entropy_quantile,
        off_policy_mask_threshold=args.off_policy_mask_threshold, use_vllm=args.use_vllm,
        vllm_importance_sampling_correction=args.vllm_importance_sampling_correction,
        entropy_coef=args.entropy_coef, use_adaptive_entropy=args.use_adaptive_entropy,
        _entropy_bonus_enabled=entropy_on, _last_world_entropy=float("inf"), _entropy_window_stats=None,
        aux_loss_enabled=False, max_completion_length=args.max_completion_length,
        current_gradient_accumulation_steps=1, model=SimpleNamespace(training=True), accelerator=_Accelerator(),
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask, get_gamma_weights=GRPOTrainer.get_gamma_weights,
        _metrics={"train": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (
            logps, torch.zeros_like(logps) if entropies is None else entropies, None),
    )
    trainer.get_high_entropy_mask = functools.partial(GRPOTrainer.get_high_entropy_mask, trainer)
    return trainer


def trl_loss(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, old: torch.Tensor | None = None,
             ref: torch.Tensor | None = None, entropies: torch.Tensor | None = None,
             num_items_in_batch: torch.Tensor | None = None, **config) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL 1.16's ``GRPOTrainer._compute_loss`` of these tensors (``config``: GRPOConfig fields over its
    defaults) -> its loss and what it logged (one value per metric)."""
    b, t = logps.shape
    inputs = {"prompt_ids": torch.zeros(b, 2, dtype=torch.long), "prompt_mask": torch.ones(b, 2, dtype=torch.long),
              "completion_ids": torch.zeros(b, t, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages,
              "num_items_in_batch": mask.sum() if num_items_in_batch is None else num_items_in_batch}
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    trainer = trl_trainer(logps, entropies, **config)
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    return loss, {k: v[0] for k, v in trainer._metrics["train"].items()}


def _tensors(seed: int, iterations: int, beta: float):
    g = torch.Generator().manual_seed(seed)
    logps = (-3 * torch.rand(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    # ratios spread well past 1 +- 0.28 so every clipping branch is hit
    old = (logps.detach() + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)) if iterations > 1 else None
    ref = (logps.detach() + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)) if beta else None
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.tensor([7, 3, 1, 5, 7, 2])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    return logps, old, ref, adv, mask


OPTIONS = list(itertools.product(["grpo", "bnpo", "dr_grpo", "dapo"], [0.0, 0.04], [1, 2],
                                 [(0.2, None), (0.2, 0.28)], [None, 1.5]))


@pytest.mark.parametrize("loss_type,beta,iterations,eps,delta", OPTIONS)
def test_loss_gradient_and_metrics_equal_trl(loss_type, beta, iterations, eps, delta):
    """TRL at its defaults (the KL term weighted by the ratio, ``use_bias_correction_kl``): on-policy
    (iterations=1) the weight is 1 but not its gradient; on a reuse step (old log-probs) both move."""
    logps, old, ref, adv, mask = _tensors(7, iterations, beta)
    config = dict(loss_type=loss_type, beta=beta, epsilon=eps[0], epsilon_high=eps[1], delta=delta,
                  max_completion_length=MAX_LEN)
    theirs, expected = trl_loss(logps, adv, mask, old=old, ref=ref, **config)
    (their_grad,) = torch.autograd.grad(theirs, logps)
    ours = grpo_loss(logps, adv, mask, old_per_token_logps=old, ref_per_token_logps=ref, beta=beta,
                     epsilon=eps[0], epsilon_high=eps[1], loss_type=loss_type, max_completion_length=MAX_LEN,
                     delta=delta)
    (our_grad,) = torch.autograd.grad(ours.loss, logps)
    torch.testing.assert_close(ours.loss, theirs)
    torch.testing.assert_close(our_grad, their_grad)
    expected.pop("entropy")
    assert set(ours.metrics) == set(expected)
    for name, value in expected.items():
        assert ours.metrics[name].item() == pytest.approx(value, rel=1e-6, abs=1e-7), name  # TRL counts in float32
    if iterations > 1:  # the ratios really leave the clip range: the comparison covers the clipped branches
        assert expected["clip_ratio/region_mean"] > 0


@pytest.mark.parametrize("iterations", [1, 2])
def test_plain_kl_term_equals_trl_without_bias_correction(iterations):
    logps, old, ref, adv, mask = _tensors(11, iterations, 0.04)
    theirs, expected = trl_loss(logps, adv, mask, old=old, ref=ref, beta=0.04, use_bias_correction_kl=False)
    ours = grpo_loss(logps, adv, mask, old_per_token_logps=old, ref_per_token_logps=ref, beta=0.04,
                     use_bias_correction_kl=False)
    torch.testing.assert_close(ours.loss, theirs)
    torch.testing.assert_close(torch.autograd.grad(ours.loss, logps)[0], torch.autograd.grad(theirs, logps)[0])
    assert ours.metrics["kl"].item() == pytest.approx(expected["kl"], rel=1e-6)


def test_defaults_are_trls():
    """grpo_loss's and objective=grpo's defaults of the options they share with GRPOConfig are TRL's."""
    import inspect

    from rolemrc.config import GRPOObjectiveConfig

    ours = {k: p.default for k, p in inspect.signature(grpo_loss).parameters.items()
            if p.default is not inspect.Parameter.empty}
    config = {f.name: f.default for f in dataclasses.fields(GRPOObjectiveConfig)
              if f.default is not dataclasses.MISSING}
    for key, value in TRL_DEFAULTS.items():
        if key == "max_completion_length":  # grpo_loss: none (dr_grpo's, given); objective=grpo: 256 (docs/rl.md)
            continue
        if key in ours:
            assert ours[key] == value, key
        if key in config:
            assert config[key] == value, key
    assert TRL_DEFAULTS["use_bias_correction_kl"] is True and config["use_bias_correction_kl"] is True


def _assert_equal_trl(config: dict, *, iterations: int, seed: int = 7, entropies: bool = False, **ours_kw):
    """grpo_loss with ``config`` (and ``ours_kw``) against TRL's _compute_loss with ``config``:
    loss, gradient, every metric TRL logs but ``entropy``. Returns TRL's logged metrics."""
    beta = config.get("beta", 0.0)
    logps, old, ref, adv, mask = _tensors(seed, iterations, beta)
    ent = torch.rand(B, T, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64) * 3 \
        if entropies else None
    theirs, expected = trl_loss(logps, adv, mask, old=old, ref=ref, entropies=ent, max_completion_length=MAX_LEN,
                                **config)
    (their_grad,) = torch.autograd.grad(theirs, logps)
    kw = {k: v for k, v in config.items() if k != "top_entropy_quantile"}
    if config.get("top_entropy_quantile", 1.0) < 1.0:
        kw["token_mask"] = high_entropy_mask(ent, mask, config["top_entropy_quantile"])
    ours = grpo_loss(logps, adv, mask, old_per_token_logps=old, ref_per_token_logps=ref,
                     max_completion_length=MAX_LEN, **kw, **ours_kw)
    (our_grad,) = torch.autograd.grad(ours.loss, logps)
    torch.testing.assert_close(ours.loss, theirs)
    torch.testing.assert_close(our_grad, their_grad)
    expected.pop("entropy")
    assert set(ours.metrics) == set(expected)
    for name, value in expected.items():
        assert ours.metrics[name].item() == pytest.approx(value, rel=1e-6, abs=1e-7), name
    return expected


FAMILY = list(itertools.product(["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"],
                                ["token", "sequence"], [0.0, 0.04], [1, 2]))


@pytest.mark.parametrize("loss_type,level,beta,iterations", FAMILY)
def test_loss_family_and_sequence_level_ratios_equal_trl(loss_type, level, beta, iterations):
    """Every loss type at token and sequence level (GSPO), on-policy and on a reuse step, with and
    without the KL term; cispo with epsilon_high 1.3 so the weight cap is reached on reuse."""
    config = dict(loss_type=loss_type, importance_sampling_level=level, beta=beta)
    if loss_type == "cispo":
        config["epsilon_high"] = 1.3
    logged = _assert_equal_trl(config, iterations=iterations)
    if iterations > 1 and loss_type == "cispo" and level == "token":
        assert logged["cispo_clip_ratio"] > 0
    if iterations > 1 and loss_type not in ("cispo", "sapo", "vespo") and level == "token":
        assert logged["clip_ratio/region_mean"] > 0


@pytest.mark.parametrize("sapo", [(1.0, 1.05), (0.5, 2.0)])
def test_sapo_temperatures_equal_trl(sapo):
    _assert_equal_trl(dict(loss_type="sapo", sapo_temperature_pos=sapo[0], sapo_temperature_neg=sapo[1]),
                      iterations=2)


def test_vespo_parameters_equal_trl():
    _assert_equal_trl(dict(loss_type="vespo", vespo_k_pos=1.0, vespo_lambda_pos=0.5, vespo_k_neg=4.0,
                           vespo_lambda_neg=1.5), iterations=2)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo"])
@pytest.mark.parametrize("rho", [0.0, 0.2, 1.0])
@pytest.mark.parametrize("threshold", [None, 0.1])
def test_top_entropy_quantile_and_off_policy_mask_equal_trl(loss_type, rho, threshold):
    """The entropy mask (rho) and the off-policy sequence mask act on the policy term only (not the KL),
    on a reuse step where both drop something."""
    config = dict(loss_type=loss_type, top_entropy_quantile=rho, off_policy_mask_threshold=threshold, beta=0.04)
    if loss_type == "cispo":
        config["epsilon_high"] = 1.3
    _assert_equal_trl(config, iterations=2, entropies=True)


def test_masks_drop_what_they_say():
    """rho = 0.2 of 10 distinct entropies keeps the top 2 (the 0.8 quantile interpolates between the 8th
    and 9th); the off-policy mask drops only a negative-advantage sequence whose mean drift passes it."""
    ent = torch.arange(10, dtype=F64).reshape(2, 5)
    mask = torch.ones(2, 5)
    mask[1, 4] = 0  # 9 completion tokens: 0..8; 0.8 quantile = 6.4 -> 7, 8 kept
    kept = high_entropy_mask(ent, mask, 0.2)
    assert kept.nonzero().tolist() == [[1, 2], [1, 3]]
    assert high_entropy_mask(ent, mask, 1.0).sum() == 9 and high_entropy_mask(ent, mask, 0.0).sum() == 1
    logps = torch.zeros(3, 2, dtype=F64)
    sampling = torch.tensor([[0.3, 0.3], [0.3, 0.3], [0.05, 0.05]], dtype=F64)
    adv = torch.tensor([1.0, -1.0, -1.0], dtype=F64)
    keep = off_policy_mask(adv, logps, sampling, torch.ones(3, 2), 0.1)
    assert keep.squeeze(1).tolist() == [1.0, 0.0, 1.0]


def test_dapo_with_the_steps_token_total_equals_trl_accumulating():
    """Two micro-batches of one step, each given the step's token total, sum to TRL's accumulated loss
    (normaliser = num_items_in_batch * accumulation steps / steps_per_generation, lines 3168-3174)."""
    logps, old, _, adv, mask = _tensors(3, 2, 0.0)
    total = mask.sum()
    ours = sum(grpo_loss(logps[s], adv[s], mask[s], old_per_token_logps=old[s], num_tokens=total).loss
               for s in (slice(0, 3), slice(3, 6)))
    theirs = 0
    for s in (slice(0, 3), slice(3, 6)):
        trainer = trl_trainer(logps[s], steps_per_generation=2)
        trainer.current_gradient_accumulation_steps = 2
        inputs = {"prompt_ids": torch.zeros(3, 1, dtype=torch.long), "prompt_mask": torch.ones(3, 1, dtype=torch.long),
                  "completion_ids": torch.zeros(3, T, dtype=torch.long), "completion_mask": mask[s],
                  "advantages": adv[s], "old_per_token_logps": old[s], "num_items_in_batch": total}
        theirs = theirs + GRPOTrainer._compute_loss(trainer, None, inputs)
    torch.testing.assert_close(ours, theirs)


def trl_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str):
    """TRL 1.16.0 grpo_trainer.py 2757-2797 (sum_then_normalize), restated."""
    unscorable = torch.isnan(rewards)
    rewards = rewards.clone()
    rewards[unscorable] = torch.nan
    mean = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        if num_generations > 1:
            std = trl_nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
        else:
            std = torch.zeros_like(rewards)
    else:
        std = trl_nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    adv = rewards - mean
    if scale_rewards != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def trl_normalize_then_sum(per_reward: torch.Tensor, weights: torch.Tensor, num_generations: int):
    """TRL 1.16.0 grpo_trainer.py 2784-2796 (multi_objective_aggregation="normalize_then_sum"), restated."""
    k = per_reward.shape[1]
    unscorable = torch.isnan(per_reward).all(dim=1)
    grouped = per_reward.view(-1, num_generations, k)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = trl_nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, k)
    rewards = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    std = trl_nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    adv = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0), torch.isclose(std, torch.zeros_like(std))


@pytest.mark.parametrize("num_generations", [2, 4])
def test_normalize_then_sum_advantages_equal_trl(num_generations):
    """GDPO's aggregation: two rewards on different scales, one reward missing on some completions,
    one completion no reward scores, one group where a reward does not vary."""
    g = torch.Generator().manual_seed(num_generations)
    per = torch.stack([torch.rand(8, generator=g, dtype=F64), 10 * torch.rand(8, generator=g, dtype=F64)], dim=1)
    per[1, 1] = per[6, 0] = float("nan")
    per[5] = float("nan")
    per[:num_generations, 0] = 0.5
    weights = torch.tensor([1.0, 0.3], dtype=F64)
    adv, zero = trl_normalize_then_sum(per, weights, num_generations)
    ours = normalized_sum_advantages(per, weights, num_generations)
    torch.testing.assert_close(ours.advantages, adv)
    assert torch.equal(ours.is_std_zero, zero)
    assert ours.advantages[5] == 0 and torch.isfinite(ours.advantages).all()


@pytest.mark.parametrize("scale", ["group", "batch", "none", True, False])
@pytest.mark.parametrize("num_generations", [1, 2, 4])
def test_advantages_equal_trl(scale, num_generations):
    g = torch.Generator().manual_seed(num_generations)
    rewards = torch.rand(8, generator=g, dtype=torch.float64)
    rewards[:num_generations] = 0.5  # one group with no spread (frac_reward_zero_std)
    rewards[5] = float("nan")  # an unscorable completion
    name = {True: "group", False: "none"}.get(scale, scale)
    adv, zero = trl_advantages(rewards, num_generations, name)
    ours = group_advantages(rewards, num_generations, scale)
    torch.testing.assert_close(ours.advantages, adv)
    assert torch.equal(ours.is_std_zero, zero)
    assert ours.advantages[5] == 0
    assert torch.isfinite(ours.advantages).all()


def test_entropy_functions_by_hand():
    """The bonus term is the token mean over the kept tokens; adaptive control applies the coefficient
    only at or below the target (none before a first step) and moves it by delta within its bounds."""
    ent = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    term = entropy_term(ent, mask)
    assert term.mean.item() == pytest.approx(7 / 3) and term.total.item() == 7 and term.tokens.item() == 3
    keep = torch.tensor([[False, True, True], [True, False, False]])
    assert entropy_term(ent, mask, keep).mean.item() == pytest.approx(3.0)  # tokens 2 and 4
    assert entropy_term(ent, torch.zeros_like(mask)).mean.item() == 0
    assert applied_entropy_coef(0.1, float("inf"), adaptive=False, target=0.2) == 0.1
    assert applied_entropy_coef(0.1, float("inf"), adaptive=True, target=0.2) == 0.0
    assert applied_entropy_coef(0.1, 0.2, adaptive=True, target=0.2) == 0.1
    kw = dict(target=0.2, delta=0.05, coef_min=0.0, coef_max=0.12)
    assert adaptive_entropy_coef(0.1, 0.2, **kw) == pytest.approx(0.12)  # +0.05, capped at 0.12
    assert adaptive_entropy_coef(0.1, 0.3, **kw) == pytest.approx(0.05)
    assert adaptive_entropy_coef(0.01, 0.3, **kw) == 0.0  # floored at coef_min


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo", "luspo", "sapo", "cispo", "vespo"])
@pytest.mark.parametrize("rho", [1.0, 0.4])
def test_entropy_bonus_equals_trl(loss_type, rho):
    """``entropy_coef`` (static) and ``use_adaptive_entropy`` over three steps on the same trainer: TRL's
    loss and its gradient for the log-probs and the entropies, ``policy_loss`` and ``entropy_coef``, against
    grpo_loss minus the applied coefficient x :func:`entropy_term`, the coefficient moved by
    :func:`adaptive_entropy_coef` (the entropy mask ``rho < 1`` restricting the bonus's tokens, as TRL's)."""
    logps, old, ref, adv, mask = _tensors(5, 2, 0.04)
    g = torch.Generator().manual_seed(9)
    for adaptive in (False, True):
        config = dict(loss_type=loss_type, beta=0.04, entropy_coef=0.3, use_adaptive_entropy=adaptive,
                      entropy_target=1.4, entropy_coef_delta=0.1, entropy_coef_max=0.45, top_entropy_quantile=rho,
                      max_completion_length=MAX_LEN, epsilon_high=1.3 if loss_type == "cispo" else None)
        ent = (torch.rand(B, T, generator=g, dtype=F64) * 3).requires_grad_()
        trainer = trl_trainer(logps, ent, **config)
        coef, last = 0.3, float("inf")
        for step in range(3):
            ent = (torch.rand(B, T, generator=g, dtype=F64) * (3 - step)).requires_grad_()  # entropy falls
            trainer._get_per_token_logps_and_entropies = lambda *a, e=ent, **k: (logps, e, None)
            inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long),
                      "prompt_mask": torch.ones(B, 2, dtype=torch.long),
                      "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
                      "advantages": adv, "num_items_in_batch": mask.sum(), "old_per_token_logps": old,
                      "ref_per_token_logps": ref}
            trainer._metrics = {"train": defaultdict(list)}
            theirs = GRPOTrainer._compute_loss(trainer, None, inputs)
            keep = high_entropy_mask(ent.detach(), mask, rho) if rho < 1 else None
            out = grpo_loss(logps, adv, mask, old_per_token_logps=old, ref_per_token_logps=ref, beta=0.04,
                            loss_type=loss_type, max_completion_length=MAX_LEN, token_mask=keep,
                            epsilon_high=config["epsilon_high"])
            term = entropy_term(ent, mask, keep)
            applied = applied_entropy_coef(coef, last, adaptive=adaptive, target=1.4)
            ours = out.loss - applied * term.mean
            torch.testing.assert_close(ours, theirs)
            for a, b in zip(torch.autograd.grad(ours, [logps, ent]), torch.autograd.grad(theirs, [logps, ent])):
                torch.testing.assert_close(a, b)
            if adaptive:
                last = float(term.total / term.tokens)
                coef = adaptive_entropy_coef(coef, last, target=1.4, delta=0.1, coef_min=0.0, coef_max=0.45)
            logged = {k: v[0] for k, v in trainer._metrics["train"].items()}
            assert logged["entropy_coef"] == pytest.approx(coef)
            assert logged["policy_loss"] == pytest.approx(out.loss.item())  # one rank, no accumulation
        if adaptive:  # the gate opened and the coefficient moved
            assert trainer.entropy_coef != 0.3 and trainer._last_world_entropy <= 1.4


def trl_vllm_is_ratio(old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, mode: str,
                      clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """TRL 1.16.0 grpo_trainer.py 2660-2707 (vLLM importance sampling), restated."""
    import math

    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode in ["sequence_mask", "sequence_truncate"]:
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), value=0.0)


def _vllm_case(seed: int):
    logps, old, _, adv, mask = _tensors(seed, 2, 0.0)
    g = torch.Generator().manual_seed(seed + 3)
    sampling = old + 0.4 * torch.randn(B, T, generator=g, dtype=F64)
    sampling[1, 0] = float("nan")  # a token vLLM could not score: ratio 1 for it
    return logps, old, sampling, adv, mask


MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip", [(None, 3.0), (0.5, 1.5), (0.8, None)])
def test_vllm_importance_weights_equal_trl(mode, clip):
    """Every mode and bound against TRL's lines; the weights are exp(old - sampling) per token or per
    sequence, truncated or masked; what TRL logs of them (``sampling/*``) from the pooled sums."""
    _, old, sampling, _, mask = _vllm_case(13)
    want = trl_vllm_is_ratio(old, sampling, mask, mode, *clip)
    got = vllm_importance_weights(old, sampling, mask, mode=mode, clip_min=clip[0], clip_max=clip[1])
    torch.testing.assert_close(got, want)
    assert got.shape == ((B, 1) if mode.startswith("sequence") else (B, T))
    stats = vllm_sampling_stats(old, sampling, mask, got)
    keep = mask.bool()
    delta = torch.abs(old - sampling)[keep & ~torch.isnan(sampling)]  # TRL 2860-2895, restated
    flat = got.flatten() if mode.startswith("sequence") else got[keep]
    assert stats["delta_sum"] / stats["delta_count"] == pytest.approx(delta.mean().item())
    assert stats["delta_max"].item() == pytest.approx(delta.max().item())
    assert stats["ratio_sum"] / stats["ratio_count"] == pytest.approx(flat.mean().item())
    assert (stats["ratio_min"].item(), stats["ratio_max"].item()) == pytest.approx((flat.min().item(),
                                                                                     flat.max().item()))


def test_vllm_importance_weights_by_hand():
    old = torch.tensor([[0.0, -1.0], [-2.0, -1.0]], dtype=F64)
    sampling = torch.tensor([[-1.0, -1.0], [-1.0, float("nan")]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]])
    e = torch.e
    torch.testing.assert_close(vllm_importance_weights(old, sampling, mask, mode="token_truncate", clip_max=2.0),
                               torch.tensor([[2.0, 1.0], [1 / e, 1.0]], dtype=F64))  # e clipped to 2
    torch.testing.assert_close(vllm_importance_weights(old, sampling, mask, mode="token_mask", clip_max=2.0),
                               torch.tensor([[0.0, 1.0], [1 / e, 1.0]], dtype=F64))  # e dropped
    torch.testing.assert_close(vllm_importance_weights(old, sampling, mask, mode="sequence_mask", clip_max=3.0),
                               torch.tensor([[e], [1 / e]], dtype=F64))
    with pytest.raises(ValueError, match="needs clip_min or clip_max"):
        vllm_importance_weights(old, sampling, mask, mode="token_truncate", clip_max=None)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo", "sapo", "vespo"])
@pytest.mark.parametrize("mode", MODES)
def test_loss_with_the_vllm_correction_equals_trl(loss_type, mode):
    """grpo_loss with the weights (and vLLM's log-probs for the off-policy mask) against TRL's
    _compute_loss with ``use_vllm`` and the correction on: loss, gradient, metrics (vespo takes the
    token weights into its sequence weight, TRL refuses it with sequence modes)."""
    if loss_type == "vespo" and mode.startswith("sequence"):
        pytest.skip("TRL refuses vespo with sequence-level vLLM weights (objective=grpo too)")
    logps, old, sampling, adv, mask = _vllm_case(17)
    ratio = trl_vllm_is_ratio(old, sampling, mask, mode, None, 3.0)
    config = dict(loss_type=loss_type, use_vllm=True, vllm_importance_sampling_mode=mode,
                  off_policy_mask_threshold=0.1, max_completion_length=MAX_LEN,
                  epsilon_high=1.3 if loss_type == "cispo" else None)
    trainer = trl_trainer(logps, **config)
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask, "advantages": adv,
              "num_items_in_batch": mask.sum(), "old_per_token_logps": old, "importance_sampling_ratio": ratio,
              "sampling_per_token_logps": sampling}
    theirs = GRPOTrainer._compute_loss(trainer, None, inputs)
    expected = {k: v[0] for k, v in trainer._metrics["train"].items()}
    ours = grpo_loss(logps, adv, mask, old_per_token_logps=old, loss_type=loss_type, max_completion_length=MAX_LEN,
                     off_policy_mask_threshold=0.1, sampling_per_token_logps=sampling,
                     importance_sampling_ratio=vllm_importance_weights(old, sampling, mask, mode=mode),
                     epsilon_high=config["epsilon_high"])
    torch.testing.assert_close(ours.loss, theirs)
    torch.testing.assert_close(torch.autograd.grad(ours.loss, logps)[0], torch.autograd.grad(theirs, logps)[0])
    expected.pop("entropy")
    assert set(ours.metrics) == set(expected)
    for name, value in expected.items():
        assert ours.metrics[name].item() == pytest.approx(value, rel=1e-6, abs=1e-7), name
    plain = grpo_loss(logps, adv, mask, old_per_token_logps=old, loss_type=loss_type, max_completion_length=MAX_LEN,
                      off_policy_mask_threshold=0.1, sampling_per_token_logps=sampling,
                      epsilon_high=config["epsilon_high"])
    assert not torch.allclose(plain.loss, ours.loss)  # the weights change the loss: the test can fail
