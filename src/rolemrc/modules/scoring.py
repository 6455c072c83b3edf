"""Scoring a step's rollouts, the part GRPO and RLOO compose (:class:`Scorer`): the rewards of the
sampled completions or conversations (the run's :class:`~rolemrc.rewards.RewardSet`), each reward's
column, the group advantages (over every rank's completions where the objective normalises over the
step) and the statistics logged of them, under TRL's names (:func:`rollout_metrics`,
:func:`conversation_metrics`, :func:`sampling_metrics`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from rolemrc.env.rollout import ENV_ENDS
from rolemrc.objectives.grpo import GroupAdvantages, group_advantages, nanstd, normalized_sum_advantages
from rolemrc.objectives.rloo import rloo_advantages
from rolemrc.rewards import RewardSet, disagreement_rate
from rolemrc.rewards.combine import RewardScores
from rolemrc.rewards.turns import DialogueScores, extra_metrics, score_dialogues
from rolemrc.rollout import RolloutError


def gather_objects(obj: Any, world: int) -> list[Any]:
    """``obj`` of every rank (``torch.distributed.all_gather_object``), by rank."""
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, obj)
    return parts


def repeated(batch: dict[str, Any], g: int) -> tuple[list[Any], dict[str, list[Any]]]:
    """The batch's prompts and columns, each row ``g`` times (each prompt's samples next to each other)."""
    return ([p for p in batch["prompts"] for _ in range(g)],
            {k: [v for v in values for _ in range(g)] for k, values in batch["columns"].items()})


class Scorer:
    """GRPO's scoring of one rank's rollouts: ``objective`` (the grpo or rloo node), ``rewards`` (the
    run's reward set), ``env`` (the ``env:`` settings for conversations, None for one completion per
    prompt), ``world`` and ``rank`` (the step's completions are spread over ``world`` ranks)."""

    def __init__(self, objective: Any, rewards: RewardSet, env: Any = None, world: int = 1, rank: int = 0) -> None:
        self.objective, self.rewards, self.env, self.world, self.rank = objective, rewards, env, world, rank

    def completions(self, prompts: list[Any], texts: list[str], columns: dict[str, list[Any]]) -> RewardScores:
        """The rewards of the decoded completions (one per prompt row of ``prompts`` and ``columns``)."""
        return self.rewards(prompts, texts, columns)

    def conversations(self, convs: list[Any], columns: dict[str, list[Any]]) -> DialogueScores:
        """:func:`~rolemrc.rewards.turns.score_dialogues` of ``convs`` with the ``env`` settings' aggregation.
        A conversation whose user failed (an API fault: ``Conversation.failed``) is not scored (NaN: advantage
        0, and :func:`~rolemrc.env.sampler.lay_out` trains none of it); every one failing stops the run."""
        keep = [i for i, c in enumerate(convs) if not c.failed]
        if not keep:
            errors = sorted({c.error for c in convs if c.error})[:2]
            raise RolloutError(f"the environment's user failed in all {len(convs)} conversations of the step "
                               f"({convs[0].reason}{': ' + '; '.join(errors) if errors else ''}): nothing to score")
        got = score_dialogues(self.rewards, [convs[i].messages for i in keep], [convs[i].turns for i in keep],
                              {k: [v[i] for i in keep] for k, v in columns.items()}, how=self.env.turn_rewards,
                              whole=list(self.env.conversation_rewards))
        if len(keep) == len(convs):
            return got
        scores, rows = got.scores, torch.tensor(keep)
        per = torch.full((len(convs), len(scores.names)), float("nan"), dtype=torch.float64)
        total = torch.full((len(convs),), float("nan"), dtype=torch.float64)
        per[rows], total[rows] = scores.per_reward, scores.rewards
        return DialogueScores(RewardScores(scores.names, per, total, scores.metrics), got.turn_values, got.turn_index)

    def advantages(self, scores: RewardScores, device: torch.device, kl: torch.Tensor | None = None) -> GroupAdvantages:
        """:func:`group_advantages` of this rank's rewards ``[N]`` (whole groups), or with
        ``multi_objective_aggregation=normalize_then_sum`` :func:`normalized_sum_advantages` of its
        per-reward scores ``[N, K]`` (weighted by the reward set's weights). ``scale_rewards=batch`` and
        ``normalize_then_sum`` normalise over the step's completions on EVERY rank, as TRL, which gathers
        its generation batch's rewards from all processes, normalises them and keeps its slice (group
        means and stds need no other rank: a group is never split across ranks here). ``kl``: RLOO's."""
        o, g = self.objective, self.objective.num_generations
        # float64: identical rewards give a std of exactly 0 (float32 sums leave ~1e-8, which
        # frac_reward_zero_std would not count as zero); the advantages are cast to float32 after
        if o.multi_objective_aggregation == "normalize_then_sum":
            weights = torch.tensor([self.rewards.weights[name] for name in scores.names], dtype=torch.float64)
            return self.over_ranks(lambda x: normalized_sum_advantages(x, weights.to(x.device), g),
                                   scores.per_reward.to(device))

        def advantages(x: torch.Tensor) -> GroupAdvantages:
            return group_advantages(x, g, o.scale_rewards)

        rewards = scores.rewards.to(device)
        return self.over_ranks(advantages, rewards) if str(o.scale_rewards) == "batch" else advantages(rewards)

    def over_ranks(self, fn: Callable[..., GroupAdvantages], *values: torch.Tensor | None) -> GroupAdvantages:
        """``fn`` of every rank's ``values`` (each ``[N]``-rowed or None), this rank's rows of it."""
        if self.world == 1:
            return fn(*values)
        parts = gather_objects(tuple(None if v is None else v.cpu() for v in values), self.world)
        first = values[0]
        assert first is not None
        start = sum(len(p[0]) for p in parts[:self.rank])
        adv = fn(*(None if v is None else torch.cat([p[i] for p in parts]).to(first.device)
                   for i, v in enumerate(values)))
        mine = slice(start, start + len(first))
        return GroupAdvantages(adv.advantages[mine], adv.std[mine], adv.is_std_zero[mine])

    @staticmethod
    def stats(scores: RewardScores, laid: dict[str, torch.Tensor], prompt_tokens: int, seconds: float,
              **more: Any) -> dict[str, Any]:
        """The rollout's statistics logged at the step's end (:func:`rollout_metrics`), from its scores
        and layout (``model_tokens``, ``cut``); ``more``: the rollout kind's own."""
        return {"names": scores.names, "per_reward": scores.per_reward.cpu(), "rewards": scores.rewards.cpu(),
                "lengths": laid["model_tokens"].cpu(), "truncated": laid["cut"].cpu(), "prompt_tokens": prompt_tokens,
                "extra": extra_metrics(scores.metrics), "seconds": seconds, **more}


class LeaveOneOutScorer(Scorer):
    """RLOO's scoring: GRPO's rewards, the leave-one-out advantages."""

    def advantages(self, scores: RewardScores, device: torch.device, kl: torch.Tensor | None = None) -> GroupAdvantages:
        """:func:`rloo_advantages` of this rank's rewards less ``beta x kl`` (each completion's KL to the
        reference, ``beta > 0``); ``normalize_advantages`` over the step's completions on EVERY rank, as
        TRL normalises its gathered generation batch."""
        o = self.objective
        clip = (float(o.reward_clip_range[0]), float(o.reward_clip_range[1])) if o.reward_clip_range is not None \
            else None

        def advantages(r: torch.Tensor, k: torch.Tensor | None) -> GroupAdvantages:
            return rloo_advantages(r, o.num_generations, kl=k, beta=o.beta, reward_clip_range=clip,
                                   normalize_advantages=o.normalize_advantages)

        rewards = scores.rewards.to(device).double()
        return self.over_ranks(advantages, rewards, kl) if o.normalize_advantages else advantages(rewards, kl)


def rollout_metrics(stats: list[dict[str, Any]]) -> dict[str, float]:
    """TRL's reward and completion metrics over the step's rollouts (every rank's :meth:`Scorer.stats`);
    RLOO's ``kl`` (``beta > 0``: the token mean of ``old - ref`` over the step's completions) and the
    conversations' (:func:`conversation_metrics`) where the rollouts have them."""
    names = stats[0]["names"]
    rewards = torch.cat([s["rewards"] for s in stats]).double()
    per = torch.cat([s["per_reward"] for s in stats]).double()
    lengths = torch.cat([s["lengths"] for s in stats]).double()
    truncated = torch.cat([s["truncated"] for s in stats]).bool()
    metrics: dict[str, float] = {
        "reward": torch.nanmean(rewards).item(), "reward_std": nanstd(rewards).item(),
        "frac_reward_zero_std": torch.cat([s["is_std_zero"] for s in stats]).double().mean().item(),
        "completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.double().mean().item(),
    }
    # TRL: the lengths of the completions that ended with a stop token (all 0 when none did)
    ended = lengths[~truncated] if bool((~truncated).any()) else lengths.new_zeros(1)
    metrics.update({"completions/mean_terminated_length": ended.mean().item(),
                    "completions/min_terminated_length": ended.min().item(),
                    "completions/max_terminated_length": ended.max().item()})
    for k, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(per[:, k]).item()
        metrics[f"rewards/{name}/std"] = nanstd(per[:, k]).item()
    pairs = {f"rewards/disagreement/{j}_vs_{v}": (a, b) for a, j in enumerate(names) for b, v in enumerate(names)}
    for key in stats[0]["extra"]:
        if key in pairs:  # the share over every rank's completions both scored, not a mean of shares
            a, b = pairs[key]
            rate, _ = disagreement_rate(*([None if math.isnan(x) else x for x in per[:, c].tolist()] for c in (a, b)))
            metrics[key] = float("nan") if rate is None else rate
            continue
        values = [s["extra"][key] for s in stats if not math.isnan(s["extra"][key])]
        summed = key.endswith("/missing")
        metrics[key] = (sum(values) if summed else sum(values) / len(values)) if values else float("nan")
    seconds = sum(s["seconds"] for s in stats)
    metrics["completion_tokens_per_s"] = lengths.sum().item() / seconds if seconds > 0 else float("nan")
    if "turns" in stats[0]:
        metrics.update(conversation_metrics(stats))
    if all("kl_sum" in s for s in stats):
        metrics["kl"] = sum(s["kl_sum"] for s in stats) / max(sum(s["kl_tokens"] for s in stats), 1.0)
    return metrics


def conversation_metrics(stats: list[dict[str, Any]]) -> dict[str, float]:
    """The step's conversations (every rank's): ``turns/mean``, ``turns/max``, ``ends/<reason>`` (how
    many ended so: the rollout's reasons always, the environment's when seen), ``noncanonical_replies``
    (replies sampled otherwise than the template tokenises their text) and ``rewards/<name>/turn_<k>``
    (the mean of each per-turn reward over the replies at turn ``k``)."""
    turns = torch.cat([s["turns"] for s in stats]).double()
    out = {"turns/mean": turns.mean().item(), "turns/max": turns.max().item(),
           "noncanonical_replies": float(sum(s["noncanonical"] for s in stats))}
    ends = dict.fromkeys(ENV_ENDS, 0)
    for s in stats:
        for reason in s["ends"]:
            ends[reason] = ends.get(reason, 0) + 1
    out.update({f"ends/{reason}": float(n) for reason, n in sorted(ends.items())})
    values = torch.cat([s["turn_values"] for s in stats])
    index = torch.cat([s["turn_index"] for s in stats])
    for k, name in enumerate(stats[0]["names"]):
        column = values[:, k]
        if bool(torch.isnan(column).all()):  # scored per conversation (or never applied): no by-turn figure
            continue
        for turn in sorted(set(index.tolist())):
            out[f"rewards/{name}/turn_{turn}"] = torch.nanmean(column[index == turn]).item()
    return out


def sampling_metrics(per_rank: list[list[dict[str, Any]]]) -> dict[str, float]:
    """TRL's ``sampling/*`` of vLLM's correction: each rank's over its rollouts (every micro-batch's
    first use), then the mean of the ranks' means and the extremes over ranks (0 where a rank has none)."""
    ranks = [[e["sampling"] for e in part if "sampling" in e] for part in per_rank]
    if not any(ranks):
        return {}
    values: dict[str, list[float]] = {"delta_mean": [], "delta_max": [], "ratio_min": [], "ratio_mean": [],
                                      "ratio_max": []}
    for entries in ranks:
        def total(key: str) -> float:
            return sum(e[key] for e in entries)

        def pick(key: str, fn: Any) -> float:
            kept = [e[key] for e in entries if not math.isnan(e[key])]
            return fn(kept) if kept else 0.0

        values["delta_mean"].append(total("delta_sum") / total("delta_count") if total("delta_count") else 0.0)
        values["delta_max"].append(pick("delta_max", max))
        values["ratio_mean"].append(total("ratio_sum") / total("ratio_count") if total("ratio_count") else 0.0)
        values["ratio_min"].append(pick("ratio_min", min))
        values["ratio_max"].append(pick("ratio_max", max))
    return {"sampling/sampling_logp_difference/mean": sum(values["delta_mean"]) / len(ranks),
            "sampling/sampling_logp_difference/max": max(values["delta_max"]),
            "sampling/importance_sampling_ratio/min": min(values["ratio_min"]),
            "sampling/importance_sampling_ratio/mean": sum(values["ratio_mean"]) / len(ranks),
            "sampling/importance_sampling_ratio/max": max(values["ratio_max"])}
