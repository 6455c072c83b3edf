"""Nested rules: sampling from the packaged pool, checks, and repairs."""

from __future__ import annotations

import random

import pytest

from rolemrc.synth import rules
from rolemrc.synth.assets import Assets
from rolemrc.synth.records import RULE_PARAMS

CASES = [
    ({"type": "starts_with_emoji", "_extra": {"emoji": "⚓"}}, "Fair winds, friend.", "⚓ Fair winds, friend."),
    ({"type": "all_caps"}, "(smiles) Fair winds.", "(SMILES) FAIR WINDS."),
    ({"type": "ends_with_punctuation", "char": "!"}, "Fair winds, friend...", "Fair winds, friend!"),
    ({"type": "ends_with_punctuation", "char": "?"}, "Hello. Fair winds! Mind the 3.5 knots.", "Hello? Fair winds? Mind the 3.5 knots?"),
    ({"type": "ends_with_punctuation", "char": "~"}, "Hello. Fair winds!", "Hello. Fair winds~"),
    ({"type": "max_words", "n": 3}, "one two three, four five", "one two three"),
    ({"type": "forbidden_char", "char": "z"}, "Zebras graze lazily.", "ebras grae laily."),
    ({"type": "no_commas"}, "Well, friend, yes.", "Well friend yes."),
]


@pytest.mark.parametrize("rule,text,fixed", CASES)
def test_check_and_repair(rule: dict, text: str, fixed: str) -> None:
    assert not rules.check(rule, text)
    assert rules.repair(rule, text) == fixed
    assert rules.check(rule, fixed)


def test_packaged_pool_samples_both_kinds_with_test_shapes() -> None:
    pool = Assets().rules
    rng = random.Random(0)
    seen = set()
    for _ in range(200):
        for kind in ("format", "content"):
            rule, text = rules.sample(pool, kind, rng)
            public = rules.public(rule)
            assert set(public) == {"type", *RULE_PARAMS[public["type"]]}
            assert "$" not in text and text.strip()
            seen.add((kind, public["type"]))
    assert {t for _, t in seen} == set(RULE_PARAMS)


def test_bad_pool_entry_names_its_position() -> None:
    bad = [{"type": "max_words", "kind": "content", "phrasings": ["At most $n words."], "params": {"n": []}}]
    with pytest.raises(ValueError, match=r"rules\[0\]\.params\.n"):
        rules.parse_pool(bad, "rules.yaml")
    with pytest.raises(ValueError, match=r"rules\[0\]\.type"):
        rules.parse_pool([{"type": "shout", "kind": "format", "phrasings": ["x"]}], "rules.yaml")
