"""The validation split is taken from the records before source weights duplicate or subsample
them: no record is both trained and validated on, and validation holds each record once."""

from __future__ import annotations

import json

from rolemrc import asset
from rolemrc.data.readers import read_examples


def key(example) -> str:
    return json.dumps(example.messages, sort_keys=True, default=str)


def test_weighted_copies_never_leak_into_validation() -> None:
    sources = [{"path": asset("sample/sft.jsonl"), "weight": 2.0},
               {"path": asset("sample/rlhflow_sft.jsonl"), "weight": 0.5}]
    train, report = read_examples(sources, "sft", seed=3, holdout=0.2)
    val = report.held_out
    n = sum(report.kept.values())
    assert len(val) == round(0.2 * n)
    assert len({key(v) for v in val}) == len(val), "each validation record once"
    assert not {key(t) for t in train} & {key(v) for v in val}, "a validation record is trained on"
    # the weights apply to what is left: twice each remaining sft record
    sft_left = report.kept[sources[0]["path"]] - sum(v.origin.startswith(sources[0]["path"]) for v in val)
    assert sum(t.origin.startswith(sources[0]["path"]) for t in train) == 2 * sft_left
    again, report2 = read_examples(sources, "sft", seed=3, holdout=0.2)
    assert [key(t) for t in again] == [key(t) for t in train] and [key(v) for v in report2.held_out] == [key(v) for v in val]


def test_no_holdout_keeps_the_mix() -> None:
    train, report = read_examples([{"path": asset("sample/sft.jsonl"), "weight": 2.0}], "sft")
    assert report.held_out == [] and len(train) == 2 * report.kept[asset("sample/sft.jsonl")]
