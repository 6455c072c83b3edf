"""The shipped rule-bearing RL prompts (assets/sample/rl.jsonl, data=sample_rl) and data=rolemrc_rl:
every record parses as a prompt, carries a rule the verifier knows, and the configs name them."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from omegaconf import OmegaConf

from rolemrc import asset
from rolemrc.data.readers import read_examples
from rolemrc.eval.verifiers import RULE_TYPES, verify
from rolemrc.rewards import VerifierReward
from rolemrc.tasks import TASKS, Dimension
from tests.conftest import compose_train


@pytest.fixture(scope="module")
def items():
    got, report = read_examples([{"path": asset("sample/rl.jsonl")}], "prompts")
    assert sum(report.skipped.values()) == 0
    return got


def test_every_sample_record_parses_with_a_known_rule(items):
    with open(asset("sample/rl.jsonl"), encoding="utf-8") as f:
        n_lines = sum(1 for line in f if line.strip())
    assert len(items) == n_lines >= 36
    types = Counter()
    for it in items:
        assert it.prompt[0]["role"] == "system" and it.prompt[-1]["role"] == "user"
        rules = it.rule if isinstance(it.rule, list) else [it.rule]
        for r in rules:
            assert r["type"] in RULE_TYPES, it.origin
            verify(r, "a reply")  # its parameters are there (a missing one is a ValueError)
            types[r["type"]] += 1
        # the rule is stated in the system prompt, as RoleMRC nests it
        assert "Extra rule for every reply:" in it.prompt[0]["content"], it.origin
        assert it.task in TASKS and TASKS[it.task][0] == (Dimension.NI,), it.origin
    assert set(types) == set(RULE_TYPES)  # every verifier rule type appears at least once
    # the rules a small model meets some of the time make up most of the file (the demo's signal)
    assert types["max_words"] + types["no_commas"] + types["forbidden_char"] >= 0.8 * len(items)


def test_the_verifier_scores_the_sample_prompts(items):
    cols = [it.columns() for it in items]
    got = VerifierReward()(prompts=[it.prompt for it in items], completions=["Hi there friend"] * len(items),
                           rule=[c["rule"] for c in cols])
    assert None not in got and 0 < sum(got) < len(got)  # every prompt scored; the reply meets some rules only


def test_sample_rl_config_reads_the_file():
    cfg = compose_train(["data=sample_rl"])
    sources = OmegaConf.to_container(cfg.data.prompts, resolve=True)
    assert [s["path"] for s in sources] == [asset("sample/rl.jsonl")]
    got, _ = read_examples(sources, "prompts")
    assert len(got) >= 36 and 0 < cfg.data.val_fraction < 1


def test_rolemrc_rl_uses_the_rolemrc_files():
    """The hub id and file names conf/data/rolemrc.yaml reads: the SFT mix as prompts, the test items
    as the test set only (a GRPO run's test scores are on items it never sampled for)."""
    rl = OmegaConf.to_container(compose_train(["data=rolemrc_rl"]).data, resolve=True)
    base = OmegaConf.to_container(compose_train(["data=rolemrc"]).data, resolve=True)
    assert [(s["path"], s["data_files"]) for s in rl["prompts"]] == [
        (base["sft"][0]["path"], base["sft"][0]["data_files"])]
    assert rl["test"] == base["test"]
    assert [(s["path"], s["data_files"]) for s in rl["prompts_val"]] == [
        (base["pairs_val"][0]["path"], base["pairs_val"][0]["data_files"])]
    assert rl["max_prompt_length"] == base["max_prompt_length"]


@pytest.mark.parametrize("record", [
    # the three shapes data=rolemrc_rl reads, as RoleMRC writes them (capitalised roles)
    {"task": "role_related_mrc_answer_no_narration-special-format", "rule": {"type": "no_commas"},
     "question": [{"role": "System", "content": "You are Ada."}, {"role": "User", "content": "Hi?"}], "reference": "Hello."},
    {"conversations": [{"role": "System", "content": "You are Ada."}, {"role": "User", "content": "Hi?"},
                       {"role": "Assistant", "content": "Hello."}]},
    {"prompt": [{"role": "System", "content": "You are Ada."}, {"role": "User", "content": "Hi?"}],
     "chosen": "Hello.", "rejected": "hi"},
])
def test_rolemrc_shaped_records_become_prompts(tmp_path, record):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(record) + "\n", encoding="utf-8")
    (item,), _ = read_examples([{"path": str(path)}], "prompts")
    assert [m["role"] for m in item.prompt] == ["system", "user"]
    assert item.reference == ("Hello." if "chosen" not in record else None)
