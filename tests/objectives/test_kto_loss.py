"""KTO loss: values derived by hand (TRL 1.16's KTOTrainer definitions)."""

from __future__ import annotations

import math

import pytest
import torch

from rolemrc.objectives.kto import kto_kl, kto_loss, weight_advice


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_kl_is_the_clamped_mean_of_the_mismatched_log_ratios():
    # policy - reference on mismatched pairs: [0.5, 0.1] -> 0.3; [-0.2, -0.4] -> -0.3, clamped to 0
    assert float(kto_kl(t(-5.0, -6.0), t(-5.5, -6.1))) == pytest.approx(0.3)
    assert float(kto_kl(t(-5.2, -6.4), t(-5.0, -6.0))) == 0.0
    # over ranks (TRL averages the ranks' estimates, then clamps): this rank's 0.3 and another's -0.5
    assert float(kto_kl(t(-5.0, -6.0), t(-5.5, -6.1), rank_mean=lambda kl: (kl - 0.5) / 2)) == 0.0
    assert float(kto_kl(t(-5.0, -6.0), t(-5.5, -6.1), rank_mean=lambda kl: (kl + 0.1) / 2)) == pytest.approx(0.2)
    x = t(-1.0, -2.0).requires_grad_()
    assert not kto_kl(x, t(-2.0, -2.0)).requires_grad  # a constant of the loss, as in TRL


def test_kto_hand_values():
    # log ratios r = [1, -1]; z = 0.4; beta 0.5
    # desirable:   1.5 * (1 - sig(0.5 * (1 - 0.4)))  = 1.5 * (1 - sig(0.3))
    # undesirable: 0.5 * (1 - sig(0.5 * (0.4 + 1)))  = 0.5 * (1 - sig(0.7))
    out = kto_loss(t(-1, -3), t(-2, -2), torch.tensor([True, False]), 0.4, beta=0.5, desirable_weight=1.5,
                   undesirable_weight=0.5)
    torch.testing.assert_close(out.losses, t(1.5 * (1 - sig(0.3)), 0.5 * (1 - sig(0.7))))
    torch.testing.assert_close(out.rewards, t(0.5, -0.5))
    # the label, not the position, picks the branch
    flipped = kto_loss(t(-1, -3), t(-2, -2), torch.tensor([False, True]), 0.4, beta=0.5)
    torch.testing.assert_close(flipped.losses, t(1 - sig(0.5 * (0.4 - 1)), 1 - sig(0.5 * (-1 - 0.4))))


def test_apo_zero_unpaired_ignores_the_kl():
    # r = [1, -1], beta 0.5: desirable 1 - sig(0.5); undesirable sig(-0.5)
    out = kto_loss(t(-1, -3), t(-2, -2), torch.tensor([True, False]), 7.0, beta=0.5, loss_type="apo_zero_unpaired")
    torch.testing.assert_close(out.losses, t(1 - sig(0.5), sig(-0.5)))


def test_gradient_flows_to_the_policy_only_through_the_ratio():
    policy = t(-1.0, -3.0).requires_grad_()
    out = kto_loss(policy, t(-2, -2), torch.tensor([True, False]), 0.0, beta=1.0)
    out.losses.sum().backward()
    # d/dr (1 - sig(r)) = -sig(r)(1 - sig(r)); d/dr (1 - sig(-r)) = sig(-r)(1 - sig(-r))
    torch.testing.assert_close(policy.grad, t(-sig(1) * (1 - sig(1)), sig(1) * (1 - sig(1))))


@pytest.mark.parametrize(("kwargs", "match"), [({"beta": 0.0}, "beta"), ({"loss_type": "sigmoid"}, "loss_type")])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kto_loss(t(-1), t(-1), torch.tensor([True]), **kwargs)


def test_weight_advice_follows_the_papers_range() -> None:
    """TRL's check of eqn 8: desirable_weight * n_D : undesirable_weight * n_U in [1, 4/3]."""
    assert weight_advice(100, 100, 1.0, 1.0) is None  # balanced
    msg = weight_advice(10, 80, 1.0, 1.0)  # 10 desirable: weigh them 8 to 10.64 times
    assert msg is not None and "desirable_weight in [8.0, 10.64]" in msg and "undesirable_weight in [0.09, 0.12]" in msg
    assert weight_advice(10, 80, 9.0, 1.0) is None and weight_advice(10, 80, 1.0, 0.1) is None
    assert weight_advice(80, 10, 1.0, 1.0) is not None and weight_advice(75, 100, 1.33, 1.0) is None
    # one label only: no weight balances a missing label; said, with what to do (not a range of weights)
    for d, u, lacks in ((27, 0, '"label": false'), (0, 5, '"label": true')):
        for weights in ((1.0, 1.0), (0.045, 1.0), (1.0, 0.0)):
            msg = weight_advice(d, u, *weights)
            assert msg is not None and "no objective.desirable_weight / undesirable_weight can balance" in msg
            assert f"{d} desirable and {u} undesirable" in msg and lacks in msg and "EITHER" not in msg
    assert "objective=sft" in weight_advice(27, 0, 1.0, 1.0) and weight_advice(0, 0, 1.0, 1.0) is None
