"""Batches with dynamic padding (to the longest row of the batch, never to max_length)."""

from __future__ import annotations

from typing import Any

import torch

from rolemrc.data.templates import IGNORE


def pad(rows: list[list[int]], value: int) -> torch.Tensor:
    """[B, T_max] right-padded LongTensor."""
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


class SFTCollator:
    """``input_ids``, ``labels`` (-100 on context and padding), ``attention_mask``: [B, T]."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [e["input_ids"] for e in examples]
        return {
            "input_ids": pad(ids, self.pad_id),
            "labels": pad([e["labels"] for e in examples], IGNORE),
            "attention_mask": pad([[1] * len(r) for r in ids], 0),
            "index": torch.tensor([e["index"] for e in examples], dtype=torch.long),
        }


class PairCollator:
    """Chosen rows then rejected rows in one [2B, T] batch, so one forward scores both.

    Labels cover the response tokens only. ``index`` [B] identifies pairs (reference cache).
    """

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids, labels = [], []
        for side in ("chosen_ids", "rejected_ids"):
            for e in examples:
                ids.append(e["prompt_ids"] + e[side])
                labels.append([IGNORE] * len(e["prompt_ids"]) + e[side])
        return {
            "input_ids": pad(ids, self.pad_id),
            "labels": pad(labels, IGNORE),
            "attention_mask": pad([[1] * len(r) for r in ids], 0),
            "index": torch.tensor([e["index"] for e in examples], dtype=torch.long),
        }
