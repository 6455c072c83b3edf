"""Supervised fine-tuning: mean NLL of the assistant tokens of the global batch.

The loss of one optimizer step is the mean over every label token of the step's global batch
(all micro-batches of the accumulation window, all ranks), as transformers does with
``num_items_in_batch``: (4 x 1), (2 x 2), (1 x 4) and 2 ranks x 2 give the same update.
``val/loss`` is the token mean over the whole validation set.

With ``data.packing=true`` the batches hold several conversations per row (padding-free, each
attending only to itself); the per-token log-probs, hence the loss, equal the unpacked run's.
"""

from __future__ import annotations

import torch

from rolemrc.modules.base import PolicyModule
from rolemrc.objectives.logprobs import token_nll


class SFTModule(PolicyModule):
    def step_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        seq = self.sequence_logps(self.model, batch, batch["index"].shape[0])
        share = token_nll(seq.logps, batch["step_tokens"])  # this micro-batch's share of the step's mean
        # train/tokens: the step's label tokens (each micro-batch's count, summed over the step)
        return share, {"train/tokens": seq.num_tokens.sum()}

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        seq = self.sequence_logps(self.model, batch, batch["index"].shape[0])
        self.collect_val(batch["index"], torch.stack([seq.logps.detach().double(), seq.num_tokens.double()], dim=-1))

    def val_metrics(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        logps, tokens = values.sum(0)
        return {"loss": token_nll(logps, tokens), "tokens": tokens}
