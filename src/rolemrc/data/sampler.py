"""A seeded, rank-aware sampler that can start mid-epoch, for exact resume."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    """Epoch ``e`` visits ``randperm(n, seed + e)`` (or ``0..n-1``), split across ranks by
    stride; ``skip_fn`` tells how many of this rank's first indices were trained before a restart.

    Each rank sees the same number of indices (the permutation wraps to a multiple of
    ``world_size``), like ``DistributedSampler``.
    """

    def __init__(self, n: int, shuffle: bool, seed: int, rank: int = 0, world_size: int = 1) -> None:
        self.n, self.shuffle, self.seed = n, shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.skip_fn: Callable[[], int] | None = None  # indices of this epoch already trained

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            idx = torch.randperm(self.n, generator=g).tolist()
        else:
            idx = list(range(self.n))
        if self.n and self.n % self.world_size:
            idx += idx[: self.world_size - self.n % self.world_size]
        return idx[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        skip = self.skip_fn() if self.skip_fn is not None else 0
        return iter(self.order()[skip:])

    def __len__(self) -> int:
        return len(self.order())
