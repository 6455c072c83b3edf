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


def test_dialogue_seeds_from_rolemrc_and_rolebench_through_the_store(tmp_path):
    """data=rolemrc_dialogues_sample: RoleMRC dialogues (format: dialogue) and RoleBench rows (format:
    rolebench) become prompt rows in the store, each with its later user turns (which env=scripted
    replays) and the dialogue's replies as per-turn references."""
    from transformers import AutoTokenizer

    from rolemrc.data.datamodule import ChatDataModule
    from rolemrc.data.templates import ChatFormat
    from rolemrc.env import ScriptedEnv
    from tests.conftest import compose_train

    cfg = compose_train(["data=rolemrc_dialogues_sample", f"data.cache_dir={tmp_path / 'cache'}"]).data
    chat = ChatFormat(AutoTokenizer.from_pretrained(asset("tokenizers/tiny-llama3")))
    dm = ChatDataModule(cfg, "prompts", chat)
    dm.setup()
    rows = list(dm.train_rows)
    assert dm.store is not None  # read through the store, as every prompt row
    lines = [json.loads(x) for x in open(asset("sample/rolemrc_dialogues.jsonl"), encoding="utf-8")]
    dialogues = [r for r in rows if r["columns"]["task"] != "rolebench"]
    rolebench = [r for r in rows if r["columns"]["task"] == "rolebench"]
    assert len(dialogues) == len(lines) == 6 and len(rolebench) == 4
    by_first = {r["messages"][-1]["content"]: r for r in dialogues}
    for record in lines:
        conv = [{"role": m["role"].lower(), "content": m["content"]} for m in record["conversations"]]
        first = next(i for i, m in enumerate(conv) if m["role"] == "user")
        row = by_first[conv[first]["content"]]
        assert row["messages"] == conv[:first + 1]  # system (+ the role's own opening) + the first user turn
        assert row["columns"]["user_turns"] == [m["content"] for m in conv[first + 1:] if m["role"] == "user"]
        assert row["columns"]["reference_turns"] == [m["content"] for m in conv[first + 1:] if m["role"] == "assistant"]
        assert row["columns"]["reference"] == row["columns"]["reference_turns"][0]
        assert row["columns"]["task"] == record["task"]
        assert row["columns"].get("user_persona") == record.get("user_persona")  # other fields kept
        assert row["prompt_ids"] == chat.encode_prompt(row["messages"])
        episode = ScriptedEnv().reset(row)  # the scripted user replays the dialogue's own later turns
        said = [episode.step([], "r").user for _ in row["columns"]["user_turns"]]
        assert said == row["columns"]["user_turns"] and episode.step([], "r").reason == "script_end"
    role_first = [r for r in dialogues if r["messages"][1]["role"] == "assistant"]
    assert len(role_first) == 2
    for row in rolebench:
        assert [m["role"] for m in row["messages"]] == ["system", "user"] and row["columns"]["reference"]
        assert "user_turns" not in row["columns"]  # a one-turn seed: a simulated user goes on from it


def test_bad_dialogue_records_name_file_line_and_field(tmp_path):
    sys_msg, user, asst = ({"role": r, "content": "x"} for r in ("System", "User", "Assistant"))
    path = _write(tmp_path, [
        {"conversations": [sys_msg, user, asst, user, asst]},
        {"conversations": [sys_msg, asst]},
        {"conversations": [sys_msg, user, asst], "user_turns": ["again"]},
        {"conversations": [sys_msg, user, user]},
        {"messages": [{"role": "Narrator", "content": "x"}]},
    ])
    with pytest.raises(DataError) as err:
        read_examples([{"path": str(path), "format": "dialogue"}], "prompts")
    msg = str(err.value)
    assert "4 invalid prompts record(s)" in msg
    assert f"{path}:2: conversations: no User turn" in msg
    assert f"{path}:3: field 'user_turns': a dialogue's turns come from 'conversations'" in msg
    assert f"{path}:4: conversations[2]: two user turns in a row" in msg
    assert f"{path}:5: messages[0].role: unknown role 'Narrator'" in msg
    with pytest.raises(ValueError, match="format 'dialogue' is not readable as sft data"):
        read_examples([{"path": str(path), "format": "dialogue"}], "sft")
