"""What SFT and DPO share: the policy model, its forward to per-token log-probs, the
optimizer/schedule and FSDP2 sharding."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from torch import nn

from rolemrc.models.loading import decoder_and_head
from rolemrc.objectives.logprobs import shift_labels


def lr_lambda(kind: str, warmup: int, total: int, min_ratio: float):
    """Multiplier of the peak lr at optimizer step ``s``: linear warmup, then cosine/linear/constant."""
    if kind not in ("cosine", "linear", "constant"):
        raise ValueError(f"optim.scheduler must be cosine, linear or constant, got {kind!r}")

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "cosine":
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            decay = 1.0 - progress
        return min_ratio + (1.0 - min_ratio) * decay

    return f


class PolicyModule(L.LightningModule):
    """Holds ``self.model`` (a transformers causal LM, maybe PEFT-wrapped)."""

    def __init__(self, model: nn.Module, cfg: Any) -> None:
        super().__init__()
        # from_pretrained returns a model in eval mode and Lightning keeps module modes as it
        # finds them: without this, a model loaded from a path trains with dropout off and, worse,
        # with gradient checkpointing silently inactive (transformers checkpoints only in training).
        model.train()
        self.model = model
        self.cfg = cfg
        self._sharded = False

    # ---- forward -------------------------------------------------------------------------
    def token_logps(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of every labelled token: ([N] fp32, [B, T] bool mask of their positions).

        The lm_head is applied only at those N positions, in chunks (never [B*T, V] logits).
        Packed batches (``segments``, ``sequence_ids``, ``position_ids`` from
        :class:`~rolemrc.data.collate.PackedCollator`) attend within each piece only, and a
        piece's last token is never trained to predict the next piece's first.
        """
        decoder, head = decoder_and_head(model)
        head.chunk_size = self.cfg.objective.logprob_chunk_size
        if "segments" in batch:
            from rolemrc.modules.packed_attention import packed_hidden, packed_route

            hidden = packed_hidden(decoder, batch, packed_route(model, self.packs_with_context()))
        else:
            hidden = decoder(
                input_ids=batch["input_ids"],
                attention_mask=batch.get("attention_mask"),
                position_ids=batch.get("position_ids"),
            ).last_hidden_state
        labels = batch.get("shifted_labels")
        if labels is None:
            labels = shift_labels(batch["labels"], batch.get("sequence_ids"))
        return head(hidden, labels=labels), labels != -100  # fp32 even under autocast

    def packs_with_context(self) -> bool:
        """Whether packed pieces may see a context span (shared-prompt DPO); SFT: never."""
        return False

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        from rolemrc.checkpoints import rng_state

        checkpoint["rng_state"] = rng_state()  # dropout etc. continue exactly after a resume

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "rng_state" in checkpoint:
            self._rng_to_restore = checkpoint["rng_state"]

    def on_train_start(self) -> None:
        # Restored here, after Lightning's own setup consumed random numbers.
        state = getattr(self, "_rng_to_restore", None)
        if state is not None:
            from rolemrc.checkpoints import set_rng_state

            set_rng_state(state)
            self._rng_to_restore = None

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        optimizers = self.trainer.optimizers
        if optimizers:
            self.log("train/lr", optimizers[0].param_groups[0]["lr"], batch_size=1)

    # ---- optimisation --------------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        o = self.cfg.optim
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
        total = int(self.trainer.estimated_stepping_batches)
        warmup = int(round(o.warmup_ratio * total))
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lr_lambda(o.scheduler, warmup, total, o.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---- sharding ------------------------------------------------------------------------
    def configure_model(self) -> None:
        """FSDP2: shard each decoder layer, then the rest (see rolemrc.strategies)."""
        if self._sharded or self.device_mesh is None:
            return
        from rolemrc.strategies import shard_model

        for m in self.models_to_shard():
            shard_model(m, self.device_mesh, self.cfg.strategy)
        self._sharded = True

    def models_to_shard(self) -> list[nn.Module]:
        return [self.model]
