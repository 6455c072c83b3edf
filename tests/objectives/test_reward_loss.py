"""Reward-model (Bradley-Terry) loss: values derived by hand (TRL 1.16's RewardTrainer definitions)."""

from __future__ import annotations

import math

import pytest
import torch

from rolemrc.objectives.reward import bradley_terry_loss, reward_step_loss


def softplus(x: float) -> float:  # -log sigmoid(-x)
    return math.log1p(math.exp(x))


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_pair_losses_margins_and_accuracies_by_hand():
    chosen, rejected = t(1.0, -0.5, 2.0), t(0.0, 0.5, 2.0)
    out = bradley_terry_loss(chosen, rejected)
    # -log sigmoid(d) = log(1 + exp(-d)), d = 1, -1, 0
    assert out.losses.tolist() == pytest.approx([softplus(-1.0), softplus(1.0), math.log(2.0)])
    assert out.margins.tolist() == [1.0, -1.0, 0.0]
    assert out.accuracies.tolist() == [1.0, 0.0, 0.0]  # a tie is not a win (TRL: chosen > rejected)
    assert out.centering.tolist() == [1.0, 0.0, 16.0]  # (r_c + r_r)^2


def test_a_margin_is_subtracted_from_the_difference():
    out = bradley_terry_loss(t(1.0, 1.0), t(0.0, 0.0), margin=t(0.0, 3.0))
    assert out.losses.tolist() == pytest.approx([softplus(-1.0), softplus(2.0)])  # d - m = 1, -2
    assert out.margins.tolist() == [1.0, 1.0]  # the logged margin is r_c - r_r, without the target


def test_step_loss_adds_the_centring_term_and_is_a_share_of_the_steps_pairs():
    chosen, rejected = t(1.0, -0.5), t(0.0, 0.5)
    out = bradley_terry_loss(chosen, rejected)
    mean = (softplus(-1.0) + softplus(1.0)) / 2
    assert float(reward_step_loss(out)) == pytest.approx(mean)
    assert float(reward_step_loss(out, None)) == float(reward_step_loss(out, 0.0))  # TRL's default: none
    # c x mean((r_c + r_r)^2) = 0.01 x (1 + 0) / 2
    assert float(reward_step_loss(out, 0.01)) == pytest.approx(mean + 0.01 * 0.5)
    # two of a step's four pairs: this micro-batch's share is its sums over 4
    assert float(reward_step_loss(out, 0.01, num_pairs=torch.tensor(4))) == pytest.approx((mean + 0.005) / 2)


def test_the_gradient_pushes_chosen_up_and_rejected_down():
    chosen, rejected = t(0.3).requires_grad_(), t(0.1).requires_grad_()
    reward_step_loss(bradley_terry_loss(chosen, rejected), 0.1).backward()
    s = 1.0 / (1.0 + math.exp(0.2))  # sigmoid(-(0.3 - 0.1))
    # d/dr_c = -sigmoid(-d) + 2c(r_c + r_r); d/dr_r = sigmoid(-d) + 2c(r_c + r_r)
    assert float(chosen.grad) == pytest.approx(-s + 0.2 * 0.4)
    assert float(rejected.grad) == pytest.approx(s + 0.2 * 0.4)


def test_shapes_must_match():
    with pytest.raises(ValueError, match="differ in shape"):
        bradley_terry_loss(t(1.0, 2.0), t(1.0))
