"""The judge reward through rolemrc's judge client against the loopback fake server
(tests/eval/conftest.py's JudgeServer: ``[[good]]`` in the reply -> VERDICT: 1, ``[[down]]`` -> 503)."""

from __future__ import annotations

import math

import pytest

from rolemrc.rewards import JudgeReward, JudgeRewardError, build_rewards
from tests.eval.conftest import JudgeServer

NI_TASK = "role_related_mrc_answer_no_narration-special-format"  # judged on NI only
KB_RS_TASK = "role_related_mrc_answer_with_narration"  # judged on KB and RS
PROMPT = [{"role": "System", "content": "You are Ada. Always answer in capital letters."},
          {"role": "User", "content": "Where is the lamp?"}]


def _judge_cfg(server: JudgeServer, key_env: str) -> dict:
    return {"backend": "openai", "model": "fake-judge", "base_url": server.base_url, "api_key_env": key_env,
            "timeout_s": 2.5, "backoff_s": 0.01, "max_backoff_s": 0.05, "max_attempts": 2}


def test_verdicts_become_rewards_per_task_dimension_and_come_from_the_cache_again(tmp_path, api_key_env):
    with JudgeServer(api_key=api_key_env[1]) as server:
        reward = JudgeReward(_judge_cfg(server, api_key_env[0]), cache_dir=tmp_path)
        completions = ["IN THE TOWER [[good]]", "in the tower", "AYE [[good]]"]
        kw = dict(prompts=[PROMPT] * 3, completions=completions, task=[NI_TASK, NI_TASK, KB_RS_TASK],
                  reference=["IN THE TOWER"] * 3)
        assert reward(**kw) == [1.0, 0.0, 1.0]
        assert server.requests == 4  # one NI judgement each for the first two, KB and RS for the third
        assert reward(**kw) == [1.0, 0.0, 1.0] and server.requests == 4  # the cache answers
        ni_only = JudgeReward(_judge_cfg(server, api_key_env[0]), cache_dir=tmp_path, dimension="NI")
        assert ni_only(**kw) == [1.0, 0.0, None]  # the KB/RS task has no NI verdict: not applicable, not 0


def test_a_server_down_stops_the_step_instead_of_scoring_zero(tmp_path, api_key_env):
    with JudgeServer(api_key=api_key_env[1]) as server:
        reward = JudgeReward(_judge_cfg(server, api_key_env[0]), cache_dir=tmp_path)
        with pytest.raises(JudgeRewardError, match=r"1 of 2 judgements have no verdict \(1 failed\)") as err:
            reward(prompts=[PROMPT] * 2, completions=["OK [[good]]", "OK [[down]]"], task=[NI_TASK] * 2)
        assert server.fault_counts["unavailable"] == 2  # the judge client retried (max_attempts=2) before failing
        assert "on_failure=wait asks again" in str(err.value) and "wait(s)" not in str(err.value)
        # an answer without a verdict: said once, in one line, with the reward's key
        rewards = build_rewards({"critic": {"type": "judge", "judge": _judge_cfg(server, api_key_env[0])}},
                                cache_dir=tmp_path)
        with pytest.raises(JudgeRewardError) as err:
            rewards([PROMPT], ["OK [[garbage]]"], {"task": [NI_TASK]})
    msg = str(err.value)
    assert msg == ("rewards.critic: 1 of 1 judgements have no verdict (1 unparseable): rejected: no_verdict: the "
                   "answer holds no verdict. The step is not scored; rewards.critic.on_failure=wait asks again for "
                   "the missing ones, skip leaves them unscored")


def test_wait_asks_again_only_for_the_missing_verdicts(tmp_path, api_key_env):
    down_first = lambda req: "unavailable" if req.index <= 3 else None  # noqa: E731
    with JudgeServer(api_key=api_key_env[1], faults=down_first) as server:
        reward = JudgeReward(_judge_cfg(server, api_key_env[0]), cache_dir=tmp_path, on_failure="wait",
                             wait_s=0.01, max_waits=3)
        got = reward(prompts=[PROMPT] * 2, completions=["A [[good]]", "B [[good]]"], task=[NI_TASK] * 2)
        assert got == [1.0, 1.0]
        assert server.fault_counts["unavailable"] == 3 and sum(server.served.values()) == 2
    with JudgeServer(api_key=api_key_env[1]) as server:  # never back: raises after max_waits
        reward = JudgeReward(_judge_cfg(server, api_key_env[0]), cache_dir=tmp_path / "2", on_failure="wait",
                             wait_s=0.01, max_waits=2)
        with pytest.raises(JudgeRewardError, match="after 2 wait"):
            reward(prompts=[PROMPT], completions=["C [[down]]"], task=[NI_TASK])
        assert server.fault_counts["unavailable"] == 6  # 3 rounds x 2 attempts


def test_skip_leaves_the_completion_unscored_and_counts_it_and_the_alarm_is_logged(tmp_path, api_key_env):
    with JudgeServer(api_key=api_key_env[1]) as server:
        rewards = build_rewards({
            "judge": {"type": "judge", "judge": _judge_cfg(server, api_key_env[0]), "on_failure": "skip"},
            "rules": {"type": "verifier", "weight": 2.0}}, cache_dir=tmp_path)
        rule = {"type": "no_commas"}
        completions = ["Fine [[good]]", "Fine, thanks [[good]]", "Fine, no", "Lost [[down]]"]
        out = rewards([PROMPT] * 4, completions, {"task": [NI_TASK] * 4, "rule": [rule] * 4})
        assert rewards.rewards["judge"].last_missing == {"failed": 1}
        judge_col = out.per_reward[:, 0].tolist()
        assert judge_col[:3] == [1.0, 1.0, 0.0] and math.isnan(judge_col[3])
        assert out.rewards.tolist() == [3.0, 1.0, 0.0, 2.0]  # the lost verdict adds nothing, it is not a 0 verdict
        # the judge says "met" for the reply with a comma: 1 disagreement in 3 scored by both
        assert out.metrics["rewards/disagreement/judge_vs_rules"] == pytest.approx(1 / 3)
        assert out.metrics["rewards/judge/mean"] == pytest.approx(2 / 3)
        assert out.metrics["rewards/judge/missing"] == 1.0 and "rewards/rules/missing" not in out.metrics
        rewards.close()


def test_bad_judge_settings():
    with pytest.raises(ValueError, match="on_failure must be one of raise, wait, skip"):
        JudgeReward({"backend": "none"}, on_failure="zero")
    with pytest.raises(ValueError, match="needs a judge backend"):
        JudgeReward({"backend": "none"})
    with pytest.raises(ValueError, match="unknown judge dimension 'XX'"):
        JudgeReward({"backend": "none"}, dimension="XX")
