"""GRPO loss and advantages against TRL 1.16 on the same tensors, for every option.

The loss: TRL's own ``GRPOTrainer._compute_loss`` is called, unbound, on a stand-in trainer whose
forward returns the test's per-token log-probs (one process, no accumulation, no vLLM, no entropy
mask), and its loss, gradient and logged metrics are compared with :func:`grpo_loss`.
The advantages are computed inline in TRL's ``_generate_and_score_completions``, not a callable:
:func:`trl_advantages` restates those lines (trl/trainer/grpo_trainer.py 2757-2797 in TRL 1.16.0,
``multi_objective_aggregation="sum_then_normalize"``), using TRL's ``nanstd``.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import nanstd as trl_nanstd  # noqa: E402

from rolemrc.objectives.grpo import group_advantages, grpo_loss  # noqa: E402

assert trl.__version__ == "1.16.0", "these tests restate TRL 1.16.0's lines; re-read them for another version"

B, T, MAX_LEN = 6, 7, 9


class _Accelerator:
    num_processes = 1

    def reduce(self, x, reduction="sum"):
        return x

    def gather(self, x):
        return x

    gather_for_metrics = gather


def _trainer(logps: torch.Tensor, *, loss_type: str, beta: float, epsilon: float, epsilon_high: float | None,
             delta: float | None) -> SimpleNamespace:
    """The attributes ``_compute_loss`` reads, as GRPOTrainer.__init__ sets them (lines 819-946)."""
    return SimpleNamespace(
        loss_type=loss_type, beta=beta, epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        importance_sampling_level="token", top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        use_vllm=False, vllm_importance_sampling_correction=False, _entropy_bonus_enabled=False,
        aux_loss_enabled=False, max_completion_length=MAX_LEN, current_gradient_accumulation_steps=1,
        model=SimpleNamespace(training=True), accelerator=_Accelerator(),
        args=SimpleNamespace(use_bias_correction_kl=False, delta=delta, steps_per_generation=1),
        _metrics={"train": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
    )


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
    logps, old, ref, adv, mask = _tensors(7, iterations, beta)
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask, "advantages": adv,
              "num_items_in_batch": mask.sum()}
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    trainer = _trainer(logps, loss_type=loss_type, beta=beta, epsilon=eps[0], epsilon_high=eps[1], delta=delta)
    theirs = GRPOTrainer._compute_loss(trainer, None, inputs)
    (their_grad,) = torch.autograd.grad(theirs, logps)

    ours = grpo_loss(logps, adv, mask, old_per_token_logps=old, ref_per_token_logps=ref, beta=beta,
                     epsilon=eps[0], epsilon_high=eps[1], loss_type=loss_type, max_completion_length=MAX_LEN,
                     delta=delta)
    (our_grad,) = torch.autograd.grad(ours.loss, logps)
    torch.testing.assert_close(ours.loss, theirs)
    torch.testing.assert_close(our_grad, their_grad)
    logged = trainer._metrics["train"]
    expected = {k: v[0] for k, v in logged.items() if k != "entropy"}
    assert set(ours.metrics) == set(expected)
    for name, value in expected.items():
        assert ours.metrics[name].item() == pytest.approx(value, rel=1e-6, abs=1e-7), name  # TRL counts in float32
    if iterations > 1:  # the ratios really leave the clip range: the comparison covers the clipped branches
        assert expected["clip_ratio/region_mean"] > 0


def test_dapo_with_the_steps_token_total_equals_trl_accumulating():
    """Two micro-batches of one step, each given the step's token total, sum to TRL's accumulated loss
    (normaliser = num_items_in_batch * accumulation steps / steps_per_generation, lines 3168-3174)."""
    logps, old, _, adv, mask = _tensors(3, 2, 0.0)
    total = mask.sum()
    ours = sum(grpo_loss(logps[s], adv[s], mask[s], old_per_token_logps=old[s], num_tokens=total).loss
               for s in (slice(0, 3), slice(3, 6)))
    theirs = 0
    for s in (slice(0, 3), slice(3, 6)):
        trainer = _trainer(logps[s], loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=None, delta=None)
        trainer.current_gradient_accumulation_steps = 2
        trainer.args.steps_per_generation = 2
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
