"""Role-play rewards: the verifier, dotted-path callables, weighted combination, metrics, alarms."""

from __future__ import annotations

import math

import pytest
import torch

from rolemrc.eval.verifiers import verify
from rolemrc.objectives.grpo import group_advantages
from rolemrc.rewards import RewardSet, VerifierReward, build_rewards, disagreement_rate, load_target
from tests.rewards import helpers

CAPS = {"type": "all_caps"}
NO_COMMA = {"type": "no_commas"}
PROMPT = [{"role": "System", "content": "You are Ada."}, {"role": "User", "content": "Hi"}]


def test_verifier_all_or_fraction_and_none_without_rule():
    completions = ["HELLO, SAILOR", "HELLO SAILOR", "hello sailor", "anything"]
    rules = [[CAPS, NO_COMMA], [CAPS, NO_COMMA], CAPS, None]
    got_all = VerifierReward("all")(prompts=[PROMPT] * 4, completions=completions, rule=rules)
    got_frac = VerifierReward("fraction")(prompts=[PROMPT] * 4, completions=completions, rule=rules)
    assert got_all == [0.0, 1.0, 0.0, None]
    assert got_frac == [0.5, 1.0, 0.0, None]
    # the same checks evaluate.py uses
    assert got_all[2] == float(verify(CAPS, completions[2]))


def test_verifier_refuses_an_unknown_rule_type():
    with pytest.raises(ValueError, match=r"completion 1: rule .*'shout'.* known: starts_with_emoji"):
        VerifierReward()(prompts=[PROMPT] * 2, completions=["a", "b"], rule=[CAPS, {"type": "shout"}])
    with pytest.raises(ValueError, match="verifier mode must be one of all, fraction"):
        VerifierReward("most")


def test_weighted_sum_metrics_and_unscorable_completions():
    """TRL's sum_then_normalize: weighted nansum over the rewards that apply; a completion no reward
    applies to is NaN (advantage 0), never 0; means are over the completions a reward applies to."""
    rs = build_rewards({"rules": {"type": "verifier"},
                        "words": {"_target_": "tests.rewards.helpers.length_reward", "weight": 0.5, "scale": 2.0}})
    completions = ["HELLO THERE", "hello there friend", "", "QUIET"]
    out = rs([PROMPT] * 4, completions, {"rule": [CAPS, CAPS, None, None]})
    assert out.names == ["rules", "words"]
    torch.testing.assert_close(out.per_reward, torch.tensor([[1.0, 4.0], [0.0, 6.0], [math.nan, math.nan],
                                                             [math.nan, 2.0]], dtype=torch.float64), equal_nan=True)
    torch.testing.assert_close(out.rewards, torch.tensor([3.0, 3.0, math.nan, 1.0], dtype=torch.float64),
                               equal_nan=True)
    m = out.metrics
    assert m["rewards/rules/mean"] == 0.5 and m["rewards/rules/std"] == pytest.approx(math.sqrt(0.5))
    assert m["rewards/words/mean"] == pytest.approx(4.0)
    assert m["reward"] == pytest.approx(7 / 3) and m["reward_std"] == pytest.approx(torch.tensor([3.0, 3, 1]).std())
    assert not any(k.startswith("rewards/disagreement") for k in m)  # no judge in this set
    adv = group_advantages(out.rewards, 2).advantages
    assert adv[2] == 0 and adv[0] == adv[1] == 0  # equal rewards: nothing to learn; unscorable: 0


def test_dotted_path_callable_gets_trls_signature():
    helpers.seen_columns.calls.clear()
    rs = build_rewards({"spy": {"_target_": "tests.rewards.helpers.seen_columns"}})
    rs([PROMPT], ["hi"], {"task": ["t"], "rule": [None], "reference": ["r"]})
    (call,) = helpers.seen_columns.calls
    assert call == {"prompts": [PROMPT], "completions": ["hi"], "task": ["t"], "rule": [None], "reference": ["r"]}


@pytest.mark.parametrize("spec,match", [
    ({"x": {"type": "bleu"}}, r"rewards.x.type must be one of verifier, judge"),
    ({"x": {"type": "verifier", "mdoe": "all"}}, r"unknown key\(s\) rewards.x.mdoe"),
    ({"x": {"type": "judge"}}, r"rewards.x.judge is required"),
    ({"x": {"_target_": "tests.rewards.helpers.nope"}}, r"rewards.x._target_=.*has no attribute 'nope'"),
    ({"x": {"_target_": "no_such_pkg_xyz.fn"}}, r"no importable module"),
    ({"x": {"_target_": "tests.rewards.helpers.seen_columns", "type": "verifier"}}, "either type or _target_"),
])
def test_bad_specs_name_the_key(spec, match):
    with pytest.raises(ValueError, match=match):
        build_rewards(spec)
    with pytest.raises(ValueError, match=match.replace("rewards.x", "objective.rewards.x")):  # as GRPO names them
        build_rewards(spec, prefix="objective.rewards")


def test_a_reward_returning_garbage_is_refused():
    """Anything but one finite number (or None / NaN: does not apply) per completion stops with one
    line naming the reward, its callable and what it returned; numpy / torch numbers are numbers."""
    import numpy as np

    from rolemrc.rewards import RewardValueError

    def run(fn, n=1):
        return RewardSet({"bad": fn})([PROMPT] * n, ["x"] * n)

    for fn, match in [
        (lambda **kw: ["high"], r"reward 'bad' \(tests.rewards.test_rewards.*<lambda>\) returned 'high' \(str\) "
                                r"for completion 0 of 1; expected a float, or None"),
        (lambda **kw: [1.0, 1.0], r"returned 2 values for 1 completions; expected a list of 1 values"),
        (lambda **kw: "0.5", r"returned '0.5' \(str\); expected a list of 1 values"),
        (lambda **kw: 0.5, r"returned 0.5 \(float\); expected a list"),
        (lambda **kw: None, r"returned None \(NoneType\); expected a list"),
        (lambda **kw: [float("inf")], r"returned inf for completion 0 of 1: a reward must be finite"),
        (lambda **kw: [0.0, -math.inf], r"returned -inf for completion 1 of 2: a reward must be finite"),
    ]:
        with pytest.raises(RewardValueError, match=match):
            run(fn, 2 if "of 2" in match else 1)
    named = build_rewards({"odd": {"_target_": "tests.rewards.helpers.bad_reward", "returns": "short"}})
    with pytest.raises(RewardValueError, match=r"reward 'odd' \(tests.rewards.helpers.bad_reward\) returned 0 values "
                                               r"for 2 completions"):
        named([PROMPT] * 2, ["x", "y"])
    out = run(lambda **kw: [np.float32(0.5), None, float("nan"), torch.tensor(1.0).item(), True], 5)
    got = out.per_reward[:, 0].tolist()
    assert got[0] == 0.5 and math.isnan(got[1]) and math.isnan(got[2]) and got[3:] == [1.0, 1.0]
    assert run(lambda **kw: np.array([0.25]), 1).rewards.tolist() == [0.25]  # an array, as a list
    with pytest.raises(ValueError, match="weights for unknown reward"):
        RewardSet({"a": lambda **kw: [1.0]}, {"b": 2.0})


def test_load_target_resolves_class_attributes():
    assert load_target("rolemrc.rewards.VerifierReward") is VerifierReward
    assert load_target("tests.rewards.helpers.length_reward") is helpers.length_reward


def test_disagreement_rate_counts_only_completions_both_scored():
    judge = [1.0, 1.0, 0.0, None, 1.0]
    verifier = [1.0, 0.0, 0.0, 1.0, 0.5]  # 0.5: half the rules met -> not met
    assert disagreement_rate(judge, verifier) == (0.5, 4)
    assert disagreement_rate([None], [1.0]) == (None, 0)
