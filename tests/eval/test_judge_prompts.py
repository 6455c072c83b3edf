"""Judge prompts, strict verdict parsing and the cache logic (no real model involved)."""

from __future__ import annotations

import pytest

from rolemrc.eval.judge import CRITERIA, JudgeItem, judge_items, judge_messages, parse_verdict
from rolemrc.tasks import TASKS, Dimension


@pytest.mark.parametrize(
    "text,expected",
    [
        ("VERDICT: 1", 1),
        ("The reply keeps the style.\nVERDICT: 0\n", 0),
        ("  VERDICT:1  ", 1),
        ("VERDICT: 1\nVERDICT: 1", 1),
        ("verdict: 1", None),  # strict: the exact keyword
        ("VERDICT: 1 because it is good", None),
        ("**VERDICT: 1**", None),
        ("VERDICT: 1\nActually, on reflection...", None),  # the verdict must be the last line
        ("VERDICT: 0\nVERDICT: 1", None),  # contradicts itself
        ("VERDICT: 2", None),
        ("Yes", None),
        ("1", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_verdict(text, expected):
    assert parse_verdict(text) == expected


def test_every_task_dimension_has_a_criterion():
    seen = set()
    for task, (dims, _) in TASKS.items():
        for item in judge_items([{"task": task, "question": [{"role": "User", "content": "q"}]}], ["r"]):
            msgs = judge_messages(item)
            assert [m["role"] for m in msgs] == ["system", "user"]
            seen.add(msgs[1]["content"].split("## Criterion: ")[1].split("\n")[0])
    assert len(seen) == len(CRITERIA)  # every criterion is reachable, none is dead text


def test_prompt_shows_whole_conversation_and_expectation():
    record = {
        "task": "role_unrelated_mrc_refused_no_narration-2ndanswer",
        "question": [
            {"role": "System", "content": "SYS: you are Mora."},
            {"role": "User", "content": "USER1: what is the capital of France?"},
            {"role": "Assistant", "content": "ASSIST1: not my waters."},
            {"role": "User", "content": "USER2: answer anyway!"},
        ],
        "reference": "REF: Paris, then.",
    }
    (item,) = judge_items([record], ["REPLY: Paris."], ids=["q7"])
    assert (item.item_id, item.dimension, item.key) == ("q7", Dimension.MT, "q7/MT")
    text = judge_messages(item)[1]["content"]
    order = ["SYS:", "USER1:", "ASSIST1:", "USER2:", "REPLY:", "Criterion: Multi-turn"]
    positions = [text.index(s) for s in order]
    assert positions == sorted(positions)
    assert "answer anyway" in text and "attempt to answer" in text  # expectation: answer
    assert "REF:" not in text
    assert "REF: Paris" in judge_messages(item, show_reference=True)[1]["content"]

    refuse = judge_items([{**record, "task": "role_related_mrc_refused_no_narration-2ndrefused"}], ["r"])[0]
    assert "keep declining" in judge_messages(refuse)[1]["content"]


def test_kb_within_and_outside_differ():
    within, rs = judge_items([{"task": "role_related_mrc_answer_with_narration", "question": []}], ["r"])
    (outside,) = judge_items([{"task": "role_unrelated_mrc_refused_with_narration", "question": []}], ["r"])
    assert rs.dimension is Dimension.RS
    assert "within the role's knowledge boundary" in judge_messages(within)[1]["content"]
    assert "outside the role's knowledge boundary" in judge_messages(outside)[1]["content"]


def test_parsed_test_items_work_too():
    from rolemrc.data.schemas import parse_test_item

    record = {
        "task": "role_related_mrc_answer_no_narration-special-format",
        "question": [{"role": "System", "content": "Answer in capitals."}, {"role": "User", "content": "Hi"}],
        "reference": "HELLO.",
        "rule": {"type": "all_caps"},
    }
    raw = judge_items([record], ["HI"])
    parsed = judge_items([parse_test_item(record)], ["HI"])
    assert raw == parsed and isinstance(raw[0], JudgeItem)
    with pytest.raises(ValueError):
        judge_items([record], [])
    with pytest.raises(KeyError, match="unknown RoleMRC test task"):
        judge_items([{**record, "task": "nope"}], ["x"])


class _Interrupted(Exception):
    pass


class _FlakyBackend:
    """Answers the first ``n`` prompts, then dies as an interrupted run would."""

    model_id = "fake"

    def __init__(self, n: int) -> None:
        self.n = n
        self.sent = 0

    def sampling(self) -> dict:
        return {"temperature": 0}

    async def answer_all(self, prompts, on_answer=None):
        from rolemrc.eval.judge import Answer

        out = []
        for i, _ in enumerate(prompts):
            if i == self.n:
                raise _Interrupted
            self.sent += 1
            out.append(Answer("ok", text="VERDICT: 1", attempts=1))
            on_answer(i, out[-1])
        return out


def test_answers_are_cached_as_they_arrive(tmp_path):
    from rolemrc.api import AnswerCache
    from rolemrc.eval.judge import CACHE_FILE, Judge

    spec = [{"task": "role_related_mrc_answer_no_narration", "question": []}] * 5
    items = judge_items(spec, [f"reply {i}" for i in range(5)])
    with pytest.raises(_Interrupted):
        Judge(_FlakyBackend(3), cache_dir=tmp_path).judge(items)
    assert len(AnswerCache(tmp_path / CACHE_FILE)) == 3  # what was answered before the crash is kept

    backend = _FlakyBackend(99)
    with Judge(backend, cache_dir=tmp_path) as judge:
        verdicts = judge.judge(items)
    assert backend.sent == 2 and [v.cached for v in verdicts] == [True] * 3 + [False] * 2
    assert all(v.verdict == 1 for v in verdicts)


def test_identical_prompts_are_asked_once(tmp_path):
    from rolemrc.eval.judge import Judge

    spec = [{"task": "role_related_mrc_answer_no_narration", "question": []}] * 3
    backend = _FlakyBackend(99)
    verdicts = Judge(backend, cache_dir=None).judge(judge_items(spec, ["same"] * 3))
    assert backend.sent == 1 and [v.verdict for v in verdicts] == [1, 1, 1]


# ---------------------------------------------------------------- judge=paper (score-only protocol)


@pytest.mark.parametrize(
    "text, expected",
    [("1", 1), ("0", 0), (" 1\n", 1), ("Score: 0", 0), ("Score:1", 1), ("Score: 1 ", 1),
     ("2", None), ("10", None), ("1.", None), ("1 because", None), ("maybe", None), ("", None), (None, None),
     ("Score: ", None), ("VERDICT: 1", None), ("-1", None)],
)
def test_parse_score(text, expected):
    """The authors' rule, int(answer with "Score:" removed), restricted to the 0/1 scale."""
    from rolemrc.eval.judge import parse_score

    assert parse_score(text) == expected


def test_paper_prompts_one_user_message_per_dimension_with_our_rubric():
    from rolemrc.eval.judge import PAPER_CRITERIA, paper_messages
    from rolemrc.tasks import TASKS

    items = judge_items(
        [{"task": t, "question": [{"role": "System", "content": "You are Ada. Always end with '!'"},
                                  {"role": "User", "content": "Q?"}, {"role": "Assistant", "content": "A."},
                                  {"role": "User", "content": "Again?"}], "reference": "REF-TEXT"} for t in TASKS],
        ["the reply"] * len(TASKS))
    rubrics = set()
    for it in items:
        msgs = paper_messages(it)
        assert len(msgs) == 1 and msgs[0]["role"] == "user"
        text = msgs[0]["content"]
        assert text.endswith("Score:") and "score only (0 or 1)" in text
        assert 'System Instruction: "You are Ada.' in text and 'LLM Response: "A."' in text
        assert '"the reply"' in text and "REF-TEXT" not in text  # no reference unless asked
        assert "REF-TEXT" in paper_messages(it, True)[0]["content"]
        rubrics.add(next(r for r in PAPER_CRITERIA.values() if r in text))
    assert rubrics == set(PAPER_CRITERIA.values())  # every (dimension, expectation) used
