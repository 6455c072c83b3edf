"""A replies file (``generation.backend=file``) with faults (issue 35, items 6 and 9): a byte that
is not UTF-8 is that row's ``file:line`` error; rows no test item matches (an unknown id or
question) are counted in the report (``counts.replies_unmatched``), a file several benchmarks
share counted once over all of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rolemrc.data.schemas import DataError
from rolemrc.eval.run import run
from tests.eval.test_evaluate_file import TESTS, public_rolebench, rb_overrides, rolemrc_rows, write_replies  # noqa: F401
from tests.eval.test_evaluate_run import compose_eval


def base(replies: Path, out: Path) -> list[str]:
    return ["data=sample", "limit=6", "generation.backend=file", f"generation.path={replies}", "metrics.names=[rougeL]",
            "judge=none", f"out_dir={out}"]


def test_replies_for_unknown_ids_are_counted(tmp_path: Path) -> None:
    replies = tmp_path / "replies.jsonl"
    write_replies(replies, rolemrc_rows())
    with replies.open("a") as f:
        f.write(json.dumps({"id": "no-such-item", "reply": "Adrift."}) + "\n")
        f.write(json.dumps({"id": "00099-not-in-the-test-set", "reply": "Ashore."}) + "\n")
    run(compose_eval(*base(replies, tmp_path / "a")))
    doc = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert doc["counts"]["replies_unmatched"] == 2 and doc["counts"]["replies_missing"] == 0
    assert doc["meta"]["items"] == 6


def test_a_byte_that_is_not_utf8_in_a_replies_file_is_named(tmp_path: Path) -> None:
    replies = tmp_path / "replies.jsonl"
    write_replies(replies, rolemrc_rows())
    lines = replies.read_bytes().splitlines()
    lines[2] = lines[2].replace(b'"reply": "', b'"reply": "\xff', 1)
    replies.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataError, match=rf"1 bad row\(s\) in the replies file .*\n  {replies}:3: not UTF-8 text "
                                        r"\(byte 0xff at byte \d+ of the line; re-save the file as UTF-8\)"):
        run(compose_eval(*base(replies, tmp_path / "b")))


def test_a_replies_file_shared_by_several_benchmarks_is_counted_once(public_rolebench: Path, tmp_path: Path) -> None:
    """RoleBench's splits each match their own rows of the one file list: none of them is counted
    as unmatched for the other splits; a row of no split is."""
    extra = public_rolebench / TESTS[0] / "rolegpt_baseline.jsonl"
    with extra.open("a") as f:
        f.write(json.dumps({"role": "Nobody", "question": "Who asked this?", "generated": ["No one."]}) + "\n")
    run(compose_eval(*rb_overrides(public_rolebench, tmp_path / "rb")))
    doc = json.loads((tmp_path / "rb" / "metrics.json").read_text())
    assert doc["counts"]["replies_unmatched"] == 1
