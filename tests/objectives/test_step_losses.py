"""The loss reductions the training modules use (hand-derived numbers): the SFT token-mean NLL
and the DPO objective (pair mean + sft_weight x chosen NLL), over the batch's own counts or over
a step's totals (a micro-batch's share of the step's mean)."""

from __future__ import annotations

import pytest
import torch

from rolemrc.objectives import pair_mean, preference_loss, sequence_logprobs, token_logprobs, token_nll


def test_token_nll_divides_minus_the_sum_by_the_total() -> None:
    logps = torch.tensor([-1.0, -2.0, -3.0])  # e.g. three sequences' summed log-probs
    assert token_nll(logps, 4).item() == pytest.approx(1.5)
    assert token_nll(logps, torch.tensor(12)).item() == pytest.approx(0.5)  # a step's 12 tokens
    assert token_nll(torch.tensor(-6.0, dtype=torch.float64), torch.tensor(3.0, dtype=torch.float64)).item() == 2.0


def test_token_nll_without_tokens_is_zero_and_attached() -> None:
    logps = torch.zeros(0, requires_grad=True)
    loss = token_nll(logps, torch.tensor(0))
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()


def test_micro_batch_shares_add_up_to_the_step_mean() -> None:
    a, b = torch.tensor([-1.0, -5.0]), torch.tensor([-4.0])
    step_tokens = torch.tensor(10)  # tokens of all three sequences
    assert (token_nll(a, step_tokens) + token_nll(b, step_tokens)).item() == pytest.approx(1.0)
    assert (pair_mean(torch.tensor([1.0, 2.0]), torch.tensor(4)) + pair_mean(torch.tensor([3.0, 6.0]), torch.tensor(4))
            ).item() == pytest.approx(3.0)


def test_sft_per_sequence_sums_give_the_token_mean() -> None:
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 5, 4), torch.randn(7, 4)
    labels = torch.tensor([[1, 2, -100, 3, -100], [-100, 4, 5, 6, 0]])
    tokens = int((labels != -100).sum())
    per_token = token_logprobs(hidden, weight, labels)[0]
    expected = -per_token.sum() / tokens
    torch.testing.assert_close(token_nll(sequence_logprobs(hidden, weight, labels).logps, tokens), expected)
    torch.testing.assert_close(token_nll(per_token, torch.tensor(tokens)), expected)


def test_pair_mean() -> None:
    losses = torch.tensor([1.0, 2.0, 6.0])
    assert pair_mean(losses).item() == 3.0
    assert pair_mean(losses, torch.tensor(6)).item() == 1.5
    assert pair_mean(losses, torch.tensor(0)).item() == 9.0  # no pair in the step: divided by 1


def test_preference_loss_adds_the_weighted_chosen_nll() -> None:
    losses = torch.tensor([0.5, 1.5])  # mean 1.0
    chosen = torch.tensor([-3.0, -5.0])  # 8 nats over 4 tokens: nll 2.0
    loss, nll = preference_loss(losses, chosen)
    assert loss.item() == 1.0 and nll is None
    loss, nll = preference_loss(losses, chosen, sft_weight=0.25, num_chosen_tokens=4)
    assert nll.item() == 2.0 and loss.item() == 1.5
    # a step's totals: 4 pairs, 16 chosen tokens
    loss, nll = preference_loss(losses, chosen, sft_weight=0.25, num_pairs=torch.tensor(4),
                                num_chosen_tokens=torch.tensor(16))
    assert nll.item() == 0.5 and loss.item() == pytest.approx(0.5 + 0.125)
    with pytest.raises(ValueError, match="num_chosen_tokens"):
        preference_loss(losses, chosen, sft_weight=1.0)
