"""DPO loss family: values derived by hand, gradient signs, metric names, argument checks."""

from __future__ import annotations

import math

import pytest
import torch

from rolemrc.objectives import DPOOutput, average_logps, dpo_loss
from rolemrc.objectives.dpo import loss_terms, split_sft

LOG2 = math.log(2.0)


def pairs():
    """Two preference pairs with hand-picked margins h = (pi_c - pi_r) - (ref_c - ref_r).

    Pair 0: pi_c = -5, pi_r = -7          -> policy log-ratio 2
            ref_c = -6, ref_r = -8 + 2 ln2 -> reference log-ratio 2 - 2 ln2
            h = 2 - (2 - 2 ln2) = 2 ln2, so with beta = 1/2: beta * h = ln 2.
    Pair 1: policy and reference agree (ratio 1 each), h = 0.
    """
    pi_c = torch.tensor([-5.0, -3.0], dtype=torch.float64, requires_grad=True)
    pi_r = torch.tensor([-7.0, -4.0], dtype=torch.float64, requires_grad=True)
    ref_c = torch.tensor([-6.0, -2.0], dtype=torch.float64)
    ref_r = torch.tensor([-8.0 + 2 * LOG2, -3.0], dtype=torch.float64)
    return pi_c, pi_r, ref_c, ref_r


def test_sigmoid_hand_values_and_rewards():
    pi_c, pi_r, ref_c, ref_r = pairs()
    out = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=0.5)
    assert isinstance(out, DPOOutput)
    torch.testing.assert_close(out.logits, torch.tensor([2 * LOG2, 0.0], dtype=torch.float64))
    # Pair 0: sigmoid(ln 2) = 2 / (1 + 2) = 2/3, loss = -ln(2/3) = ln(3/2).
    # Pair 1: sigmoid(0) = 1/2, loss = ln 2.
    torch.testing.assert_close(
        out.losses, torch.tensor([math.log(1.5), LOG2], dtype=torch.float64)
    )
    # rewards = beta * (pi - ref): chosen 0.5 * (-5 + 6) = 0.5 and 0.5 * (-3 + 2) = -0.5;
    # rejected 0.5 * (-7 + 8 - 2 ln2) = 0.5 - ln2 and 0.5 * (-4 + 3) = -0.5.
    torch.testing.assert_close(out.chosen_rewards, torch.tensor([0.5, -0.5], dtype=torch.float64))
    torch.testing.assert_close(
        out.rejected_rewards, torch.tensor([0.5 - LOG2, -0.5], dtype=torch.float64)
    )
    assert not out.chosen_rewards.requires_grad and not out.rejected_rewards.requires_grad
    assert out.losses.requires_grad


def test_sigmoid_label_smoothing_hand_values():
    pi_c, pi_r, ref_c, ref_r = pairs()
    out = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=0.5, label_smoothing=0.1)
    # Pair 0: -(0.9) ln sigmoid(ln2) - 0.1 ln sigmoid(-ln2) = 0.9 ln(3/2) + 0.1 ln 3,
    #   since sigmoid(-ln 2) = 1 / (1 + 2) = 1/3.
    # Pair 1: h = 0, both terms are ln 2 and the weights sum to one: ln 2.
    want = torch.tensor([0.9 * math.log(1.5) + 0.1 * math.log(3.0), LOG2], dtype=torch.float64)
    torch.testing.assert_close(out.losses, want)


def test_ipo_hand_values():
    pi_c, pi_r, ref_c, ref_r = pairs()
    # beta = 1/4 -> target margin 1 / (2 beta) = 2.
    out = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=0.25, loss_type="ipo")
    # Pair 0: (2 ln2 - 2)^2; pair 1: (0 - 2)^2 = 4.
    want = torch.tensor([(2 * LOG2 - 2) ** 2, 4.0], dtype=torch.float64)
    torch.testing.assert_close(out.losses, want)


def test_hinge_hand_values():
    pi_c, pi_r, ref_c, ref_r = pairs()
    out = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=0.5, loss_type="hinge")
    # Pair 0: relu(1 - ln 2) = 1 - ln 2; pair 1: relu(1 - 0) = 1.
    torch.testing.assert_close(out.losses, torch.tensor([1 - LOG2, 1.0], dtype=torch.float64))
    # A margin of 4 with beta = 1/2 is past the hinge: relu(1 - 2) = 0.
    far = dpo_loss(
        torch.tensor([0.0]), torch.tensor([-4.0]), torch.tensor([0.0]), torch.tensor([0.0]),
        beta=0.5, loss_type="hinge",
    )
    assert far.losses.item() == 0.0


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_raising_chosen_logp_lowers_loss(loss_type):
    pi_c, pi_r, ref_c, ref_r = pairs()
    beta = 0.25 if loss_type == "ipo" else 0.5
    out = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=beta, loss_type=loss_type)
    out.losses.sum().backward()
    # Both pairs (h = 2 ln2 ~ 1.39 and 0) sit below each loss's optimum (IPO target 1/(2 beta) = 2;
    # hinge active while beta h < 1), so more chosen likelihood helps, more rejected hurts.
    assert (pi_c.grad < 0).all() and (pi_r.grad > 0).all()
    # d/d pi_c by hand: sigmoid -beta * sigmoid(-beta h) = -1/2 * 1/3 and -1/2 * 1/2;
    # ipo 2 (h - 2); hinge -beta while active.
    want = {
        "sigmoid": [-1 / 6, -1 / 4],
        "ipo": [2 * (2 * LOG2 - 2), -4.0],
        "hinge": [-0.5, -0.5],
    }[loss_type]
    torch.testing.assert_close(pi_c.grad, torch.tensor(want, dtype=torch.float64))
    torch.testing.assert_close(pi_r.grad, -pi_c.grad)


def test_ipo_pushes_back_past_its_target_margin():
    # h = 3 > 1 / (2 * 0.5) = 1: IPO regularises towards the target, so the chosen grad is positive.
    pi_c = torch.tensor([0.0], requires_grad=True)
    out = dpo_loss(
        pi_c, torch.tensor([-3.0]), torch.tensor([0.0]), torch.tensor([0.0]),
        beta=0.5, loss_type="ipo",
    )
    out.losses.sum().backward()
    assert pi_c.grad.item() == pytest.approx(2 * (3 - 1))


def test_reference_logps_get_no_gradient():
    pi_c, pi_r, ref_c, ref_r = pairs()
    ref_c.requires_grad_(True)
    dpo_loss(pi_c, pi_r, ref_c, ref_r).losses.sum().backward()
    assert ref_c.grad is None


def test_average_logps_for_ipo():
    sums = torch.tensor([-6.0, -3.0, 0.0])
    counts = torch.tensor([3, 1, 0])
    assert average_logps(sums, counts).tolist() == [-2.0, -3.0, 0.0]


def test_argument_validation():
    pi_c, pi_r, ref_c, ref_r = pairs()
    with pytest.raises(ValueError, match="sigmoid, ipo, hinge, exo_pair"):
        dpo_loss(pi_c, pi_r, ref_c, ref_r, loss_type="kto")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="only applies"):
        dpo_loss(pi_c, pi_r, ref_c, ref_r, loss_type="ipo", label_smoothing=0.1)
    for eps in (-0.1, 0.5, 0.7):
        with pytest.raises(ValueError, match=r"\[0, 0.5\)"):
            dpo_loss(pi_c, pi_r, ref_c, ref_r, label_smoothing=eps)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=0.0)
    with pytest.raises(ValueError, match="shape"):
        dpo_loss(pi_c, pi_r, ref_c, ref_r[:1])


# ---------------------------------------------------------------- TRL 1.16's other loss types, by hand
# With pairs() and beta = 1/2: log-ratios c = pi_c - ref_c = [1, -1], r = pi_r - ref_r = [1 - 2 ln2, -1],
# margins h = c - r = [2 ln2, 0]; sigma(ln 2) = 2/3, -logsigmoid(x) = softplus(-x).


def sp(x: float) -> float:
    """softplus(x) = log(1 + e^x) = -logsigmoid(-x)."""
    return math.log1p(math.exp(x))


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def losses_of(loss_type, **kw):
    pi_c, pi_r, ref_c, ref_r = pairs()
    return dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=kw.pop("beta", 0.5), loss_type=loss_type, **kw).losses


HAND = {
    # -logsig(beta c) - logsig(-beta r): pair 0 sp(-1/2) + sp(1/2 - ln2); pair 1 sp(1/2) + sp(-1/2)
    "bco_pair": ({}, [sp(-0.5) + sp(0.5 - LOG2), sp(0.5) + sp(-0.5)]),
    # -logsig(beta c) - 1/2 logsig(-beta c) - 1/2 logsig(-beta r)
    "nca_pair": ({}, [sp(-0.5) + 0.5 * sp(0.5) + 0.5 * sp(0.5 - LOG2), sp(0.5) + 0.5 * sp(-0.5) + 0.5 * sp(-0.5)]),
    # (c - 1/(2 beta))^2 + (r + 1/(2 beta))^2 with 1/(2 beta) = 1: pair 0 0 + (2 - 2 ln2)^2; pair 1 4 + 0
    "sppo_hard": ({}, [(2 - 2 * LOG2) ** 2, 4.0]),
    # 1 - sig(beta c) + sig(beta r)
    "apo_zero": ({}, [1 - sig(0.5) + sig(0.5 - LOG2), 1.0]),
    # sig(beta c) + 1 - sig(beta h): pair 0 sig(1/2) + 1 - 2/3; pair 1 sig(-1/2) + 1/2
    "apo_down": ({}, [sig(0.5) + 1 / 3, sig(-0.5) + 0.5]),
    # ((1 - eps) sp(-x) - eps sp(x)) / (1 - 2 eps), eps = 0.1, x = beta h: pair 0 (0.9 ln(3/2) - 0.1 ln 3) / 0.8;
    # pair 1 (0.9 - 0.1) ln2 / 0.8 = ln 2
    "robust": ({"label_smoothing": 0.1}, [(0.9 * math.log(1.5) - 0.1 * math.log(3.0)) / 0.8, LOG2]),
    # sum over {w, l} of q log(q / p), q = (sig(x), sig(-x)), p = (1 - eps, eps), eps = 0.01
    "exo_pair": ({"label_smoothing": 0.01}, [
        2 / 3 * (math.log(2 / 3) - math.log(0.99)) + 1 / 3 * (math.log(1 / 3) - math.log(0.01)),
        -LOG2 - 0.5 * math.log(0.99 * 0.01)]),
    # sp(-x) (1 - m) + e^-x m, m = sig(x / tau), tau = 0.5: pair 0 ln(3/2)(1 - sig(2 ln2)) + 1/2 sig(2 ln2)
    # with sig(2 ln2) = 4/5; pair 1 m = 1/2: (ln2 + 1) / 2
    "discopop": ({"discopop_tau": 0.5}, [math.log(1.5) / 5 + 0.5 * 0.8, (LOG2 + 1) / 2]),
    # policy log-ratios [2, 1] and reference ones [2 - 2 ln2, 1], each sorted:
    # [1, 2] - [2 - 2 ln2, 1] = [2 ln2 - 1, 1]
    "aot": ({}, [sp(0.5 - LOG2), sp(-0.5)]),
    # c sorted [-1, 1], r sorted [-1, 1 - 2 ln2]: deltas [0, 2 ln2]
    "aot_unpaired": ({}, [LOG2, math.log(1.5)]),
}


@pytest.mark.parametrize("loss_type", list(HAND))
def test_trl_loss_types_hand_values(loss_type):
    kw, want = HAND[loss_type]
    torch.testing.assert_close(losses_of(loss_type, **kw), torch.tensor(want, dtype=torch.float64))


def test_length_normalised_losses_average_each_log_ratio_by_its_tokens():
    # chosen tokens [2, 1], rejected [1, 1]: per-token c = [1/2, -1], r = [1 - 2 ln2, -1], differences
    # [2 ln2 - 1/2, 0]
    tokens = {"chosen_tokens": torch.tensor([2, 1]), "rejected_tokens": torch.tensor([1, 1])}
    d0 = 2 * LOG2 - 0.5
    torch.testing.assert_close(losses_of("sigmoid_norm", **tokens), torch.tensor([sp(-0.5 * d0), LOG2], dtype=torch.float64))
    # IPO, beta = 1/4: target 2
    torch.testing.assert_close(losses_of("ipo", beta=0.25, **tokens), torch.tensor([(d0 - 2) ** 2, 4.0], dtype=torch.float64))


def test_a_weighted_combination_is_the_weighted_sum():
    both = losses_of(["sigmoid", "hinge"], loss_weights=[0.8, 0.2])
    torch.testing.assert_close(both, 0.8 * losses_of("sigmoid") + 0.2 * losses_of("hinge"))
    # weights default to one each; TRL < 1.0's name aot_pair is aot_unpaired
    torch.testing.assert_close(losses_of(["sigmoid", "aot_pair"]), losses_of("sigmoid") + losses_of("aot_unpaired"))


def test_loss_terms_and_the_sft_term():
    assert loss_terms("sigmoid") == [("sigmoid", 1.0)]
    assert split_sft(loss_terms(["sigmoid", "sft"], [1.0, 0.5]), sft_weight=0.25) == ([("sigmoid", 1.0)], 0.75)
    pi_c, pi_r, ref_c, ref_r = pairs()
    for bad, match in [(dict(loss_type=["sigmoid", "sigmoid"]), "twice"),
                       (dict(loss_type=["sigmoid", "hinge"], loss_weights=[1.0]), "1 weights for 2"),
                       (dict(loss_type="sft"), "not a per-pair loss"),
                       (dict(loss_type="exo_pair"), "label_smoothing > 0"),
                       (dict(loss_type="discopop", discopop_tau=0.0), "discopop_tau")]:
        with pytest.raises(ValueError, match=match):
            dpo_loss(pi_c, pi_r, ref_c, ref_r, **bad)
