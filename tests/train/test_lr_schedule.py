"""The learning-rate schedule: warmup reaches the peak, decay matches transformers' schedules."""

from __future__ import annotations

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

from rolemrc.modules.base import lr_lambda


def multipliers(factory, warmup: int, total: int) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = factory(opt, warmup, total)
    out = []
    for _ in range(total + 1):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_warmup_reaches_the_peak_without_a_step_at_zero(kind: str) -> None:
    f = lr_lambda(kind, warmup=4, total=20, min_ratio=0.0)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0


@pytest.mark.parametrize("kind,factory", [("cosine", get_cosine_schedule_with_warmup),
                                          ("linear", get_linear_schedule_with_warmup)])
def test_decay_equals_transformers(kind: str, factory) -> None:
    warmup, total = 3, 17
    theirs = multipliers(factory, warmup, total)
    ours = lr_lambda(kind, warmup, total, 0.0)
    for s in range(warmup, total + 1):
        assert ours(s) == pytest.approx(theirs[s], abs=1e-12), s
    assert ours(total) == pytest.approx(0.0, abs=1e-12)


def test_min_lr_ratio_floor_and_bad_kind() -> None:
    f = lr_lambda("cosine", 0, 10, 0.1)
    assert f(0) == 1.0 and f(10) == pytest.approx(0.1) and all(f(s) >= 0.1 - 1e-12 for s in range(20))
    with pytest.raises(ValueError, match="optim.scheduler"):
        lr_lambda("step", 0, 10, 0.0)


@pytest.mark.parametrize("kind,factory", [("cosine", get_cosine_schedule_with_warmup),
                                          ("linear", get_linear_schedule_with_warmup)])
def test_min_lr_ratio_rescales_the_decay_and_holds_after_total(kind: str, factory) -> None:
    warmup, total, floor = 2, 12, 0.25
    theirs = multipliers(factory, warmup, total)
    f = lr_lambda(kind, warmup, total, floor)
    for s in range(warmup, total + 1):  # floor + (1 - floor) * transformers' decay
        assert f(s) == pytest.approx(floor + (1 - floor) * theirs[s], abs=1e-12), s
    assert [f(s) for s in range(total, total + 5)] == pytest.approx([floor] * 5, abs=1e-12)
    assert all(f(s + 1) <= f(s) + 1e-12 for s in range(warmup - 1, total + 3))  # never climbs after the peak


def test_constant_holds_the_peak_after_warmup_and_ignores_the_floor() -> None:
    f = lr_lambda("constant", 3, 10, 0.5)
    assert [f(s) for s in range(3)] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert all(f(s) == 1.0 for s in range(2, 30))


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_no_warmup_starts_at_the_peak(kind: str) -> None:
    f = lr_lambda(kind, 0, 8, 0.0)
    assert f(0) == 1.0
    if kind != "constant":
        assert f(4) == pytest.approx(0.5, abs=1e-12) and f(8) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup,total", [(5, 5), (6, 3), (1, 1), (0, 0)])
def test_total_within_warmup_trains_every_step_on_the_ramp(kind: str, warmup: int, total: int) -> None:
    """warmup >= total (e.g. warmup_ratio=1 or a tiny run): every trained step 0..total-1 is on
    the ramp (s + 1) / warmup, nothing divides by zero, and after the ramp the multiplier stays
    within [min_ratio, 1]."""
    f = lr_lambda(kind, warmup, total, 0.1)
    assert [f(s) for s in range(warmup)] == pytest.approx([(s + 1) / warmup for s in range(warmup)])
    assert all(0.1 - 1e-12 <= f(s) <= 1.0 for s in range(warmup, warmup + 5))


def test_lambda_drives_a_torch_scheduler_as_configure_optimizers_does() -> None:
    """LambdaLR multiplies the peak lr by the lambda of the number of optimizer steps taken."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda("linear", 2, 6, 0.0))
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([1e-3, 2e-3, 2e-3, 1.5e-3, 1e-3, 0.5e-3])
