"""GRPO loss and advantages: values derived by hand, gradients, argument checks."""

from __future__ import annotations

import math

import pytest
import torch

from rolemrc.objectives.grpo import group_advantages, grpo_loss, normalized_sum_advantages

F64 = torch.float64


def test_first_iteration_ratio_is_one_and_gradient_is_the_policy_gradient():
    """old=None: ratio exp(logp - logp.detach()) = 1, loss = -mean over sequences of A; d loss/d logp_t =
    -A_i / (len_i * B) for grpo, -A_i / total tokens for dapo."""
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.7, 0.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([2.0, -1.0], dtype=F64)
    out = grpo_loss(logps, adv, mask, loss_type="grpo")
    assert out.loss.item() == pytest.approx(-(2.0 - 1.0) / 2)
    out.loss.backward()
    expected = torch.tensor([[-2 / 6, -2 / 6, -2 / 6], [1 / 4, 1 / 4, 0.0]], dtype=F64)
    torch.testing.assert_close(logps.grad, expected)
    logps.grad = None
    out = grpo_loss(logps, adv, mask, loss_type="dapo")
    assert out.loss.item() == pytest.approx((-2.0 * 3 + 1.0 * 2) / 5)
    out.loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-0.4] * 3, [0.2, 0.2, 0.0]], dtype=F64))
    assert out.metrics["clip_ratio/region_mean"].item() == 0 and "kl" not in out.metrics


def test_clipping_by_sign_of_the_advantage():
    """ratio e^0.5 ~ 1.65 > 1 + 0.28: with A = +1 the clipped term (1.28) wins and carries no gradient;
    with A = -1 the unclipped -ratio*A is the larger loss and keeps its gradient. ratio e^-0.5 ~ 0.61 < 0.8:
    clipped for A = -1 (loss 0.8), not for A = +1."""
    logps = torch.tensor([[0.5], [0.5], [-0.5], [-0.5]], dtype=F64, requires_grad=True)
    old = torch.zeros(4, 1, dtype=F64)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=F64)
    mask = torch.ones(4, 1)
    out = grpo_loss(logps, adv, mask, old_per_token_logps=old, epsilon=0.2, epsilon_high=0.28, loss_type="bnpo")
    per_token = out.per_token_loss.detach().squeeze(1)
    torch.testing.assert_close(per_token, torch.tensor([-1.28, math.exp(0.5), 0.8, -math.exp(-0.5)], dtype=F64))
    out.loss.backward()
    grad = logps.grad.squeeze(1)
    assert grad[0] == 0 and grad[2] == 0
    assert grad[1].item() == pytest.approx(math.exp(0.5) / 4) and grad[3].item() == pytest.approx(-math.exp(-0.5) / 4)
    assert out.metrics["clip_ratio/high_mean"].item() == 0.25 and out.metrics["clip_ratio/low_mean"].item() == 0.25
    assert out.metrics["clip_ratio/region_mean"].item() == 0.5
    # delta caps the ratio where the min keeps the unclipped one (A < 0, ratio e^0.5)
    capped = grpo_loss(logps, adv, mask, old_per_token_logps=old, epsilon_high=0.28, loss_type="bnpo", delta=1.5)
    assert capped.per_token_loss[1].item() == pytest.approx(1.5)


def test_k3_kl_term_and_dr_grpo_normaliser():
    """ref - logp = ln 2 -> kl = 2 - ln2 - 1; ref = logp -> 0. dr_grpo divides the token sum by B x max length."""
    logps = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]], dtype=F64)
    ref = logps + torch.tensor([[math.log(2), 0.0], [0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.zeros(2, dtype=F64)
    out = grpo_loss(logps, adv, mask, ref_per_token_logps=ref, beta=0.5, loss_type="dr_grpo", max_completion_length=4)
    kl = 1 - math.log(2)
    assert out.metrics["kl"].item() == pytest.approx(kl / 3)
    assert out.loss.item() == pytest.approx(0.5 * kl / (2 * 4))


def test_kl_term_weighted_by_the_ratio():
    """ref - logp = d = ln 2, kl = e^d - d - 1 = 1 - ln 2. On-policy the ratio exp(logp - logp.detach()) is 1:
    the value is the plain kl, but d/dlogp [kl * ratio] = (1 - e^d) + kl = -ln 2 where the plain term's is
    1 - e^d = -1. On a reuse step (old = logp - ln 1.5) the ratio 1.5 scales the value (and the logged kl)."""
    logps = torch.tensor([[-1.0]], dtype=F64, requires_grad=True)
    ref = logps.detach() + math.log(2)
    one = torch.ones(1, 1)
    kl = 1 - math.log(2)
    for corrected, grad in ((True, -math.log(2)), (False, -1.0)):
        out = grpo_loss(logps, torch.zeros(1, dtype=F64), one, ref_per_token_logps=ref, beta=1.0,
                        use_bias_correction_kl=corrected)
        assert out.loss.item() == pytest.approx(kl) and out.metrics["kl"].item() == pytest.approx(kl)
        (g,) = torch.autograd.grad(out.loss, logps)
        assert g.item() == pytest.approx(grad)
    old = logps.detach() - math.log(1.5)
    out = grpo_loss(logps, torch.zeros(1, dtype=F64), one, old_per_token_logps=old, ref_per_token_logps=ref, beta=1.0)
    assert out.loss.item() == pytest.approx(1.5 * kl) and out.metrics["kl"].item() == pytest.approx(1.5 * kl)
    (g,) = torch.autograd.grad(out.loss, logps)
    assert g.item() == pytest.approx(1.5 * (1 - 2 + kl))


def test_global_totals_make_micro_batches_add_up():
    g = torch.Generator().manual_seed(0)
    logps, old = torch.randn(4, 5, generator=g, dtype=F64), torch.randn(4, 5, generator=g, dtype=F64)
    adv, mask = torch.randn(4, generator=g, dtype=F64), torch.ones(4, 5)
    mask[1, 3:] = 0
    for loss_type, totals in (("grpo", {"num_sequences": 4}), ("dr_grpo", {"num_sequences": 4}),
                              ("dapo", {"num_tokens": mask.sum()})):
        kw = dict(loss_type=loss_type, max_completion_length=5)
        whole = grpo_loss(logps, adv, mask, old_per_token_logps=old, **kw).loss
        parts = sum(grpo_loss(logps[s], adv[s], mask[s], old_per_token_logps=old[s], **kw, **totals).loss
                    for s in (slice(0, 1), slice(1, 4)))
        torch.testing.assert_close(parts, whole)


def test_group_advantages_by_hand():
    """Group (1, 0): mean 1/2, std sqrt(1/2) -> +-(1/2)/(sqrt(1/2) + 1e-4); group (1, 1): 0, zero std."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=F64)
    out = group_advantages(rewards, 2)
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    torch.testing.assert_close(out.advantages, torch.tensor([a, -a, 0.0, 0.0], dtype=F64))
    assert out.is_std_zero.tolist() == [False, False, True, True]
    torch.testing.assert_close(group_advantages(rewards, 2, "none").advantages,
                               torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=F64))
    batch_std = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=F64).std()
    torch.testing.assert_close(group_advantages(rewards, 2, "batch").advantages,
                               torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=F64) / (batch_std + 1e-4))


def test_unscorable_reward_is_left_out_not_zero():
    """A NaN reward is no 0: the group's baseline is the other completions' mean and its advantage is 0."""
    out = group_advantages(torch.tensor([1.0, float("nan"), 0.0, 0.5]), 4, "none")
    torch.testing.assert_close(out.advantages, torch.tensor([0.5, 0.0, -0.5, 0.0]))


@pytest.mark.parametrize("kwargs,match", [
    ({"loss_type": "ppo"}, "unknown loss_type"),
    ({"beta": 0.1}, "needs ref_per_token_logps"),
    ({"loss_type": "dr_grpo"}, "max_completion_length"),
    ({"old_per_token_logps": torch.zeros(2, 2)}, "old_per_token_logps has shape"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        grpo_loss(torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3), **kwargs)


def test_bad_groups_and_scale():
    with pytest.raises(ValueError, match="groups of num_generations=4"):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="scale_rewards must be one of"):
        group_advantages(torch.zeros(4), 2, "std")


def test_sequence_level_ratio_is_the_exp_of_the_mean_log_ratio():
    """GSPO: log-ratios (0.2, 0.4) and 0.6 (one token, one masked) -> sequence ratios e^0.3, e^0.6; with
    epsilon 0.4 and A = +1 the first is inside (loss -e^0.3 on each token), the second clipped (-1.4)."""
    logps = torch.tensor([[0.2, 0.4], [0.6, 5.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    out = grpo_loss(logps, torch.ones(2, dtype=F64), mask, old_per_token_logps=torch.zeros(2, 2, dtype=F64),
                    loss_type="grpo", importance_sampling_level="sequence", epsilon=0.4)
    assert out.loss.item() == pytest.approx((-math.exp(0.3) - 1.4) / 2)
    (g,) = torch.autograd.grad(out.loss, logps)  # d/dlogp_t of -e^mean / 2 = -e^0.3 / 2 / 2 per token
    torch.testing.assert_close(g, torch.tensor([[-math.exp(0.3) / 4] * 2, [0.0, 0.0]], dtype=F64))
    assert out.metrics["clip_ratio/high_mean"].item() == 0.5  # one of two sequences (not tokens)
    assert out.weights["clip_ratio/high_mean"].item() == 2


def test_cispo_sapo_luspo_by_hand():
    """cispo: -min(r, eps_high).detach() * A * logp, dapo's normaliser; sapo: -(4/tau) sigmoid(tau (r - 1)) A,
    tau by the sign of A; luspo: the clipped surrogate summed per sequence, then the mean over sequences."""
    logps = torch.tensor([[math.log(2.0), 0.0]], dtype=F64, requires_grad=True)  # ratios 2 and 1 (old = 0)
    old, mask, adv = torch.zeros(1, 2, dtype=F64), torch.ones(1, 2), torch.ones(1, dtype=F64)
    out = grpo_loss(logps, adv, mask, old_per_token_logps=old, loss_type="cispo", epsilon_high=1.5)
    assert out.loss.item() == pytest.approx(-(1.5 * math.log(2.0) + 0.0) / 2)
    (g,) = torch.autograd.grad(out.loss, logps)
    torch.testing.assert_close(g, torch.tensor([[-1.5 / 2, -1.0 / 2]], dtype=F64))  # no gradient through the weight
    assert out.metrics["cispo_clip_ratio"].item() == 0.5
    sapo = grpo_loss(logps, -adv, mask, old_per_token_logps=old, loss_type="sapo", sapo_temperature_neg=2.0)
    sig = 1 / (1 + math.exp(-2.0))
    assert sapo.loss.item() == pytest.approx((4 / 2.0 * sig + 4 / 2.0 * 0.5) / 2)
    luspo = grpo_loss(logps, adv, mask, old_per_token_logps=old, loss_type="luspo", epsilon=0.2)
    assert luspo.loss.item() == pytest.approx(-(1.2 + 1.0))  # one sequence: its token sum


def test_normalize_then_sum_by_hand():
    """Two groups of two, rewards a = (1, 0 | 1, 1) and b = (0, 10 | 0, 20): normalised in their groups
    a -> (+c, -c | 0, 0), b -> (-c, +c | -c, +c) with c = (1/2)/(sqrt(1/2) + 1e-4) and (5 or 10)/(std + 1e-4),
    each ~0.707... per unit: the sums (0, 0 | -c', +c') then divided by their batch std."""
    per = torch.tensor([[1.0, 0.0], [0.0, 10.0], [1.0, 0.0], [1.0, 20.0]], dtype=F64)
    c_a = 0.5 / (math.sqrt(0.5) + 1e-4)
    c_b1 = 5.0 / (5.0 * math.sqrt(2) + 1e-4)
    c_b2 = 10.0 / (10.0 * math.sqrt(2) + 1e-4)
    sums = torch.tensor([c_a - c_b1, -c_a + c_b1, -c_b2, c_b2], dtype=F64)
    expected = (sums - sums.mean()) / (sums.std() + 1e-4)
    out = normalized_sum_advantages(per, torch.ones(2, dtype=F64), 2)
    torch.testing.assert_close(out.advantages, expected)
    # a reward's scale no longer matters (up to the 1e-4 in the denominators): b x 100, nearly the same
    torch.testing.assert_close(normalized_sum_advantages(per * torch.tensor([1.0, 100.0], dtype=F64),
                                                         torch.ones(2, dtype=F64), 2).advantages, expected,
                               atol=1e-4, rtol=1e-3)
