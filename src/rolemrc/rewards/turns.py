"""Rewards of whole conversations (multi-turn GRPO, ``env=<name>``): each reward scored per turn and
aggregated per conversation, or scored once over the whole conversation.

* **per turn** (every reward not named in ``whole``): each reply is a completion whose prompt is the
  conversation before it (the opening, and every earlier user turn and reply), with its seed row's
  columns (``rule``, ``task``, ...): a verifier checks each reply's rule. A conversation's value of
  the reward is its turns' values aggregated by ``how``: ``mean`` (over the turns it applies to),
  ``last`` (the last reply's), ``min`` (the worst turn), ``sum``; NaN where it applies to no turn.
* **per conversation** (the rewards named in ``whole``): one call per conversation, the completion
  its last reply and the prompt everything before it. A judge reward so sees the whole dialogue: the
  system prompt with the role, every user turn and every earlier reply, then judges the last reply
  in that context on its task's dimensions.

The conversation's reward is the weighted sum of its per-reward values, as for one reply
(:meth:`RewardSet.combine`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rolemrc.rewards.combine import RewardScores, RewardSet, mean_metrics

TURN_AGGREGATIONS: tuple[str, ...] = ("mean", "last", "min", "sum")


@dataclass
class DialogueScores:
    """``scores``: per conversation (``per_reward`` ``[N, K]`` aggregated as above, ``rewards`` ``[N]``,
    ``metrics`` as :class:`RewardScores`'); ``turn_values`` ``[M, K]``: every reply's value of each
    per-turn reward (NaN for the per-conversation ones), ``turn_index`` ``[M]``: its turn (1-based)."""

    scores: RewardScores
    turn_values: Tensor
    turn_index: Tensor


def aggregate(values: Tensor, how: str) -> float:
    """One conversation's value of a reward from its turns' ``values`` (NaN: does not apply)."""
    if how == "last":
        return float(values[-1]) if values.numel() else float("nan")
    kept = values[~torch.isnan(values)]
    if not kept.numel():
        return float("nan")
    if how == "mean":
        return float(kept.mean())
    if how == "min":
        return float(kept.min())
    if how == "sum":
        return float(kept.sum())
    raise ValueError(f"env.turn_rewards must be one of {', '.join(TURN_AGGREGATIONS)}, got {how!r}")


def extra_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """A reward set's metrics besides the means and stds (judge ``missing`` counts, disagreement rates)."""
    return {k: v for k, v in metrics.items() if k.startswith("rewards/") and not k.endswith(("/mean", "/std"))}


def score_dialogues(rewards: RewardSet, dialogues: Sequence[Sequence[Mapping[str, Any]]], turns: Sequence[int],
                    columns: Mapping[str, Sequence[Any]], *, how: str = "mean",
                    whole: Sequence[str] = ()) -> DialogueScores:
    """``dialogues[i]``: a conversation's messages, ending with its last reply; ``turns[i]``: its
    replies (its last ``turns[i]`` assistant messages; earlier ones are the seed's history);
    ``columns``: the seed rows' fields, one value per conversation (see the module docstring)."""
    names = list(rewards.rewards)
    n, k = len(dialogues), len(names)
    per = torch.full((n, k), float("nan"), dtype=torch.float64)
    metrics: dict[str, float] = {}
    prompts, replies, owner, index = [], [], [], []
    for i, messages in enumerate(dialogues):
        positions = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
        for t, j in enumerate(positions[len(positions) - int(turns[i]):] if turns[i] else []):
            prompts.append([dict(m) for m in messages[:j]])
            replies.append(messages[j]["content"])
            owner.append(i)
            index.append(t + 1)
    turn_values = torch.full((len(replies), k), float("nan"), dtype=torch.float64)
    per_turn = [name for name in names if name not in whole]
    if per_turn and replies:
        got = rewards.subset(per_turn)(prompts, replies, {c: [v[i] for i in owner] for c, v in columns.items()})
        metrics.update(extra_metrics(got.metrics))
        owners = torch.tensor(owner)
        for col, name in enumerate(per_turn):
            turn_values[:, names.index(name)] = got.per_reward[:, col]
            for i in range(n):
                per[i, names.index(name)] = aggregate(got.per_reward[owners == i, col], how)
    if whole:
        last = [max(j for j, m in enumerate(messages) if m["role"] == "assistant") for messages in dialogues]
        got = rewards.subset(list(whole))([[dict(m) for m in d[:j]] for d, j in zip(dialogues, last, strict=True)],
                                          [d[j]["content"] for d, j in zip(dialogues, last, strict=True)], columns)
        metrics.update(extra_metrics(got.metrics))
        for col, name in enumerate(whole):
            per[:, names.index(name)] = got.per_reward[:, col]
    total = rewards.combine(per, names)
    metrics.update(mean_metrics(names, per, total))
    return DialogueScores(RewardScores(names, per, total, metrics), turn_values,
                          torch.tensor(index, dtype=torch.long))
