"""Validation names file, line and problem; on_error=skip drops and counts; sources mix by weight."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rolemrc import asset
from rolemrc.data.readers import read_examples
from rolemrc.data.schemas import DataError


def test_bad_sft_file_names_every_bad_line() -> None:
    path = asset("sample/bad_sft.jsonl")
    with pytest.raises(DataError) as err:
        read_examples([{"path": path}], "sft")
    msg = str(err.value)
    assert "4 invalid sft record(s)" in msg
    assert f"{path}:3: invalid JSON" in msg
    assert f"{path}:5: missing field 'conversations'" in msg
    assert f"{path}:7: conversations[" in msg and "unknown role 'Narrator'" in msg
    assert f"{path}:9: field 'conversations[" in msg and "is empty" in msg
    for good in (1, 2, 4, 6, 8, 10):
        assert f"{path}:{good}:" not in msg


def test_skip_drops_and_reports() -> None:
    path = asset("sample/bad_sft.jsonl")
    examples, report = read_examples([{"path": path}], "sft", on_error="skip")
    assert len(examples) == 6
    assert report.skipped[path] == 4 and report.kept[path] == 6
    assert len(report.examples) == 4 and report.examples[0].startswith(f"{path}:3:")
    assert [e.origin for e in examples] == [f"{path}:{n}" for n in (1, 2, 4, 6, 8, 10)]


def test_bad_pairs_file() -> None:
    path = asset("sample/bad_pairs.jsonl")
    with pytest.raises(DataError) as err:
        read_examples([{"path": path}], "pairs")
    msg = str(err.value)
    assert f"{path}:2: missing field 'chosen'" in msg
    assert f"{path}:4: chosen and rejected are identical" in msg
    assert f"{path}:6: field 'rejected' is empty" in msg
    assert "3 invalid pairs record(s)" in msg


@pytest.mark.parametrize(
    "record,problem",
    [
        ({"conversations": [{"role": "User", "content": "hi"}, {"role": "User", "content": "again"},
                            {"role": "Assistant", "content": "x"}]}, "two user turns in a row"),
        ({"conversations": [{"role": "User", "content": "hi"}, {"role": "System", "content": "late"},
                            {"role": "Assistant", "content": "x"}]}, "System message may only come first"),
        ({"conversations": [{"role": "System", "content": "s"}, {"role": "User", "content": "q"}]},
         "no Assistant turn"),
        ({"conversations": [{"role": "System", "content": "s"}, {"role": "Assistant"}]}, "missing field 'content'"),
    ],
)
def test_turn_order_and_fields(tmp_path: Path, record: dict, problem: str) -> None:
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"conversations": [{"role": "System", "content": "ok"},
                                                  {"role": "Assistant", "content": "ok"}]}) + "\n"
                    + json.dumps(record) + "\n")
    with pytest.raises(DataError, match=rf"one.jsonl:2: .*{problem}"):
        read_examples([{"path": str(path)}], "sft")


def test_ultrafeedback_pairs_and_parquet(tmp_path: Path) -> None:
    pairs, _ = read_examples([{"path": asset("sample/pairs_ultrafeedback.jsonl")}], "pairs")
    assert pairs and all(p.prompt[-1]["role"] == "user" for p in pairs)
    rows = [json.loads(line) for line in Path(asset("sample/sft.jsonl")).read_text().splitlines()[:5]]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "sft.parquet")
    convs, _ = read_examples([{"path": str(tmp_path / "sft.parquet")}], "sft")
    assert len(convs) == 5 and convs[0].messages[0]["role"] == "system"


def test_weighted_mixing_is_seeded() -> None:
    sft = asset("sample/sft.jsonl")
    n = len(read_examples([{"path": sft}], "sft")[0])
    mixed, _ = read_examples([{"path": sft, "weight": 2.0}, {"path": asset("sample/rlhflow_sft.jsonl"), "weight": 0.5}], "sft")
    n_rlhf = len(read_examples([{"path": asset("sample/rlhflow_sft.jsonl")}], "sft")[0])
    assert len(mixed) == 2 * n + round(0.5 * n_rlhf)
    again, _ = read_examples([{"path": sft, "weight": 2.0}, {"path": asset("sample/rlhflow_sft.jsonl"), "weight": 0.5}], "sft")
    assert [e.origin for e in again] == [e.origin for e in mixed]


def test_missing_local_file_is_clear() -> None:
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_examples([{"path": "./nope.jsonl"}], "sft")


def test_a_source_is_read_against_its_schema() -> None:
    """Sources reach the readers as SourceConfig; one given as a plain mapping (a callback's
    ``test: [{path: ...}]``) is checked the same way: a misspelt key or a missing path is named."""
    from rolemrc.config import SourceConfig
    from rolemrc.data.readers import source_config

    sft = asset("sample/sft.jsonl")
    assert source_config({"path": sft, "weight": 2}) == SourceConfig(path=sft, weight=2.0)
    typed, _ = read_examples([SourceConfig(path=sft, weight=2.0)], "sft")
    assert [e.origin for e in typed] == [e.origin for e in read_examples([{"path": sft, "weight": 2}], "sft")[0]]
    with pytest.raises(Exception, match="wieght"):
        read_examples([{"path": sft, "wieght": 2}], "sft")
    with pytest.raises(Exception, match="path"):
        read_examples([{"weight": 2}], "sft")


def test_test_items_cover_all_tasks() -> None:
    from rolemrc.tasks import TASKS

    items, _ = read_examples([{"path": asset("sample/test.jsonl")}], "test")
    assert {i.task for i in items} == set(TASKS)


def test_rolebench_rows_become_conversations(tmp_path: Path) -> None:
    path = tmp_path / "rb.jsonl"
    path.write_text(json.dumps({"role": "Sherlock Holmes", "question": "Who did it?",
                                "generated": ["The butler, obviously.", "Elementary."]}) + "\n"
                    + json.dumps({"role": "Watson", "question": "Hm?"}) + "\n")
    with pytest.raises(DataError, match=r"rb.jsonl:2: RoleBench row lacks \['generated'\]"):
        read_examples([{"path": str(path), "format": "rolebench"}], "sft")
    convs, _ = read_examples([{"path": str(path), "format": "rolebench"}], "sft", on_error="skip")
    assert [m["role"] for m in convs[0].messages] == ["system", "user", "assistant"]
    assert "Sherlock Holmes" in convs[0].messages[0]["content"]
    assert convs[0].messages[-1]["content"] == "The butler, obviously." and convs[0].task == "rolebench"
    with pytest.raises(ValueError, match="not readable as pairs"):
        read_examples([{"path": str(path), "format": "rolebench"}], "pairs")
