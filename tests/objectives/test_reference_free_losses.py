"""SimPO and ORPO losses: values derived by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rolemrc.objectives.orpo import log1mexp, orpo_loss
from rolemrc.objectives.simpo import simpo_loss


def sp(x: float) -> float:
    return math.log1p(math.exp(x))


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_simpo_hand_values():
    # average log-probs: chosen [-4/2, -3/3] = [-2, -1]; rejected [-6/2, -3/1] = [-3, -3]
    # x = beta (a_w - a_l) - gamma with beta 2, gamma 1: [2 - 1, 4 - 1] = [1, 3]; loss sp(-x)
    out = simpo_loss(t(-4, -3), t(-6, -3), t(2, 3), t(2, 1), beta=2.0, gamma=1.0)
    torch.testing.assert_close(out.losses, t(sp(-1), sp(-3)))
    torch.testing.assert_close(out.chosen_rewards, t(-4, -2))  # beta x the average log-probs
    torch.testing.assert_close(out.rejected_rewards, t(-6, -6))
    torch.testing.assert_close(out.logits, t(0.5, 1.5))  # a_w - a_l - gamma / beta
    # label smoothing 0.1: 0.9 sp(-x) + 0.1 sp(x)
    smooth = simpo_loss(t(-4, -3), t(-6, -3), t(2, 3), t(2, 1), beta=2.0, gamma=1.0, label_smoothing=0.1)
    torch.testing.assert_close(smooth.losses, t(0.9 * sp(-1) + 0.1 * sp(1), 0.9 * sp(-3) + 0.1 * sp(3)))


def test_simpo_is_length_normalised():
    # the same per-token log-probs over twice the tokens: the same loss (DPO's would change)
    a = simpo_loss(t(-4.0), t(-6.0), t(2), t(2), beta=2.0, gamma=0.5).losses
    b = simpo_loss(t(-8.0), t(-12.0), t(4), t(4), beta=2.0, gamma=0.5).losses
    torch.testing.assert_close(a, b)


def test_orpo_hand_values():
    # chosen: average log-prob ln(1/2) (P = 1/2, odds 1, log odds 0); rejected: ln(1/4) (odds 1/3,
    # log odds -ln 3); log_odds = ln 3, log_odds_ratio = logsigmoid(ln 3) = ln(3/4)
    out = orpo_loss(t(2 * math.log(0.5)), t(3 * math.log(0.25)), t(2), t(3), beta=0.2)
    torch.testing.assert_close(out.log_odds_chosen, t(math.log(3)))
    torch.testing.assert_close(out.log_odds_ratio, t(math.log(0.75)))
    torch.testing.assert_close(out.losses, t(-0.2 * math.log(0.75)))
    torch.testing.assert_close(out.chosen_rewards, t(0.2 * math.log(0.5)))
    torch.testing.assert_close(out.rejected_rewards, t(0.2 * math.log(0.25)))


def test_log1mexp_both_branches_and_gradient_sign():
    x = t(-1e-8, -0.5, -0.7, -5.0, -50.0)
    torch.testing.assert_close(log1mexp(x), t(*(math.log(-math.expm1(v)) for v in x.tolist())))
    pi_c = t(-1.0).requires_grad_()
    orpo_loss(pi_c, t(-2.0), t(1), t(1), beta=1.0).losses.sum().backward()
    assert pi_c.grad < 0  # a likelier chosen response lowers the loss


def test_argument_checks():
    with pytest.raises(ValueError, match="beta"):
        simpo_loss(t(-1), t(-1), t(1), t(1), beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        simpo_loss(t(-1), t(-1), t(1), t(1), label_smoothing=0.5)
    with pytest.raises(ValueError, match="beta"):
        orpo_loss(t(-1), t(-1), t(1), t(1), beta=-1.0)
