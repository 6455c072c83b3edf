"""Padding-free rows: several conversations (or preference pairs) per row, and the prompt of a
pair encoded once.

A *piece* is a run of tokens that attends causally to itself and, optionally, fully to a
*context* span earlier in the same row; nothing else is visible to it. Position ids restart at
each piece (at ``pos0``), so a piece computes exactly what it would as its own sequence.

- SFT conversation: one piece, positions from 0.
- Preference pair, ``share_prompt=False``: two pieces ``prompt + chosen`` and ``prompt + rejected``.
- Preference pair, ``share_prompt=True``: ``prompt + chosen``, then ``[prompt[-1]] + rejected``
  with positions from ``len(prompt) - 1`` and the context ``prompt[:-1]``. The copy of the last
  prompt token is what predicts the first rejected token: the prompt's own last position already
  predicts the first chosen token, and one hidden state cannot carry two labels. With that copy
  every rejected token sees exactly ``prompt + rejected[:i]`` at the positions it would have alone,
  so its log-prob equals the separate computation, for one extra token per pair instead of a
  second copy of the prompt.

Rows are filled by best-fit decreasing once at setup (deterministic, independent of the epoch), and
the sampler then shuffles whole rows, so exact resume keeps working unchanged.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from rolemrc.objectives import IGNORE_INDEX


@dataclass(frozen=True)
class Piece:
    """One attention segment of a packed row.

    ``ids``/``labels``: unshifted, same length (labels ``IGNORE_INDEX`` where nothing is trained).
    ``pos0``: position id of the first token. ``context``: ``(start, end)`` offsets, relative to
    the start of the item's first piece, of tokens this piece sees in full (``(0, 0)``: none).
    ``side``: ``0`` (conversation or chosen) or ``1`` (rejected).
    """

    ids: list[int]
    labels: list[int]
    pos0: int = 0
    context: tuple[int, int] = (0, 0)
    side: int = 0


def item_pieces(row: dict[str, Any], share_prompt: bool = False) -> list[Piece]:
    """The pieces of one encoded SFT row (``input_ids``/``labels``) or pair row
    (``prompt_ids``/``chosen_ids``/``rejected_ids``), laid out back to back."""
    if "input_ids" in row:
        return [Piece(row["input_ids"], row["labels"])]
    prompt, chosen, rejected = row["prompt_ids"], row["chosen_ids"], row["rejected_ids"]
    first = Piece(prompt + chosen, [IGNORE_INDEX] * len(prompt) + chosen)
    if not share_prompt:
        return [first, Piece(prompt + rejected, [IGNORE_INDEX] * len(prompt) + rejected, side=1)]
    if not prompt:
        raise ValueError("share_prompt needs a non-empty prompt (the generation prompt is always there)")
    # Context = prompt[:-1], which sits at the very start of the first piece.
    return [first, Piece(prompt[-1:] + rejected, [IGNORE_INDEX] + rejected, len(prompt) - 1, (0, len(prompt) - 1), 1)]


def item_length(row: dict[str, Any], share_prompt: bool = False) -> int:
    """Tokens the row occupies once laid out (without building the pieces)."""
    if "input_ids" in row:
        return len(row["input_ids"])
    p, c, r = len(row["prompt_ids"]), len(row["chosen_ids"]), len(row["rejected_ids"])
    return p + c + 1 + r if share_prompt else 2 * p + c + r


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Group item indices into bins of total length <= ``capacity`` (longer items get a bin of
    their own). Longest items first, each into the fullest bin that still fits it; ties broken by
    index, so the result depends only on ``lengths``. O(n log n) lookups via bisect.

    Returns the bins in creation order, items within a bin in placement order.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    # Sorted (room left, bin id) of bins that can still take something.
    open_bins: list[tuple[int, int]] = []
    for i in order:
        need = lengths[i]
        at = bisect.bisect_left(open_bins, (need, -1))
        if need <= capacity and at < len(open_bins):
            room, b = open_bins.pop(at)
            bins[b].append(i)
            room -= need
        else:
            bins.append([i])
            b, room = len(bins) - 1, capacity - need
        if room > 0:
            bisect.insort(open_bins, (room, b))
    return bins


def pack_rows(rows: list[dict[str, Any]], capacity: int, share_prompt: bool = False) -> tuple[list[list[dict]], dict]:
    """Rows grouped into packs of at most ``capacity`` tokens, and a fill report."""
    bins, report = plan_packs([item_length(r, share_prompt) for r in rows], capacity)
    return [[rows[i] for i in b] for b in bins], report


def plan_packs(lengths: list[int], capacity: int) -> tuple[list[list[int]], dict]:
    """:func:`best_fit_decreasing` bins of items of ``lengths`` and the fill report of
    :func:`pack_rows` (the plan the row store keeps, computed once)."""
    bins = best_fit_decreasing(lengths, capacity)
    tokens = sum(lengths)
    report = {
        "capacity": capacity,
        "rows": len(bins),
        "items": len(lengths),
        "items_per_row": round(len(lengths) / max(len(bins), 1), 3),
        "fill": round(tokens / max(len(bins) * capacity, 1), 4),
        "oversized_items": sum(n > capacity for n in lengths),
    }
    return bins, report
