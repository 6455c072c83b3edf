"""A seeded, rank-aware sampler that can start mid-epoch, for exact resume."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    """Epoch ``e`` visits ``randperm(n, seed + e)`` (or ``0..n-1``), split across ranks by
    stride. Mid-epoch resume is :class:`StepBatchSampler`'s business (it skips whole micro-batches).

    Each rank sees the same number of indices (the permutation wraps to a multiple of
    ``world_size``), like ``DistributedSampler``.
    """

    def __init__(self, n: int, shuffle: bool, seed: int, rank: int = 0, world_size: int = 1) -> None:
        self.n, self.shuffle, self.seed = n, shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> list[int]:
        return self.order_for(self.rank)

    def order_for(self, rank: int) -> list[int]:
        """Rank ``rank``'s indices of the current epoch (any rank's, derivable on every rank)."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            idx = torch.randperm(self.n, generator=g).tolist()
        else:
            idx = list(range(self.n))
        if self.n and self.n % self.world_size:
            idx += idx[: self.world_size - self.n % self.world_size]
        return idx[rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.order())

    def __len__(self) -> int:
        return len(self.order())


class StepBatchSampler(Sampler[list]):
    """This rank's micro-batches of one epoch, each tagged with what its optimizer step holds
    over every rank: the totals of ``weights`` (e.g. label tokens, pairs) across the
    ``accumulate`` micro-batches of the step on all ``world_size`` ranks.

    The loss of a step can then be normalised by the whole global batch (a sum over tokens
    divided by the step's token count) without any communication or look-ahead: every rank
    derives every other rank's order from the seed. Yields lists of ``(item index, totals)``
    for :class:`StepItems`; ``epoch_batches`` caps the epoch (``limit_train_batches``).
    """

    def __init__(self, sampler: ResumableSampler, batch_size: int, accumulate: int, weights: torch.Tensor,
                 epoch_batches: int | None = None) -> None:
        self.sampler, self.batch_size, self.accumulate = sampler, batch_size, max(1, accumulate)
        self.weights = weights.to(torch.float64)  # [n_items, K]; float64: exact integer sums
        full = -(-len(sampler) // batch_size)
        self.epoch_batches = full if epoch_batches is None else max(0, min(full, epoch_batches))
        self.skip_batches_fn: Callable[[], int] | None = None  # micro-batches already trained this epoch

    def steps_per_epoch(self) -> int:
        return -(-self.epoch_batches // self.accumulate)

    def _batches(self, rank: int) -> list[list[int]]:
        order = self.sampler.order_for(rank)
        return [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)][: self.epoch_batches]

    def step_totals(self) -> list[tuple[float, ...]]:
        """Per optimizer step of the epoch: the weight totals over all ranks' micro-batches."""
        totals = []
        per_rank = [self._batches(r) for r in range(self.sampler.world_size)]
        for start in range(0, self.epoch_batches, self.accumulate):
            idx = [i for batches in per_rank for b in batches[start:start + self.accumulate] for i in b]
            totals.append(tuple(self.weights[idx].sum(0).tolist()))
        return totals

    def __iter__(self) -> Iterator[list]:
        batches = self._batches(self.sampler.rank)
        totals = self.step_totals()
        skip = self.skip_batches_fn() if self.skip_batches_fn is not None else 0
        for k in range(skip, len(batches)):
            step = k // self.accumulate
            last = k == len(batches) - 1 or (k + 1) % self.accumulate == 0
            yield [(i, totals[step], last) for i in batches[k]]

    def __len__(self) -> int:
        return self.epoch_batches


class StepItems(torch.utils.data.Dataset):
    """The loader's dataset under :class:`StepBatchSampler`: ``items[i]`` with its step's tag."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, key: tuple[int, tuple[float, ...], bool]) -> tuple:
        i, totals, last = key
        return self.items[i], totals, last
