"""Supervised fine-tuning: mean NLL of the assistant tokens.

With ``data.packing=true`` the batches hold several conversations per row (padding-free, each
attending only to itself); the per-token log-probs, hence the loss, equal the unpacked run's.
"""

from __future__ import annotations

import torch

from rolemrc.modules.base import PolicyModule


class SFTModule(PolicyModule):
    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        logps, mask = self.token_logps(self.model, batch)
        n = mask.sum()
        loss = -logps.sum() / n.clamp(min=1)
        bs = batch["index"].shape[0]  # conversations (several per row when packed)
        self.log(f"{stage}/loss", loss, prog_bar=True, batch_size=bs, sync_dist=stage == "val")
        self.log(f"{stage}/tokens", n.float(), batch_size=bs, reduce_fx="sum", sync_dist=stage == "val")
        return loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "val")
