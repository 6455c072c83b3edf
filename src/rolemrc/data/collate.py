"""Batches with dynamic padding (to the longest row of the batch, never to max_length), and
padding-free packed batches (several sequences per row, see :mod:`rolemrc.data.packing`)."""

from __future__ import annotations

from typing import Any

import torch

from rolemrc.data.packing import item_pieces
from rolemrc.objectives import IGNORE_INDEX


def pad(rows: list[list[int]], value: int) -> torch.Tensor:
    """[B, T_max] right-padded LongTensor."""
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


class _Padded:
    """A collator padding with ``pad_id`` (:meth:`padded`: rows right-padded)."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def padded(self, ids: list[list[int]], labels: list[list[int]], examples: list[dict[str, Any]]) -> dict[str, Any]:
        """``input_ids``, ``labels`` (-100 on padding), ``attention_mask`` [rows, T] and the
        examples' ``index``."""
        return {
            "input_ids": pad(ids, self.pad_id),
            "labels": pad(labels, IGNORE_INDEX),
            "attention_mask": pad([[1] * len(r) for r in ids], 0),
            "index": torch.tensor([e["index"] for e in examples], dtype=torch.long),
        }


class SFTCollator(_Padded):
    """``input_ids``, ``labels`` (-100 on context and padding), ``attention_mask``: [B, T]."""

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return self.padded([e["input_ids"] for e in examples], [e["labels"] for e in examples], examples)


class PairCollator(_Padded):
    """Chosen rows then rejected rows in one [2B, T] batch, so one forward scores both.

    Labels cover the response tokens only. ``index`` [B] identifies pairs (reference cache).
    ``margin`` [B] (float32) when any pair of the batch has one (a pair without: 0, no margin).
    """

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids, labels = [], []
        for side in ("chosen_ids", "rejected_ids"):
            for e in examples:
                ids.append(e["prompt_ids"] + e[side])
                labels.append([IGNORE_INDEX] * len(e["prompt_ids"]) + e[side])
        batch = self.padded(ids, labels, examples)
        if any("margin" in e for e in examples):
            batch["margin"] = torch.tensor([float(e.get("margin", 0.0)) for e in examples], dtype=torch.float32)
        return batch


class UnpairedCollator(_Padded):
    """Unpaired examples (``objective=kto``): one row each, prompt + completion, the completion
    labelled; ``label`` [N] (bool: desirable), ``index`` [N]. The KL rows are the module's
    business (:func:`rolemrc.modules.kto.mismatched`)."""

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [e["prompt_ids"] + e["completion_ids"] for e in examples]
        labels = [[IGNORE_INDEX] * len(e["prompt_ids"]) + e["completion_ids"] for e in examples]
        return {**self.padded(ids, labels, examples),
                "label": torch.tensor([bool(e["label"]) for e in examples], dtype=torch.bool)}


class PackedCollator:
    """Padding-free batches: each item (an encoded row, or a pack = list of rows) fills one
    batch row with its pieces back to back (see :mod:`rolemrc.data.packing`).

    Returns, all ``[B, T]`` unless noted (``T`` = the longest row of the batch):

    - ``input_ids`` (pad id after the last piece), ``labels`` (unshifted, ``-100`` off target),
    - ``position_ids``: restart at every piece,
    - ``sequence_ids``: which sequence a position belongs to, ``-1`` on padding. SFT: the k-th
      conversation of the batch is ``k``. Pairs: the chosen side of the j-th pair is ``j`` and its
      rejected side ``P + j`` (``P`` pairs in the batch), the chosen-then-rejected order of
      :class:`PairCollator`,
    - ``segments`` ``[S, 5]``: ``(row, start, end, context_start, context_end)`` per piece; a
      piece attends causally to ``[start, end)`` and fully to ``[context_start, context_end)``,
    - ``index`` ``[N]``: dataset index of each conversation / pair, in sequence-id order.

    There is no ``attention_mask``: the module turns ``segments`` into what its attention needs
    (per-segment kernels, flash varlen, or a 4-D additive mask).
    """

    def __init__(self, pad_id: int, share_prompt: bool = False) -> None:
        self.pad_id = pad_id
        self.share_prompt = share_prompt

    def __call__(self, items: list[Any]) -> dict[str, torch.Tensor]:

        packs = [item if isinstance(item, list) else [item] for item in items]
        rows_in_order = [row for pack in packs for row in pack]
        pairs = "prompt_ids" in rows_in_order[0]
        n_items = len(rows_in_order)
        ids_rows, label_rows, pos_rows, seq_rows, segments = [], [], [], [], []
        k = 0  # running item number in the batch
        for b, pack in enumerate(packs):
            ids: list[int] = []
            labels: list[int] = []
            pos: list[int] = []
            seq: list[int] = []
            for row in pack:
                base = len(ids)
                for piece in item_pieces(row, self.share_prompt):
                    sid = k + piece.side * n_items if pairs else k
                    start = len(ids)
                    ids += piece.ids
                    labels += piece.labels
                    pos += range(piece.pos0, piece.pos0 + len(piece.ids))
                    seq += [sid] * len(piece.ids)
                    c0, c1 = piece.context
                    segments.append((b, start, len(ids), base + c0, base + c1))
                k += 1
            ids_rows.append(ids)
            label_rows.append(labels)
            pos_rows.append(pos)
            seq_rows.append(seq)
        return {
            "input_ids": pad(ids_rows, self.pad_id),
            "labels": pad(label_rows, IGNORE_INDEX),
            "position_ids": pad(pos_rows, 0),
            "sequence_ids": pad(seq_rows, -1),
            "segments": torch.tensor(segments, dtype=torch.long),
            "index": torch.tensor([r["index"] for r in rows_in_order], dtype=torch.long),
        }


class PromptCollator(_Padded):
    """Prompts for online RL: ``prompt_ids`` ``[B, P]`` LEFT-padded (generation continues every row
    at the same position), ``prompt_mask`` ``[B, P]`` (1 on the prompt tokens), ``index`` ``[B]``,
    and, as Python lists, ``prompts`` (each prompt's messages) and ``columns`` (each reward column:
    one value per prompt; a field some records lack is None there)."""

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        width = max(len(r["prompt_ids"]) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["prompt_ids"])
            if n:
                ids[i, width - n:] = torch.tensor(r["prompt_ids"], dtype=torch.long)
                mask[i, width - n:] = 1
        names = list(dict.fromkeys(k for r in rows for k in r["columns"]))
        return {
            "prompt_ids": ids,
            "prompt_mask": mask,
            "index": torch.tensor([r["index"] for r in rows], dtype=torch.long),
            "prompts": [r["messages"] for r in rows],
            "columns": {k: [r["columns"].get(k) for r in rows] for k in names},
        }


def collator(kind: str, pad_id: int, packing: bool = False, share_prompt: bool = False) -> Any:
    """The collator of rows of data ``kind`` (sft, pairs, unpaired, prompts): it takes a list of
    rows (or of packs, with ``packing``) and returns the batch tensors; padding-free with
    ``packing`` or ``share_prompt`` (pairs)."""
    if kind == "prompts":
        return PromptCollator(pad_id)
    if packing or share_prompt:
        return PackedCollator(pad_id, share_prompt)
    if kind == "unpaired":
        return UnpairedCollator(pad_id)
    return SFTCollator(pad_id) if kind == "sft" else PairCollator(pad_id)


STEP_TOTALS = {"sft": ("tokens",), "pairs": ("pairs", "chosen_tokens"), "unpaired": ("examples", "desirable"),
               "prompts": ("prompts",)}


def row_totals(row: dict[str, Any]) -> tuple[int, ...]:
    """What one encoded row adds to its optimizer step's normalisers (:data:`STEP_TOTALS`):
    SFT: the tokens it trains (labels after the one-position shift); pairs: one pair and the
    chosen response's trained tokens; unpaired: one example and whether it is desirable; prompts: one prompt."""
    if "messages" in row:  # a prompt row (data kind prompts)
        return (1,)
    if "completion_ids" in row:
        return 1, int(bool(row["label"]))
    if "prompt_ids" in row:
        return 1, len(row["chosen_ids"]) - (0 if row["prompt_ids"] else 1)
    return (sum(1 for label in row["labels"][1:] if label != IGNORE_INDEX),)


class StepCollator:
    """Wraps a collator for batches from :class:`~rolemrc.data.sampler.StepBatchSampler`: adds
    ``step_<name>`` (float64 scalars: the global totals of the batch's optimizer step) and
    ``step_end`` (whether this micro-batch closes the step); with the sampler's ``step_ahead``, the
    first micro-batch of a step also ``step_batch`` (the collated items of the step's micro-batches
    on this rank, this one first), ``step_sizes`` (their micro-batch sizes) and ``step_use`` (which
    use of these prompts the step is: 0, or up to ``num_iterations - 1``)."""

    def __init__(self, collate: Any, names: tuple[str, ...]) -> None:
        self.collate, self.names = collate, names

    def __call__(self, tagged: list[tuple]) -> dict[str, Any]:
        batch = self.collate([t[0] for t in tagged])
        totals, last = tagged[0][1], tagged[0][2]
        if len(tagged[0]) > 3:
            ahead = tagged[0][3]
            batch["step_batch"] = self.collate([item for b in ahead for item in b])
            batch["step_sizes"] = [len(b) for b in ahead]
            batch["step_use"] = int(tagged[0][4])  # 0: the step's prompts are new; > 0: their reuse
        for name, value in zip(self.names, totals):
            batch[f"step_{name}"] = torch.tensor(value, dtype=torch.float64)
        batch["step_end"] = torch.tensor(bool(last))
        return batch
