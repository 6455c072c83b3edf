"""Role-play rewards for online RL (issue 33's building blocks): composable callables, weighted
and logged one by one, as TRL's GRPOTrainer logs them.

A reward function is any callable with TRL's reward-function signature (:data:`RewardFn`)::

    fn(*, prompts: list[list[dict]], completions: list[str], **columns) -> list[float | None]

``prompts[i]`` is the conversation up to the assistant's turn (``{"role", "content"}`` messages),
``completions[i]`` the sampled reply (a string, or TRL's conversational form: a list of messages ending
with the assistant's; :func:`completion_texts` gives the strings), ``columns`` the prompt records' other fields, one list each
(``task``, ``rule``, ``reference``, ...; accept ``**kwargs`` for the ones you do not use). ``None``
(or NaN) means "does not apply to this completion" (e.g. no rule): it is left out of that reward's mean
and of the sum, never counted as 0. Anything else that is not one finite number per completion (an
infinite value, a string, another count) stops with :class:`RewardValueError` naming the reward.

``verifier`` (:class:`VerifierReward`): the nested-rule checks of ``rolemrc.eval.verifiers``.
``judge`` (:class:`JudgeReward`): the five-dimension judge through ``rolemrc.eval.judge.make_judge``.
``reward_model`` (:class:`RewardModelReward`): a local HF sequence-classification model's logit for
the conversation rendered with its chat template (TRL's reward-model scoring).
Any callable by dotted path (``_target_``); a new ``type`` is one ``REWARD_KINDS.register`` entry
(a factory whose keyword parameters are its keys). :class:`RewardSet` weights and sums them and returns
the per-reward values and TRL's metric names; :func:`disagreement_rate` is the judge-vs-verifier
reward-hacking alarm. ``objective=grpo`` (:mod:`rolemrc.modules.grpo`) builds its rewards here.
"""

from rolemrc.rewards.combine import (REWARD_KINDS, RewardFn, RewardScores, RewardSet, RewardValueError, build_rewards,
                                     disagreement_rate, load_target)
from rolemrc.rewards.judge import JUDGE_ON_FAILURE, JudgeReward, JudgeRewardError
from rolemrc.rewards.reward_model import RewardModelReward
from rolemrc.rewards.text import completion_text, completion_texts
from rolemrc.rewards.verifier import VERIFIER_MODES, VerifierReward

__all__ = ["JUDGE_ON_FAILURE", "VERIFIER_MODES", "JudgeReward", "JudgeRewardError", "RewardFn", "RewardModelReward",
           "REWARD_KINDS", "RewardScores", "RewardSet", "RewardValueError", "VerifierReward", "build_rewards", "completion_text", "completion_texts", "disagreement_rate", "load_target"]
