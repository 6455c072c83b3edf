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
