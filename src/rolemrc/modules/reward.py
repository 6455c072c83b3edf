"""Reward-model training (``objective=reward``): the policy's architecture with a one-score
sequence-classification head (``rolemrc.models.loading.load_model(head="score")``), trained on
preference pairs with the Bradley-Terry loss (:func:`rolemrc.objectives.reward.bradley_terry_loss`),
as TRL 1.16's ``RewardTrainer``.

Each chosen and rejected sequence (prompt + response, rendered by the chat template as for DPO) is
scored by the model's own forward, the score at its last token that is not padding: exactly what
``AutoModelForSequenceClassification`` computes when the export is loaded, so GRPO's
``reward_model`` reward sees the scores trained here. Logged under TRL's names: ``accuracy``
(chosen scored above rejected), ``margin`` (mean ``r_c - r_r``), ``mean_reward``, ``num_tokens`` (the
chosen and rejected tokens trained on so far, padding not counted, over every rank: in every
checkpoint); validation adds ``min_reward`` and ``max_reward``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rolemrc.modules.base import PolicyModule, TokensSeen
from rolemrc.objectives.dpo import pair_mean
from rolemrc.objectives.reward import RewardOutput, bradley_terry_loss, reward_step_loss

_VAL = ("losses", "centering", "chosen", "rejected")
TOKENS_KEY = "reward_num_tokens"  # top-level checkpoint entry: TRL's num_tokens so far


def disable_dropout(model: nn.Module) -> None:
    """Every dropout layer of ``model`` set to drop nothing (TRL's ``disable_dropout``)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


class RewardModule(PolicyModule):
    """``objective``: the reward node (center_rewards_coefficient, disable_dropout)."""

    def __init__(self, model: nn.Module, objective: Any, optim: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(model, objective, optim, *args, **kwargs)
        if objective.disable_dropout:
            disable_dropout(self.model)
        self.tokens_seen = TokensSeen(TOKENS_KEY)
        self._step_tokens = 0

    def run_state_parts(self) -> tuple[Any, ...]:
        """The tokens trained on so far (``num_tokens``) travel with every checkpoint."""
        return (*super().run_state_parts(), self.tokens_seen)

    def rewards(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores of the batch's chosen rows and of its rejected rows (``[B]`` each, fp32)."""
        b = batch["index"].shape[0]
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False)
        if out.logits.dim() != 2 or out.logits.shape[-1] != 1:
            raise ValueError(f"objective=reward needs a one-score sequence classifier (load_model(head='score')), "
                             f"got logits of shape {tuple(out.logits.shape)}")
        scores = out.logits.squeeze(-1).float()
        return scores[:b], scores[b:]

    def _terms(self, batch: dict[str, torch.Tensor]) -> tuple[RewardOutput, torch.Tensor, torch.Tensor]:
        chosen, rejected = self.rewards(batch)
        return bradley_terry_loss(chosen, rejected, batch.get("margin")), chosen, rejected

    def step_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share of the step's mean pair loss (plus the centring term)."""
        out, chosen, rejected = self._terms(batch)
        pairs = batch["step_pairs"]
        loss = reward_step_loss(out, self.objective.center_rewards_coefficient, pairs)
        mean = ((chosen + rejected) / 2).detach().double()
        shares = {"train/accuracy": pair_mean(out.accuracies.double(), pairs),
                  "train/margin": pair_mean(out.margins.double(), pairs),
                  "train/mean_reward": pair_mean(mean, pairs)}
        return loss, shares

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The step, then TRL's ``num_tokens``: the non-padding tokens of every pair trained so far
        (TRL: ``attention_mask.sum()`` of each micro-batch, gathered from every process)."""
        loss = super().training_step(batch, batch_idx)
        self._step_tokens += int(batch["attention_mask"].sum())
        if bool(batch["step_end"]):
            tokens = torch.tensor(float(self._step_tokens), dtype=torch.float64, device=self.device)
            if self.trainer.world_size > 1:
                tokens = self.trainer.strategy.reduce(tokens, reduce_op="sum")
            self.tokens_seen.count += int(tokens)
            self._step_tokens = 0
            # float64: Lightning stores a plain number in float32, exact only up to 2**24
            self.log("train/num_tokens", torch.tensor(float(self.tokens_seen.count), dtype=torch.float64),
                     batch_size=1, on_step=True, on_epoch=False, sync_dist=False)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        out, chosen, rejected = self._terms(batch)
        self.collect_val(batch["index"], torch.stack([out.losses, out.centering, chosen, rejected], dim=-1))

    def val_metrics(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        cols = dict(zip(_VAL, values.unbind(-1)))
        chosen, rejected = cols["chosen"], cols["rejected"]
        out = RewardOutput(cols["losses"], cols["centering"], chosen - rejected, (chosen > rejected).double())
        both = torch.cat([chosen, rejected])
        return {"loss": reward_step_loss(out, self.objective.center_rewards_coefficient),
                "accuracy": out.accuracies.mean(), "margin": out.margins.mean(), "mean_reward": both.mean(),
                "min_reward": both.min(), "max_reward": both.max()}
