"""RLOO: online RL on prompts (``objective=rloo``, data kind ``prompts``), as TRL 1.16's RLOOTrainer
computes it, on GRPO's machinery (:class:`~rolemrc.modules.grpo.GRPOModule`: the rollout, the
rewards, the rollout reuse with ``num_iterations > 1``, the resumable sampling RNG, the logged
rollout metrics). What differs from GRPO:

* the advantages (:func:`~rolemrc.objectives.rloo.rloo_advantages`): each reward minus the mean
  reward of the other completions of its prompt (leave-one-out), no division by the group's std;
  with ``beta > 0`` the KL to the reference is taken out of the reward first, one number per
  completion (:func:`~rolemrc.objectives.rloo.sequence_kl`: the sum over its tokens of the sampling
  policy's minus the reference's log-probs). For that, the rollout scores the step's completions
  once more under the policy (no gradient) and under the reference; those sequence log-probs are
  the old log-probs of every use of the rollouts. With ``beta = 0`` no extra pass is made: the
  first use records the old log-probs, as GRPO does;
* the loss (:func:`~rolemrc.objectives.rloo.rloo_loss`): one importance ratio per sequence and
  the clipped surrogate averaged over the step's completions; no KL term in the loss.

Logged as GRPO (TRL's names), with ``kl`` (the token mean of ``old - ref`` over the step's
completions, logged with the rollout metrics when ``beta > 0``) and ``clip_ratio/*`` over
sequences; ``frac_reward_zero_std`` counts the groups whose penalised rewards do not vary.
"""

from __future__ import annotations

from typing import Any

import torch

from rolemrc.modules.grpo import GRPOModule
from rolemrc.modules.scoring import LeaveOneOutScorer
from rolemrc.objectives.grpo import GroupAdvantages
from rolemrc.objectives.rloo import rloo_loss, sequence_kl
from rolemrc.rewards.combine import RewardScores

OLD_KEY = "old_sequence_logps"  # a rollout part's old sequence log-probs [N] (kept with the part for reuse)


class RLOOModule(GRPOModule):
    """``objective``: the rloo node (:class:`~rolemrc.config.RLOOObjectiveConfig`); the other
    arguments as :class:`~rolemrc.modules.grpo.GRPOModule`'s."""

    grpo_loss = False  # one loss, no entropy bonus, no vLLM importance-sampling correction (TRL's RLOOConfig)
    row_keys = ("advantages", OLD_KEY)  # the rollout's old sequence log-probs (beta > 0) go with their rows
    scorer_class = LeaveOneOutScorer

    def _advantages(self, scores: RewardScores, batch: dict[str, Any], stats: dict[str, Any]) -> GroupAdvantages:
        """The leave-one-out advantages of the laid-out ``batch``'s rewards, with ``beta > 0`` less each
        completion's KL from one pass of the policy and the reference (no gradient); those sequence
        log-probs are the old log-probs of every use of the rollouts."""
        kl = None
        if self.objective.beta > 0:
            with torch.no_grad():
                logps, mask, _ = self.token_logps(self.model, batch)
                ref = self.reference_token_logps(batch)
            kl = sequence_kl(logps.double(), ref.double(), mask)
            batch[OLD_KEY] = (logps * mask).sum(-1).detach()
            stats["kl_sum"] = float(((logps - ref) * mask).sum())
            stats["kl_tokens"] = float(mask.sum())
        return self.scorer.advantages(scores, batch["input_ids"].device, kl)

    def step_loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share of the step's RLOO loss (takes its rollouts first unless ``batch``
        already holds ``advantages``: the memory simulation and tests hand rollouts in)."""
        o = self.objective
        rolled_here = "advantages" not in batch
        part = self.reuse.take(batch, self._step_rollouts) if rolled_here else None
        logps, mask, entropy = self.token_logps(self.model, batch, entropy=True)
        if part is not None and self.reuse.num_iterations > 1 and OLD_KEY not in part:
            part[OLD_KEY] = (logps * mask).sum(-1).detach()  # the first use's: the policy that sampled them
        n = batch["input_ids"].shape[0]
        step_sequences = batch["step_prompts"] * o.num_generations if "step_prompts" in batch else n
        out = rloo_loss(logps, batch["advantages"], mask, old_logps=batch.get(OLD_KEY), epsilon=o.epsilon,
                        epsilon_high=o.epsilon_high, num_sequences=step_sequences)
        self._record_stats(batch, rolled_here, out, mask, entropy)
        return out.loss, {}

    memory_note = GRPOModule.memory_note.replace("objective=grpo", "objective=rloo") + (
        "; with beta > 0 RLOO's extra rollout pass of the policy (no gradient) is not simulated")
