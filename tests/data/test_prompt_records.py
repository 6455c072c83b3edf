"""Online-RL prompt records (data kind ``prompts``): the three shapes and their file:line errors."""

import json

import pytest

from rolemrc.data.readers import read_examples
from rolemrc.data.schemas import DataError, PromptItem
from rolemrc import asset


def _write(tmp_path, records):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_three_shapes(tmp_path):
    rule = {"type": "no_commas"}
    path = _write(tmp_path, [
        {"task": "role_related_mrc_answer_with_narration", "question": [{"role": "System", "content": "Be Tobias."},
                                                                         {"role": "User", "content": "Hi?"}],
         "reference": "Aye.", "rule": rule},
        {"prompt": [{"role": "user", "content": "Hello"}], "rule": [rule, {"type": "all_caps"}], "persona": "x"},
        {"conversations": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                           {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]},
    ])
    items, _ = read_examples([{"path": str(path)}], "prompts")
    assert all(isinstance(i, PromptItem) for i in items)
    test_item, prompt, conv = sorted(items, key=lambda i: int(i.origin.rsplit(":", 1)[1]))
    assert test_item.prompt[-1] == {"role": "user", "content": "Hi?"} and test_item.rule == rule
    assert test_item.reference == "Aye." and test_item.task == "role_related_mrc_answer_with_narration"
    assert prompt.columns() == {"persona": "x", "task": None, "rule": [rule, {"type": "all_caps"}], "reference": None}
    assert [m["content"] for m in conv.prompt] == ["a", "b", "c"] and conv.reference == "d"
    assert conv.origin == f"{path}:3"


def test_bad_records_name_file_line_and_field(tmp_path):
    path = _write(tmp_path, [
        {"prompt": [{"role": "user", "content": "ok"}]},
        {"prompt": [{"role": "user", "content": "ok"}], "rule": {"kind": "no_commas"}},
        {"conversations": [{"role": "user", "content": "a"}]},
        {"text": "nothing usable"},
        "not json",
    ])
    with pytest.raises(DataError) as err:
        read_examples([{"path": str(path)}], "prompts")
    msg = str(err.value)
    assert f"{path}:2: field 'rule'" in msg
    assert f"{path}:3: conversations: last message must be assistant" in msg
    assert f"{path}:4: a prompt record needs 'question'" in msg
    assert f"{path}:5:" in msg
    items, report = read_examples([{"path": str(path)}], "prompts", on_error="skip")
    assert len(items) == 1 and report.skipped[str(path)] == 4


def test_sample_test_items_read_as_prompts():
    items, _ = read_examples([{"path": str(asset("sample/test.jsonl"))}], "prompts")
    assert len(items) == 54 and sum(i.rule is not None for i in items) == 12
