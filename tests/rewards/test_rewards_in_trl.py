"""rolemrc's rewards used as TRL 1.16 reward functions: TRL's own ``GRPOTrainer._calculate_rewards``
(called unbound on a stand-in trainer, one process) gets the values ``RewardSet`` gets, from
conversational prompts and completions and the dataset's extra columns."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

from rolemrc.rewards import JudgeReward, RewardSet, VerifierReward  # noqa: E402
from tests.eval.conftest import JudgeServer  # noqa: E402
from tests.rewards.helpers import length_reward  # noqa: E402

NI_TASK = "role_related_mrc_answer_no_narration-special-format"
PROMPT = [{"role": "system", "content": "You are Ada. Never use commas."}, {"role": "user", "content": "Hello?"}]


def test_trl_calculates_the_same_rewards(tmp_path, api_key_env):
    replies = ["Hello there [[good]]", "Hello, there [[good]]", "Fine, thanks", "Quiet"]
    rules = [{"type": "no_commas"}] * 3 + [None]
    inputs = [{"prompt": PROMPT, "task": NI_TASK, "rule": r, "reference": "Hello"} for r in rules]
    completions = [[{"role": "assistant", "content": c}] for c in replies]  # TRL's conversational form
    with JudgeServer(api_key=api_key_env[1]) as server:
        judge = JudgeReward({"backend": "openai", "model": "fake-judge", "base_url": server.base_url,
                             "api_key_env": api_key_env[0], "timeout_s": 2.5, "max_attempts": 2}, cache_dir=tmp_path)
        funcs = {"rules": VerifierReward(), "judge": judge, "words": length_reward}
        trainer = SimpleNamespace(
            accelerator=SimpleNamespace(device=torch.device("cpu"), is_main_process=True),
            reward_funcs=list(funcs.values()), reward_processing_classes=[None] * 3, reward_func_names=list(funcs),
            state=SimpleNamespace(global_step=0), args=SimpleNamespace(report_to=[]),
            _log_completion_extra=lambda *a, **k: None, _log_metric=lambda *a, **k: None, environments=None)
        theirs = GRPOTrainer._calculate_rewards(trainer, inputs, [PROMPT] * 4, completions, [[1]] * 4)
        columns = {k: [x[k] for x in inputs] for k in ("task", "rule", "reference")}
        ours = RewardSet(funcs)([PROMPT] * 4, completions, columns)
    torch.testing.assert_close(ours.per_reward.float(), theirs, equal_nan=True)
    assert ours.per_reward[:, 0].tolist()[:3] == [1.0, 0.0, 0.0] and math.isnan(ours.per_reward[3, 0])
    assert ours.per_reward[:, 1].tolist() == [1.0, 1.0, 0.0, 0.0]
