"""NI rule verifiers, judge-vs-verifier agreement, and the shipped sample test items."""

from __future__ import annotations

import json

import pytest

from rolemrc import ASSETS
from rolemrc.eval.judge import Verdict, judge_items
from rolemrc.eval.verifiers import RULE_TYPES, agreement, verify, verify_all, verify_item
from rolemrc.tasks import NI, TASKS

CASES = [
    ({"type": "starts_with_emoji"}, "🌊 Arr, the tide!", True),
    ({"type": "starts_with_emoji"}, "  ⭐ Star of the sea", True),
    ({"type": "starts_with_emoji"}, "1\ufe0f\u20e3 First, the ropes", True),
    ({"type": "starts_with_emoji"}, "(She smiles) 🌊 Arr", False),
    ({"type": "starts_with_emoji"}, "Arr 🌊", False),
    ({"type": "starts_with_emoji"}, "", False),
    ({"type": "all_caps"}, "(SHE NODS) ARR, 1820!", True),
    ({"type": "all_caps"}, "ARR, 1820 it was", False),
    ({"type": "all_caps"}, "1820!", False),  # no letter at all is not "all caps"
    ({"type": "ends_with_punctuation", "char": "!"}, "Arr! The tide turns!  ", True),
    ({"type": "ends_with_punctuation", "char": "!"}, "Arr. The tide turns!", False),
    ({"type": "ends_with_punctuation", "char": "!"}, "Arr! The tide turns", False),
    ({"type": "ends_with_punctuation", "char": "!"}, "It is 3.5 knots!", True),  # a decimal point is no sentence end
    ({"type": "max_words", "n": 3}, "one two  three", True),
    ({"type": "max_words", "n": 3}, "one two three four", False),
    ({"type": "max_words", "value": 1}, "one", True),
    ({"type": "forbidden_char", "char": "z"}, "Arr, the sea", True),
    ({"type": "forbidden_char", "char": "z"}, "Zounds!", False),  # any case
    ({"type": "forbidden_char", "char": "z", "case_sensitive": True}, "Zounds!", True),
    ({"type": "no_commas"}, "Arr the sea", True),
    ({"type": "no_commas"}, "Arr, the sea", False),
    ({"type": "no_commas"}, "Arr\uff0cthe sea", False),
    ({"type": "includes_word", "word": "truly"}, "I TRULY hope so.", True),
    ({"type": "includes_word", "word": "truly"}, "Untruly spoken.", False),  # whole word only
]


@pytest.mark.parametrize("rule,reply,expected", CASES)
def test_rules(rule, reply, expected):
    assert verify(rule, reply) is expected


def test_every_rule_type_is_covered_and_errors_are_clear():
    assert {c[0]["type"] for c in CASES} == set(RULE_TYPES)
    with pytest.raises(ValueError, match="unknown rule type"):
        verify({"type": "rhymes"}, "x")
    with pytest.raises(ValueError, match="'n'"):
        verify({"type": "max_words"}, "x")
    assert verify_item({"task": "t"}, "x") is None


def _v(item_id: str, verdict: int | None, status: str = "ok", dim: str = "NI") -> Verdict:
    return Verdict(item_id, "task", dim, verdict, status, raw="", attempts=1)


def test_agreement():
    verifier = {"a": True, "b": False, "c": True, "d": False, "e": True}
    verdicts = [
        _v("a", 1),  # agree
        _v("b", 1),  # judge too lenient
        _v("c", 0),  # judge too strict
        _v("d", 0),  # agree
        _v("e", None, "unparseable"),  # no usable verdict: not counted either way
        _v("a", 0, dim="KB"),  # other dimension: ignored
        _v("z", 1),  # no rule: ignored
    ]
    ag = agreement(verdicts, verifier)
    assert (ag.n, ag.n_agree, ag.rate, ag.n_without_verdict) == (4, 2, 0.5, 1)
    assert ag.confusion == {"judge1_verifier1": 1, "judge1_verifier0": 1, "judge0_verifier1": 1, "judge0_verifier0": 1}
    assert agreement([], verifier).rate is None


def test_sample_test_items():
    """The shipped sample test set: known tasks, well-formed rules, references obey them."""
    path = ASSETS / "sample" / "test.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not generated yet")
    items = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert {it["task"] for it in items} <= set(TASKS)
    references = [it["reference"] for it in items]
    passed = verify_all(items, references)
    ni_items = [str(i) for i, it in enumerate(items) if NI in TASKS[it["task"]][0]]
    assert passed and set(passed) <= set(ni_items)
    assert all(passed.values()), {k: items[int(k)]["rule"] for k, ok in passed.items() if not ok}
    # Breaking each reference breaks its rule.
    broken = verify_all(items, [r.lower() + ", zx " + "word " * 50 + "." for r in references])
    for k, ok in broken.items():
        if items[int(k)]["rule"]["type"] not in ("starts_with_emoji", "includes_word"):
            assert not ok, items[int(k)]["rule"]
    assert len(judge_items(items, references)) >= len(items)
