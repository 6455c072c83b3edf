"""Activation frequency maps, their discrepancy, and the most-changed neurons (facts §6).

For each test case and layer, the top ``top_fraction`` of neurons (by activation value at the last
prompt token) form the "active set". A neuron's frequency in a group of test cases is the share of
those cases in whose active set it is. Groups are the five judged dimensions (a case counts for
every dimension its task maps to) plus ``ALL`` (every case once). The discrepancy map of a group is
``freq_B - freq_A`` (e.g. DPO minus SFT), per (layer, neuron), in [-1, 1].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from rolemrc.probing.capture import check_site, encode_prompts, iter_activations
from rolemrc.tasks import Dimension, dimensions_of

ALL = "ALL"
GROUPS: tuple[str, ...] = (*(d.short for d in Dimension), ALL)  # KB RS MT NI PI ALL
RANK_BY = ("value", "abs")


def top_count(width: int, top_fraction: float) -> int:
    """Neurons per layer in the active set: ``round(top_fraction * width)``, at least 1."""
    if not 0.0 < top_fraction <= 1.0:
        raise ValueError(f"top_fraction must be in (0, 1], got {top_fraction}")
    return max(1, int(round(top_fraction * width)))


def top_mask(acts: torch.Tensor, top_fraction: float, rank_by: str = "value") -> torch.Tensor:
    """[B, L, H] activations -> [B, L, H] bool, True for each (case, layer)'s top neurons.

    ``rank_by="value"``: most positive first (the paper's "most activated");
    ``"abs"``: largest magnitude first.
    """
    if rank_by not in RANK_BY:
        raise ValueError(f"rank_by must be one of {RANK_BY}, got {rank_by!r}")
    scores = acts.abs() if rank_by == "abs" else acts
    k = top_count(acts.shape[-1], top_fraction)
    idx = scores.topk(k, dim=-1).indices
    return torch.zeros_like(acts, dtype=torch.bool).scatter_(-1, idx, True)


def groups_of(task: str) -> tuple[str, ...]:
    """Groups a test case of ``task`` counts for: its dimensions' short names, then ``ALL``."""
    return (*(d.short for d in dimensions_of(task)), ALL)


@dataclass
class FrequencyMaps:
    """Per group: ``freq[g]`` [L, H] float64 in [0, 1] and ``n_cases[g]`` (its normaliser).

    Groups without any test case are absent.
    """

    freq: dict[str, np.ndarray]
    n_cases: dict[str, int]
    site: str
    top_fraction: float
    rank_by: str = "value"

    @property
    def shape(self) -> tuple[int, int]:
        return next(iter(self.freq.values())).shape  # type: ignore[return-value]


@dataclass
class FrequencyCounter:
    """Streams batches of activations into per-group active-set counts ([L, H] int64 each)."""

    top_fraction: float = 0.2
    rank_by: str = "value"
    site: str = "mlp_out"
    counts: dict[str, torch.Tensor] = field(default_factory=dict)
    n_cases: dict[str, int] = field(default_factory=dict)

    def update(self, acts: torch.Tensor, tasks: Sequence[str]) -> None:
        """Add a batch: ``acts`` [B, L, H] and the B cases' task names."""
        if acts.ndim != 3 or acts.shape[0] != len(tasks):
            raise ValueError(f"expected acts [B, L, H] with B = {len(tasks)} tasks, got shape {tuple(acts.shape)}")
        mask = top_mask(acts, self.top_fraction, self.rank_by)
        for row, task in enumerate(tasks):
            for group in groups_of(task):
                if group not in self.counts:
                    self.counts[group] = torch.zeros(acts.shape[1:], dtype=torch.int64)
                    self.n_cases[group] = 0
                self.counts[group] += mask[row]
                self.n_cases[group] += 1

    def result(self) -> FrequencyMaps:
        if not self.counts:
            raise ValueError("no test cases were counted")
        freq = {g: (self.counts[g].double() / self.n_cases[g]).numpy() for g in GROUPS if g in self.counts}
        return FrequencyMaps(freq, {g: self.n_cases[g] for g in freq}, self.site, self.top_fraction, self.rank_by)


def frequency_maps(
    acts: torch.Tensor, tasks: Sequence[str], site: str, top_fraction: float = 0.2, rank_by: str = "value"
) -> FrequencyMaps:
    """Frequency maps of already captured activations [N, L, H] of N cases with these ``tasks``."""
    counter = FrequencyCounter(top_fraction, rank_by, check_site(site))
    counter.update(acts, tasks)
    return counter.result()


def compute_frequency_maps(
    model: nn.Module,
    chat: Any,
    items: Sequence[Any],
    site: str = "mlp_out",
    top_fraction: float = 0.2,
    batch_size: int = 4,
    rank_by: str = "value",
    max_prompt_length: int | None = None,
    progress: bool = False,
) -> FrequencyMaps:
    """Forward each test item's prompt once through ``model`` and count its active sets.

    ``chat`` is the :class:`~rolemrc.data.templates.ChatFormat` of the model's tokenizer; ``items``
    are :class:`~rolemrc.data.schemas.TestItem` (anything with ``task`` and ``question``). Works on
    a model in training: eval mode and no grad only for the call. Memory: O(L*H) per group plus one
    batch's activations.
    """
    if not items:
        raise ValueError("no test items to probe")
    for item in items:
        groups_of(item.task)  # unknown task names fail before any forward
    pad_id = chat.tokenizer.pad_token_id
    if pad_id is None:
        raise ValueError("the tokenizer has no pad token; set one (load_tokenizer uses eos)")
    prompts = encode_prompts(chat, items, max_prompt_length)
    counter = FrequencyCounter(top_fraction, rank_by, check_site(site))
    with tqdm(total=len(prompts), desc="probe", unit="prompt", disable=not progress) as bar:
        for indices, acts in iter_activations(model, prompts, site, pad_id, batch_size):
            counter.update(acts, [items[i].task for i in indices])
            bar.update(len(indices))
    return counter.result()


# ---- comparing two models --------------------------------------------------------------------

def discrepancy(a: FrequencyMaps, b: FrequencyMaps) -> dict[str, np.ndarray]:
    """``b.freq[g] - a.freq[g]`` [L, H] for every group both have."""
    if a.shape != b.shape:
        raise ValueError(f"maps of different shapes (layers x neurons): A {a.shape}, B {b.shape}; "
                         "the two models must share an architecture")
    if (a.site, a.top_fraction, a.rank_by) != (b.site, b.top_fraction, b.rank_by):
        raise ValueError("maps were made with different site/top_fraction/rank_by settings")
    if a.n_cases != b.n_cases:
        raise ValueError(f"maps count different test cases: A {a.n_cases}, B {b.n_cases}")
    return {g: b.freq[g] - a.freq[g] for g in a.freq}


def layer_change(diff: np.ndarray) -> np.ndarray:
    """[L, H] discrepancy -> [L] mean absolute change per layer (comparable across widths)."""
    return np.abs(diff).mean(axis=-1)


def ranked_layers(diff: np.ndarray) -> list[int]:
    """Layer indices, most changed first."""
    return [int(i) for i in np.argsort(-layer_change(diff), kind="stable")]


SELECT = ("topk", "fraction")
SCOPES = ("global", "per_layer")
DIRECTIONS = ("abs", "increase", "decrease")


def select_neurons(
    diff: np.ndarray,
    select: str = "topk",
    k: int = 100,
    fraction: float = 0.01,
    scope: str = "global",
    layers: Sequence[int] | None = None,
    direction: str = "abs",
) -> list[tuple[int, int]]:
    """The most-changed (layer, neuron) pairs of a [L, H] discrepancy map, most changed first.

    select: ``topk`` keeps ``k`` neurons, ``fraction`` keeps ``ceil(fraction * candidates)``;
    counted over all candidate neurons (``global``) or in each layer (``per_layer``).
    layers: ``[first, last]`` (inclusive) limits the candidates to that layer range.
    direction: rank by ``|d|`` (``abs``), by ``d`` (``increase``: more often active in B) or ``-d``.
    Neurons whose change is 0 are never selected.
    """
    if select not in SELECT or scope not in SCOPES or direction not in DIRECTIONS:
        raise ValueError(f"select in {SELECT}, scope in {SCOPES}, direction in {DIRECTIONS}; "
                         f"got {select!r}, {scope!r}, {direction!r}")
    n_layers, width = diff.shape
    first, last = (0, n_layers - 1) if layers is None else _layer_range(layers, n_layers)
    score = {"abs": np.abs(diff), "increase": diff, "decrease": -diff}[direction]
    candidates = score[first:last + 1]  # [L', H]

    def how_many(n: int) -> int:
        if select == "topk":
            if k < 0:
                raise ValueError(f"k must be >= 0, got {k}")
            return min(k, n)
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        return min(n, math.ceil(fraction * n))

    chosen: list[tuple[float, int, int]] = []
    if scope == "global":
        flat = candidates.reshape(-1)
        for j in np.argsort(-flat, kind="stable")[:how_many(flat.size)]:
            chosen.append((float(flat[j]), first + int(j) // width, int(j) % width))
    else:
        for offset, row in enumerate(candidates):
            for j in np.argsort(-row, kind="stable")[:how_many(width)]:
                chosen.append((float(row[j]), first + offset, int(j)))
    chosen = [c for c in chosen if c[0] > 0]
    chosen.sort(key=lambda c: -c[0])
    return [(layer, neuron) for _, layer, neuron in chosen]


def _layer_range(layers: Sequence[int], n_layers: int) -> tuple[int, int]:
    if len(layers) != 2:
        raise ValueError(f"layers must be [first, last], got {list(layers)}")
    first, last = int(layers[0]), int(layers[1])
    if not 0 <= first <= last < n_layers:
        raise ValueError(f"layers [{first}, {last}] is not a range within the model's {n_layers} layers")
    return first, last


# ---- saving ----------------------------------------------------------------------------------

def save_maps(path: str | Path, a: FrequencyMaps, b: FrequencyMaps | None = None,
              names: tuple[str, str] = ("A", "B")) -> Path:
    """One ``.npz``: ``freq_a/<G>``, ``freq_b/<G>``, ``diff/<G>`` ([L, H] float32),
    ``layer_change/<G>`` ([L]), ``n_cases/<G>``, plus ``site``, ``top_fraction``, ``rank_by``, ``names``."""
    arrays: dict[str, Any] = {
        "site": np.array(a.site), "top_fraction": np.array(a.top_fraction), "rank_by": np.array(a.rank_by),
        "names": np.array(names),
    }
    for g, f in a.freq.items():
        arrays[f"freq_a/{g}"] = f.astype(np.float32)
        arrays[f"n_cases/{g}"] = np.array(a.n_cases[g])
    if b is not None:
        for g, f in b.freq.items():
            arrays[f"freq_b/{g}"] = f.astype(np.float32)
        for g, d in discrepancy(a, b).items():
            arrays[f"diff/{g}"] = d.astype(np.float32)
            arrays[f"layer_change/{g}"] = layer_change(d).astype(np.float32)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)
    return path


def load_maps(path: str | Path) -> dict[str, Any]:
    """The arrays of :func:`save_maps` as ``{"freq_a": {G: [L, H]}, "freq_b": ..., "diff": ...,
    "layer_change": ..., "n_cases": {G: int}, "site": str, ...}``."""
    out: dict[str, Any] = {}
    with np.load(path) as data:
        for key in data.files:
            if "/" in key:
                kind, group = key.split("/", 1)
                out.setdefault(kind, {})[group] = int(data[key]) if kind == "n_cases" else data[key]
            else:
                value = data[key]
                out[key] = value.tolist() if value.ndim else value.item()
    return out
