"""RLOO's advantages and loss: by hand, and against TRL 1.16 on the same tensors.

The loss: TRL's own ``RLOOTrainer._compute_loss`` is called, unbound, on a stand-in trainer whose
forward returns the test's per-token log-probs (one process, no accumulation), and its loss,
gradient and logged metrics are compared with :func:`rloo_loss`. The advantages are computed inline
in TRL's ``_generate_and_score_completions``, not a callable: :func:`trl_rloo_advantages` restates
those lines (trl/trainer/rloo_trainer.py 1647-1705 in TRL 1.16.0), using TRL's ``nanstd``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl")
from trl import RLOOConfig  # noqa: E402
from trl.trainer.rloo_trainer import RLOOTrainer  # noqa: E402
from trl.trainer.utils import nanstd as trl_nanstd  # noqa: E402

from rolemrc.objectives.rloo import rloo_advantages, rloo_loss, sequence_kl  # noqa: E402
from tests.objectives.test_grpo_trl import _Accelerator  # noqa: E402

assert trl.__version__ == "1.16.0", "these tests restate TRL 1.16.0's lines; re-read them for another version"

RLOO_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RLOOConfig) if f.default is not dataclasses.MISSING}
NAN = float("nan")


def trl_rloo_loss(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, old_logps: torch.Tensor,
                  entropies: torch.Tensor | None = None, **config) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL 1.16's ``RLOOTrainer._compute_loss`` of these tensors (``config``: RLOOConfig fields over
    its defaults; one process) -> its loss and what it logged (one value per metric)."""
    args = SimpleNamespace(**{**RLOO_DEFAULTS, **config})
    trainer = SimpleNamespace(
        args=args, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high,
        aux_loss_enabled=False, model=SimpleNamespace(training=True), accelerator=_Accelerator(),
        _metrics={"train": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (
            logps, torch.zeros_like(logps) if entropies is None else entropies, None))
    b, t = logps.shape
    inputs = {"prompt_ids": torch.zeros(b, 2, dtype=torch.long), "prompt_mask": torch.ones(b, 2, dtype=torch.long),
              "completion_ids": torch.zeros(b, t, dtype=torch.long), "completion_mask": mask,
              "old_logps": old_logps, "advantages": advantages}
    loss = RLOOTrainer._compute_loss(trainer, None, inputs)
    return loss, {k: v[0] for k, v in trainer._metrics["train"].items()}


def trl_rloo_advantages(rewards: torch.Tensor, g: int, kl: torch.Tensor | None = None, beta: float = 0.0,
                        reward_clip_range=None, normalize_advantages: bool = False,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL 1.16's lines from the summed rewards (NaN: unscorable) to the advantages, restated; and
    ``is_std_zero`` per group (logged as ``frac_reward_zero_std``)."""
    if reward_clip_range:
        rewards = rewards.clamp(min=reward_clip_range[0], max=reward_clip_range[1])
    if beta != 0.0:
        rewards = rewards - beta * kl
    grouped = rewards.view(-1, g)
    std = trl_nanstd(grouped, dim=1)
    counts = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    total = torch.nansum(grouped, dim=1, keepdim=True)
    advantages = rewards - ((total - grouped) / (counts - 1)).view(-1)
    if normalize_advantages:
        advantages = (advantages - torch.nanmean(advantages)) / (trl_nanstd(advantages) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def test_leave_one_out_by_hand():
    """Rewards [1, 2, 6] of one prompt: baselines (2+6)/2=4, (1+6)/2=3.5, (1+2)/2=1.5; a second
    prompt [0, NaN, 4]: the unscorable one gets 0 and is not in the others' baselines (4 - 0, 0 - 4)."""
    rewards = torch.tensor([1.0, 2.0, 6.0, 0.0, NAN, 4.0], dtype=torch.float64)
    out = rloo_advantages(rewards, 3)
    assert out.advantages.tolist() == [-3.0, -1.5, 4.5, -4.0, 0.0, 4.0]
    assert out.is_std_zero.tolist() == [False] * 6
    # identical rewards: no advantage, the group counted as zero-std
    assert rloo_advantages(torch.tensor([2.0, 2.0]), 2).advantages.tolist() == [0.0, 0.0]
    assert rloo_advantages(torch.tensor([2.0, 2.0]), 2).is_std_zero.tolist() == [True, True]
    # a lone scorable completion has no baseline: advantage 0
    assert rloo_advantages(torch.tensor([3.0, NAN]), 2).advantages.tolist() == [0.0, 0.0]


def test_kl_is_taken_out_of_the_reward_per_sequence_by_hand():
    """old - ref summed over the completion tokens (the mask ends the second row after one token):
    kl = [0.5 + 0.25, -1.0]; beta 0.2 -> penalised rewards [1 - 0.15, 1 + 0.2]; advantages +-0.35.
    The reward is clipped to [0, 1] BEFORE the penalty (3 -> 1)."""
    old = torch.tensor([[-1.0, -2.0], [-3.0, -9.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -2.25], [-2.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    kl = sequence_kl(old, ref, mask)
    assert kl.tolist() == [0.75, -1.0]
    out = rloo_advantages(torch.tensor([1.0, 3.0], dtype=torch.float64), 2, kl=kl, beta=0.2, reward_clip_range=(0, 1))
    torch.testing.assert_close(out.advantages, torch.tensor([-0.35, 0.35], dtype=torch.float64))
    norm = rloo_advantages(torch.tensor([1.0, 3.0], dtype=torch.float64), 2, kl=kl, beta=0.2, reward_clip_range=(0, 1),
                           normalize_advantages=True)
    std = (2 * 0.35**2) ** 0.5  # Bessel: two values +-0.35 around 0
    torch.testing.assert_close(norm.advantages, torch.tensor([-0.35, 0.35], dtype=torch.float64) / (std + 1e-4))
    with pytest.raises(ValueError, match="needs kl"):
        rloo_advantages(torch.ones(2), 2, beta=0.1)
    with pytest.raises(ValueError, match="at least 2"):
        rloo_advantages(torch.ones(3), 1)


def test_sequence_ratio_loss_by_hand():
    """Two sequences, sequence log-ratios ln 2 and ln 0.5, advantages +1 and -1, epsilon 0.2: the
    clipped terms -1.2 x 1 and -(0.8 x -1) = 0.8 -> loss (-1.2 + 0.8) / 2 = -0.2; both clipped."""
    logps = torch.tensor([[-1.0, -1.0], [-2.0, 0.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    old = torch.tensor([-2.0 - torch.log(torch.tensor(2.0)).item(), -2.0 + torch.log(torch.tensor(2.0)).item()],
                       dtype=torch.float64)
    out = rloo_loss(logps, torch.tensor([1.0, -1.0], dtype=torch.float64), mask, old_logps=old)
    assert out.loss.item() == pytest.approx(-0.2)
    assert out.metrics["clip_ratio/high_mean"].item() == 0.5 and out.metrics["clip_ratio/low_mean"].item() == 0.5
    assert out.metrics["clip_ratio/region_mean"].item() == 1.0
    # on-policy (old None): ratio 1, the gradient the policy gradient -A/B per completion token
    on = rloo_loss(logps, torch.tensor([1.0, -1.0], dtype=torch.float64), mask)
    (grad,) = torch.autograd.grad(on.loss, logps)
    assert grad.tolist() == [[-0.5, -0.5], [0.5, 0.0]]


def _tensors(seed: int, n: int = 6, t: int = 7):
    g = torch.Generator().manual_seed(seed)
    logps = (-3 * torch.rand(n, t, generator=g, dtype=torch.float64)).requires_grad_()
    lengths = torch.tensor([7, 3, 1, 5, 7, 2])[:n]
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    seq = (logps.detach() * mask).sum(-1)
    old = seq + torch.randn(n, generator=g, dtype=torch.float64)  # ratios well past 1 +- 0.28
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    ent = 3 * torch.rand(n, t, generator=g, dtype=torch.float64)
    return logps, mask, old, adv, ent


@pytest.mark.parametrize("eps,on_policy", list(itertools.product([(0.2, None), (0.2, 0.28), (0.05, 0.1)],
                                                                   [True, False])))
def test_loss_gradient_and_metrics_equal_trl(eps, on_policy):
    logps, mask, old, adv, ent = _tensors(5)
    if on_policy:
        old = (logps.detach() * mask).sum(-1)
    theirs, logged = trl_rloo_loss(logps, adv, mask, old, entropies=ent, epsilon=eps[0], epsilon_high=eps[1])
    ours = rloo_loss(logps, adv, mask, old_logps=old, epsilon=eps[0], epsilon_high=eps[1])
    torch.testing.assert_close(ours.loss, theirs)
    torch.testing.assert_close(torch.autograd.grad(ours.loss, logps)[0], torch.autograd.grad(theirs, logps)[0])
    logged.pop("entropy")
    assert set(ours.metrics) == set(logged)
    for name, value in logged.items():
        assert ours.metrics[name].item() == pytest.approx(value, rel=1e-6, abs=1e-7), name
    if not on_policy:
        assert logged["clip_ratio/region_mean"] > 0


@pytest.mark.parametrize("beta,clip,normalize", list(itertools.product([0.0, 0.05], [None, (0.0, 0.6)],
                                                                       [False, True])))
def test_advantages_equal_trl(beta, clip, normalize):
    g = torch.Generator().manual_seed(3)
    rewards = torch.rand(12, generator=g, dtype=torch.float64)
    rewards[4] = NAN  # an unscorable completion
    rewards[9:12] = 0.5  # a group that teaches nothing (beta 0)
    kl = torch.randn(12, generator=g, dtype=torch.float64) if beta else None
    want, zero = trl_rloo_advantages(rewards, 3, kl, beta, clip, normalize)
    got = rloo_advantages(rewards, 3, kl=kl, beta=beta, reward_clip_range=clip, normalize_advantages=normalize)
    torch.testing.assert_close(got.advantages, want)
    assert got.is_std_zero.view(-1, 3)[:, 0].tolist() == zero.tolist()
    assert got.advantages[4] == 0


def test_defaults_are_trls():
    """objective=rloo's defaults of the keys it shares with RLOOConfig are TRL's, but
    max_completion_length (256, as objective=grpo's)."""
    from rolemrc.config import RLOOObjectiveConfig

    config = {f.name: f.default for f in dataclasses.fields(RLOOObjectiveConfig)
              if f.default is not dataclasses.MISSING}
    shared = set(config) & set(RLOO_DEFAULTS)
    assert {"beta", "epsilon", "epsilon_high", "num_iterations", "num_generations", "normalize_advantages",
            "reward_clip_range", "mask_truncated_completions", "temperature", "top_p", "top_k"} <= shared
    for key in shared - {"max_completion_length"}:
        assert config[key] == RLOO_DEFAULTS[key], key
    assert config["beta"] == 0.05 and config["num_generations"] == 2
