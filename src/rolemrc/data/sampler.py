"""A seeded, rank-aware sampler that can start mid-epoch, for exact resume, and its place
(:class:`SamplerPlace`: the epoch being read and how many of this rank's micro-batches of it were
trained, with the layout they count in), saved once in every checkpoint through the train
loader's ``state_dict`` (:class:`ResumableLoader`: Lightning saves it with its loop state and so
knows the loader resumes mid-epoch)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Sampler

if TYPE_CHECKING:
    import lightning as L

log = logging.getLogger(__name__)


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

    ``step_ahead`` (online RL, whose rollouts are generated once per optimizer step): the first
    micro-batch this rank reads of each step also carries the indices of the step's micro-batches on
    this rank from it on (a fourth element of its first key: a tuple of index tuples; the fifth:
    which use of the step's prompts this is, see ``repeat``).

    ``repeat`` (GRPO's ``num_iterations``, TRL's RepeatSampler): each step's micro-batches are read
    ``repeat`` times in a row, one optimizer step each; the epoch then holds whole steps only (a
    short last step is dropped, as TRL drops a short generation batch).
    """

    def __init__(self, sampler: ResumableSampler, batch_size: int, accumulate: int, weights: torch.Tensor,
                 epoch_batches: int | None = None, step_ahead: bool = False, repeat: int = 1) -> None:
        self.sampler, self.batch_size, self.accumulate = sampler, batch_size, max(1, accumulate)
        self.step_ahead, self.repeat = step_ahead, max(1, repeat)
        self.weights = weights.to(torch.float64)  # [n_items, K]; float64: exact integer sums
        full = repeated_batches(len(sampler), batch_size, self.accumulate, self.repeat)
        self.epoch_batches = full if epoch_batches is None else max(0, min(full, epoch_batches))
        self.skip_batches_fn: Callable[[], int] | None = None  # micro-batches already trained this epoch

    def steps_per_epoch(self) -> int:
        return -(-self.epoch_batches // self.accumulate)

    def _batches(self, rank: int) -> list[list[int]]:
        order = self.sampler.order_for(rank)
        batches = [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        if self.repeat > 1:
            a = self.accumulate
            batches = [b for s in range(len(batches) // a) for _ in range(self.repeat)
                       for b in batches[s * a:(s + 1) * a]]
        return batches[: self.epoch_batches]

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
            keys: list[tuple] = [(i, totals[step], last) for i in batches[k]]
            if self.step_ahead and (k == skip or k % self.accumulate == 0):
                ahead = tuple(tuple(b) for b in batches[k:(step + 1) * self.accumulate])
                keys[0] = (*keys[0], ahead, step % self.repeat)
            yield keys

    def __len__(self) -> int:
        return self.epoch_batches


class StepItems(torch.utils.data.Dataset):
    """The loader's dataset under :class:`StepBatchSampler`: ``items[i]`` with its step's tag (and,
    with ``step_ahead``, the items of the step's micro-batches: a list of lists)."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, key: tuple) -> tuple:
        i, totals, last = key[:3]
        if len(key) > 3:
            return self.items[i], totals, last, [[self.items[j] for j in b] for b in key[3]], key[4]
        return self.items[i], totals, last


# ---- the train sampler's place ------------------------------------------------------------------
class SamplerPlace:
    """Where the train sampler is: this rank's micro-batches of ``epoch`` handed to training so far.

    :meth:`attach` connects it to each new train loader's batch sampler (its
    ``skip_batches_fn``: the micro-batches of the current epoch already trained before a restart);
    :meth:`count` is called as the fit loop takes each micro-batch (not as the loader prefetches it).
    Every rank trains the same number of micro-batches."""

    def __init__(self) -> None:
        self.epoch, self.batches = -1, 0
        self._restored: dict[str, Any] | None = None
        self._state_loaded = False
        self._sampler: Any = None  # the StepBatchSampler being read
        self._layout: dict[str, Any] = {}
        self._trainer: L.Trainer | None = None

    def attach(self, batch_sampler: Any, layout: dict[str, Any], trainer: L.Trainer | None) -> None:
        """Read ``batch_sampler`` (a :class:`~rolemrc.data.sampler.StepBatchSampler`), whose place
        counts in ``layout`` (items, batch size, accumulation, ranks, the rows' fingerprint)."""
        self._sampler, self._layout, self._trainer = batch_sampler, layout, trainer
        if trainer is not None:
            batch_sampler.skip_batches_fn = self.batches_done_in_epoch

    def count(self) -> None:
        self.batches += 1

    def batches_done_in_epoch(self) -> int:
        """Micro-batches of the current epoch this rank trained before a restart (0 on a fresh
        epoch): the restored place when it is this epoch's and counted in the same layout. From a
        checkpoint without a place (runs older than it) or in another layout (say, other ranks),
        :func:`place_from_step_count`."""
        t, b = self._trainer, self._sampler
        assert t is not None and b is not None
        epoch = b.sampler.epoch
        restored, self._restored = self._restored, None
        if restored is not None and restored["layout"] == self._layout:
            done = restored["batches"] if restored["epoch"] == epoch else 0
        elif t.ckpt_path is not None and (restored is not None or not self._state_loaded) and self.epoch < 0:
            if restored is not None:
                log.warning("the checkpoint's data place was counted in another layout (%s, now %s): "
                            "placing the sampler by the optimizer-step count", restored["layout"], self._layout)
            done = place_from_step_count(t.global_step, t.current_epoch, b.steps_per_epoch(), b.epoch_batches,
                                         b.accumulate)
        else:
            done = 0
        self.epoch, self.batches = epoch, done
        return done

    def state_dict(self) -> dict[str, Any]:
        """``{"sampler_place": {epoch, batches, layout}}``: whole optimizer steps only (a partial
        step's gradients are not in a checkpoint); empty before the first epoch starts."""
        b = self._sampler
        if b is None or self.epoch < 0:
            return {}
        done = self.batches
        if done < b.epoch_batches:
            done -= done % b.accumulate
        return {"sampler_place": {"epoch": self.epoch, "batches": done, "layout": dict(self._layout)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._state_loaded = True
        self._restored = state.get("sampler_place")


def repeated_batches(n: int, batch_size: int, accumulate: int, repeat: int) -> int:
    """Micro-batches a :class:`StepBatchSampler` of ``n`` indices yields per epoch (before a limit)."""
    full = -(-n // batch_size)
    return full if repeat <= 1 else full // accumulate * accumulate * repeat


def place_from_step_count(global_step: int, current_epoch: int, steps_per_epoch: int, epoch_batches: int,
                          accumulate: int) -> int:
    """Micro-batches of the current epoch trained, derived from the optimizer-step count (an epoch
    of ``epoch_batches`` micro-batches takes ``steps_per_epoch`` steps): for checkpoints that hold
    no place, or one counted in another layout."""
    steps_done = global_step - current_epoch * steps_per_epoch
    return max(0, min(epoch_batches, steps_done * accumulate))


def epoch_batches_under_limit(n: int, limit: Any) -> int:
    """Batches Lightning trains per epoch of ``n`` under ``trainer.limit_train_batches`` (int: a
    count, float: a fraction), as its fit loop computes it: the sampler must know where Lightning
    ends the epoch to give the last step its totals. Lightning computes this in a private function;
    ``tests/data/test_sampler.py`` compares the two."""
    if limit is None:
        return n
    if isinstance(limit, int) and not isinstance(limit, bool):
        return min(n, limit)
    return n if float(limit) == 1.0 else int(n * float(limit))


class ResumableLoader(DataLoader):
    """The train loader: a DataLoader whose ``state_dict``/``load_state_dict`` are its
    :class:`SamplerPlace`'s, so Lightning saves the place with its loop state and restores it before
    the loader is read (and knows the loader resumes mid-epoch)."""

    def __init__(self, *args: Any, place: SamplerPlace, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.place = place

    def state_dict(self) -> dict[str, Any]:
        return self.place.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.place.load_state_dict(state)
