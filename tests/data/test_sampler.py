"""The resumable sampler and the step batch sampler, as pure functions of (n, seed, epoch, rank):
same order for the same seed and epoch, the same shares as torch's DistributedSampler, a
resume that yields exactly what is left, and step tags that total every rank's micro-batches."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

from rolemrc.data.sampler import ResumableSampler, StepBatchSampler, StepItems


def shares(n: int, world: int, shuffle: bool = True, seed: int = 3, epoch: int = 0) -> list[list[int]]:
    out = []
    for rank in range(world):
        s = ResumableSampler(n, shuffle, seed, rank, world)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


def test_same_seed_and_epoch_give_the_same_order_and_others_differ() -> None:
    a, b = ResumableSampler(50, True, 7), ResumableSampler(50, True, 7)
    a.set_epoch(2)
    b.set_epoch(2)
    assert list(a) == list(b)
    assert sorted(a) == list(range(50)) and list(a) != list(range(50))
    b.set_epoch(3)
    assert list(b) != list(a) and sorted(b) == list(range(50))
    assert list(ResumableSampler(50, True, 8)) != list(ResumableSampler(50, True, 7))
    # Without shuffle every epoch is 0..n-1 whatever the seed.
    c = ResumableSampler(10, False, 99)
    c.set_epoch(5)
    assert list(c) == list(range(10))


@pytest.mark.parametrize("n,world", [(12, 3), (10, 4), (7, 2), (3, 4), (1, 2)])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("epoch", [0, 1])
def test_shares_match_torch_distributed_sampler(n: int, world: int, shuffle: bool, epoch: int) -> None:
    ours = shares(n, world, shuffle, seed=5, epoch=epoch)
    for rank in range(world):
        ref = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=5, drop_last=False)
        ref.set_epoch(epoch)
        assert ours[rank] == list(ref), rank


@pytest.mark.parametrize("n,world", [(12, 3), (10, 4), (7, 2), (3, 4)])
def test_rank_shares_are_strided_equal_and_cover_everything(n: int, world: int) -> None:
    per_rank = shares(n, world)
    full = ResumableSampler(n, True, 3).order()  # one rank: the epoch's whole permutation
    size = -(-n // world)
    assert all(len(s) == size for s in per_rank)
    assert set().union(*map(set, per_rank)) == set(range(n))
    padded = full + full[: size * world - n]  # wrapped to a multiple of world, like DistributedSampler
    for rank, share in enumerate(per_rank):
        assert share == padded[rank::world]
    if n % world == 0:  # no padding: the shares are disjoint
        flat = [i for s in per_rank for i in s]
        assert len(flat) == len(set(flat)) == n
    # Any rank derives any other rank's share (the step totals rely on it).
    s0 = ResumableSampler(n, True, 3, 0, world)
    assert [s0.order_for(r) for r in range(world)] == per_rank
    assert len(s0) == size


def test_empty_dataset() -> None:
    s = ResumableSampler(0, True, 0, 1, 2)
    assert list(s) == [] and len(s) == 0


def step_sampler(n: int, world: int, rank: int, batch: int, accumulate: int, weights: torch.Tensor,
                 epoch_batches: int | None = None, seed: int = 1, epoch: int = 0) -> StepBatchSampler:
    s = ResumableSampler(n, True, seed, rank, world)
    s.set_epoch(epoch)
    return StepBatchSampler(s, batch, accumulate, weights, epoch_batches)


@pytest.mark.parametrize("skip", [0, 1, 3, 4, 6])
def test_resume_yields_exactly_the_remaining_micro_batches(skip: int) -> None:
    weights = torch.ones(23, 1)
    full = list(step_sampler(23, 1, 0, 4, 2, weights))  # 6 micro-batches: 4,4,4,4,4,3 items
    assert [len(b) for b in full] == [4, 4, 4, 4, 4, 3]
    resumed = step_sampler(23, 1, 0, 4, 2, weights)
    resumed.skip_batches_fn = lambda: skip
    rest = list(resumed)
    assert rest == full[skip:]
    seen = [i for b in full[:skip] + rest for i, _, _ in b]
    assert sorted(seen) == list(range(23)) and len(seen) == 23  # nothing repeated, nothing lost
    assert len(resumed) == 6  # the epoch's length does not shrink with the resume


def test_resume_on_each_rank_keeps_that_ranks_share() -> None:
    weights = torch.ones(20, 1)
    for rank in range(2):
        full = list(step_sampler(20, 2, rank, 3, 1, weights))
        resumed = step_sampler(20, 2, rank, 3, 1, weights)
        resumed.skip_batches_fn = lambda: 2
        assert list(resumed) == full[2:]
        assert [i for b in full for i, _, _ in b] == ResumableSampler(20, True, 1, rank, 2).order()


@pytest.mark.parametrize("world,batch,accumulate,limit", [(1, 3, 2, None), (2, 2, 3, None), (3, 2, 2, None),
                                                          (2, 3, 2, 3), (2, 4, 1, None)])
def test_step_tags_total_every_ranks_micro_batches(world: int, batch: int, accumulate: int, limit: int | None) -> None:
    n = 17
    g = torch.Generator().manual_seed(0)
    weights = torch.randint(1, 1000, (n, 2), generator=g).to(torch.float64)  # e.g. label tokens, pairs
    per_rank = [list(step_sampler(n, world, r, batch, accumulate, weights, limit)) for r in range(world)]
    n_batches = len(per_rank[0])
    full = -(-(-(-n // world)) // batch)
    assert n_batches == (full if limit is None else min(limit, full))
    assert all(len(batches) == n_batches for batches in per_rank)
    steps = -(-n_batches // accumulate)
    assert step_sampler(n, world, 0, batch, accumulate, weights, limit).steps_per_epoch() == steps

    for step in range(steps):
        ks = range(step * accumulate, min((step + 1) * accumulate, n_batches))
        items = [i for batches in per_rank for k in ks for i, _, _ in batches[k]]
        expected = tuple(weights[items].sum(0).tolist())
        tags = {totals for batches in per_rank for k in ks for _, totals, _ in batches[k]}
        assert tags == {expected}, step  # every item of the step, on every rank, carries the global total
        for batches in per_rank:
            for k in ks:  # only the micro-batch that closes the step says so
                flags = {last for _, _, last in batches[k]}
                assert flags == {k == ks[-1]}, (step, k)


def test_epoch_limit_and_accumulate_floor() -> None:
    weights = torch.ones(10, 1)
    s = step_sampler(10, 1, 0, 2, 0, weights, epoch_batches=3)  # accumulate 0 counts as 1
    batches = list(s)
    assert len(s) == 3 and len(batches) == 3 and s.steps_per_epoch() == 3
    assert [i for b in batches for i, _, _ in b] == ResumableSampler(10, True, 1).order()[:6]
    assert all(last for b in batches for _, _, last in b)
    assert len(step_sampler(10, 1, 0, 2, 1, weights, epoch_batches=99)) == 5
    assert len(step_sampler(10, 1, 0, 2, 1, weights, epoch_batches=-1)) == 0


def test_step_items_pairs_each_item_with_its_tag() -> None:
    items = StepItems(["a", "b", "c"])
    assert len(items) == 3
    assert items[(2, (5.0, 1.0), True)] == ("c", (5.0, 1.0), True)


def test_epoch_batches_under_a_limit_are_lightnings() -> None:
    """The sampler ends an epoch where Lightning's fit loop does under limit_train_batches
    (Lightning's own computation is private: this fails if it changes)."""
    from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
    from lightning.pytorch.trainer.states import RunningStage

    from rolemrc.data.sampler import epoch_batches_under_limit

    for n in (1, 7, 16, 31):
        for limit in (1.0, 0.5, 0.25, 0.99, 1, 3, 16, 100):
            if isinstance(limit, float) and int(n * limit) == 0:
                continue  # Lightning refuses it
            assert epoch_batches_under_limit(n, limit) == _parse_num_batches(RunningStage.TRAINING, n, limit), (n, limit)


@pytest.mark.parametrize("skip", [0, 2, 3])
def test_step_ahead_hands_the_steps_micro_batches_to_its_first(skip: int) -> None:
    """With ``step_ahead`` (GRPO's rollouts of a whole step) the first micro-batch read of each step
    (after a restart: the first read) carries this rank's micro-batches of the step from it on;
    the others, and every key without the option, are as before."""
    weights = torch.ones(20, 1)
    plain = list(step_sampler(20, 1, 0, 3, 2, weights))
    s = step_sampler(20, 1, 0, 3, 2, weights)
    s.step_ahead, s.skip_batches_fn = True, (lambda: skip)
    ahead = list(s)
    assert [[k[:3] for k in b] for b in ahead] == plain[skip:]
    for k, b in enumerate(ahead, start=skip):
        first = k == skip or k % 2 == 0
        assert all(len(key) == 3 for key in b[1:]) and (len(b[0]) == 5) == first, k
        if first:
            end = (k // 2 + 1) * 2
            assert b[0][3] == tuple(tuple(i for i, _, _ in p) for p in plain[k:end])
    items = StepItems(list("abcdefghijklmnopqrstuvwxyz"))
    item, _, _, step, use = items[ahead[0][0]]
    assert use == 0
    assert step == [[items.items[i] for i in part] for part in ahead[0][0][3]] and item == step[0][0]


def test_repeat_reads_each_whole_step_again_and_drops_a_short_last_step() -> None:
    """GRPO's num_iterations: 20 items in micro-batches of 3 (7, the last short) and steps of 2:
    3 whole steps (the 7th micro-batch dropped, as TRL drops a short generation batch), each read
    twice in a row with the same totals; step_ahead tags which use a step is; resume mid-epoch."""
    weights = torch.arange(20, dtype=torch.float64).unsqueeze(1)
    plain = list(step_sampler(20, 1, 0, 3, 2, weights))
    s = StepBatchSampler(ResumableSampler(20, True, 1), 3, 2, weights, step_ahead=True, repeat=2)
    got = list(s)
    assert len(got) == 12 and s.steps_per_epoch() == 6
    expected = [plain[k] for step in range(3) for _ in range(2) for k in (2 * step, 2 * step + 1)]
    assert [[k[:3] for k in b] for b in got] == expected
    assert [b[0][4] for b in got[::2]] == [0, 1, 0, 1, 0, 1]
    s.skip_batches_fn = lambda: 6  # restarted before the second use of step 2
    assert list(s) == got[6:]
