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
from rolemrc.objectives.grpo import GroupAdvantages
from rolemrc.objectives.rloo import rloo_advantages, rloo_loss, sequence_kl

OLD_KEY = "old_sequence_logps"  # a rollout part's old sequence log-probs [N] (kept with the part for reuse)


class RLOOModule(GRPOModule):
    """``objective``: the rloo node (:class:`~rolemrc.config.RLOOObjectiveConfig`); the other
    arguments as :class:`~rolemrc.modules.grpo.GRPOModule`'s."""

    _rolled_old: torch.Tensor | None = None  # the rollout's old sequence log-probs, split into parts after

    def _check_loss_options(self, objective: Any) -> None:
        """No GRPO loss options to check: RLOO has one loss."""

    def _entropy_control(self, objective: Any) -> None:
        """No entropy bonus: TRL's RLOOConfig has none."""
        return None

    def _vllm_correction(self) -> bool:
        """No vLLM importance-sampling correction: TRL's RLOOConfig has none."""
        return False

    def _advantages(self, rewards: torch.Tensor, per_reward: torch.Tensor | None = None,
                    names: list[str] | None = None) -> GroupAdvantages:
        """A placeholder: :meth:`score` computes the advantages once the KL is known."""
        zeros = torch.zeros_like(rewards)
        return GroupAdvantages(zeros, zeros, torch.zeros_like(rewards, dtype=torch.bool))

    def score(self, batch: dict[str, Any], new_ids: torch.Tensor, seconds: float = float("nan")) -> dict[str, Any]:
        """GRPO's layout and rewards, then (``beta > 0``) each completion's KL from one pass of the
        policy and the reference, and the leave-one-out advantages of the penalised rewards."""
        o = self.objective
        batch = super().score(batch, new_ids, seconds)
        stats = batch["rollout_stats"]
        rewards = stats["rewards"].to(batch["input_ids"].device).double()
        kl, old = None, None
        if o.beta > 0:
            with torch.no_grad():
                logps, mask, _ = self.token_logps(self.model, batch)
                ref = self.reference_token_logps(batch)
            kl = sequence_kl(logps.double(), ref.double(), mask)
            old = (logps * mask).sum(-1).detach()
            tokens = mask.sum()
            stats["kl_sum"] = float(((logps - ref) * mask).sum())
            stats["kl_tokens"] = float(tokens)
        adv = self._rloo_advantages(rewards, kl)
        batch["advantages"] = adv.advantages.float()
        stats["is_std_zero"] = adv.is_std_zero.cpu()
        self._rolled_old = old
        return batch

    def _rloo_advantages(self, rewards: torch.Tensor, kl: torch.Tensor | None) -> GroupAdvantages:
        """:func:`rloo_advantages` of this rank's penalised rewards; ``normalize_advantages`` over the
        step's completions on EVERY rank, as TRL normalises its gathered generation batch."""
        o = self.objective
        clip = (float(o.reward_clip_range[0]), float(o.reward_clip_range[1])) if o.reward_clip_range is not None \
            else None

        def advantages(r: torch.Tensor, k: torch.Tensor | None) -> GroupAdvantages:
            return rloo_advantages(r, o.num_generations, kl=k, beta=o.beta, reward_clip_range=clip,
                                   normalize_advantages=o.normalize_advantages)

        world = self.trainer.world_size if self._trainer is not None else 1
        if world == 1 or not o.normalize_advantages:
            return advantages(rewards, kl)
        import torch.distributed as dist

        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, (rewards.cpu(), None if kl is None else kl.cpu()))
        start = sum(len(r) for r, _ in parts[:self.trainer.global_rank])
        all_kl = None if kl is None else torch.cat([k for _, k in parts]).to(rewards.device)
        adv = advantages(torch.cat([r for r, _ in parts]).to(rewards.device), all_kl)
        mine = slice(start, start + len(rewards))
        return GroupAdvantages(adv.advantages[mine], adv.std[mine], adv.is_std_zero[mine])

    def _step_rollouts(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """GRPO's parts, each with its rows' old sequence log-probs when the rollout computed them."""
        self._rolled_old = None
        parts = super()._step_rollouts(batch)
        old, self._rolled_old = self._rolled_old, None
        if old is not None:
            start = 0
            for part in parts:
                n = int(part["advantages"].shape[0])
                part[OLD_KEY] = old[start:start + n]
                start += n
        return parts

    def step_loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share of the step's RLOO loss (takes its rollouts first unless ``batch``
        already holds ``advantages``: the memory simulation and tests hand rollouts in)."""
        o = self.objective
        rolled_here = "advantages" not in batch
        part = self._take_rollouts(batch) if rolled_here else None
        logps, mask, entropy = self.token_logps(self.model, batch, entropy=True)
        if part is not None and self.reuse.num_iterations > 1 and OLD_KEY not in part:
            part[OLD_KEY] = (logps * mask).sum(-1).detach()  # the first use's: the policy that sampled them
        n = batch["input_ids"].shape[0]
        step_sequences = batch["step_prompts"] * o.num_generations if "step_prompts" in batch else n
        out = rloo_loss(logps, batch["advantages"], mask, old_logps=batch.get(OLD_KEY), epsilon=o.epsilon,
                        epsilon_high=o.epsilon_high, num_sequences=step_sequences)
        self._record_stats(batch, rolled_here, out, mask, entropy)
        return out.loss, {}

    @staticmethod
    def _rollout_metrics(stats: list[dict[str, Any]]) -> dict[str, float]:
        """GRPO's rollout metrics, and ``kl`` (``beta > 0``): the token mean of ``old - ref`` over the
        step's completions on every rank."""
        metrics = GRPOModule._rollout_metrics(stats)
        if all("kl_sum" in s for s in stats):
            tokens = sum(s["kl_tokens"] for s in stats)
            metrics["kl"] = sum(s["kl_sum"] for s in stats) / max(tokens, 1.0)
        return metrics

    memory_note = GRPOModule.memory_note.replace("objective=grpo", "objective=rloo") + (
        "; with beta > 0 RLOO's extra rollout pass of the policy (no gradient) is not simulated")
