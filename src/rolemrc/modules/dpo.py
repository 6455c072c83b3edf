"""Direct preference optimisation with three ways to get the reference log-probs:

- ``copy``: a frozen copy of the starting policy (sharded and cast like it);
- ``adapter``: the policy's own base weights with the LoRA adapter switched off (no copy);
- ``precomputed``: one pass before training writes them to a cache keyed by model, data and
  template; no reference weights are held during training.

``objective.share_prompt``: prompt, chosen and rejected in one sequence (rejected sees the prompt,
not chosen), for the policy and every reference mode, the precomputed pass included. The
log-probs equal the separate computation, so one precomputed cache serves both layouts (its key
does not include share_prompt).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from rolemrc.data.sampler import ResumableSampler
from rolemrc.modules.base import PolicyModule
from rolemrc.objectives.dpo import average_logps, dpo_loss

log = logging.getLogger(__name__)

REFERENCE_MODES = ("copy", "adapter", "precomputed")


def fingerprint(model: nn.Module) -> str:
    """A hash of names, shapes, dtypes and a strided sample of every parameter's values."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        h.update(flat[::step].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def rows_fingerprint(rows: list[dict]) -> str:
    """Hash of the encoded pairs: changes with the data, the tokenizer and the template."""
    h = hashlib.sha256()
    for r in rows:
        h.update(json.dumps([r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]]).encode())
    return h.hexdigest()[:16]


class DPOModule(PolicyModule):
    def __init__(self, model: nn.Module, cfg: Any, datamodule: Any) -> None:
        super().__init__(model, cfg)
        o = cfg.objective
        if o.reference not in REFERENCE_MODES:
            raise ValueError(f"objective.reference must be one of {REFERENCE_MODES}, got {o.reference!r}")
        if o.reference == "adapter" and not hasattr(model, "disable_adapter"):
            raise ValueError("objective.reference=adapter needs a LoRA model: set model.peft.enabled=true")
        self.mode = o.reference
        self.datamodule = datamodule
        if datamodule is not None and bool(o.share_prompt) != datamodule.share_prompt:
            raise ValueError(f"objective.share_prompt={o.share_prompt} but the datamodule lays pairs out with "
                             f"share_prompt={datamodule.share_prompt}: build it with "
                             f"ChatDataModule(..., share_prompt=cfg.objective.share_prompt)")
        # Kept out of the module tree so it is neither trained nor written to checkpoints.
        self._ref: list[nn.Module] = []
        if self.mode == "copy":
            ref = copy.deepcopy(model).eval()
            ref.requires_grad_(False)
            self._ref.append(ref)
        # The initial weights' fingerprint, taken before any checkpoint is restored into them.
        self._model_key = self._reference_key(model) if self.mode == "precomputed" else ""
        self.ref_tables: dict[str, torch.Tensor] = {}

    @property
    def ref_model(self) -> nn.Module | None:
        return self._ref[0] if self._ref else None

    def models_to_shard(self) -> list[nn.Module]:
        return [self.model] + self._ref

    def configure_model(self) -> None:
        ref = self.ref_model
        if ref is not None:  # frozen: stored as the precision policy says (bf16-true: bf16 like the policy)
            if next(ref.parameters()).dtype != self.policy.frozen:
                ref.to(dtype=self.policy.frozen)
            ref.to(self.device)
        super().configure_model()

    # ---- log-probs ------------------------------------------------------------------------
    def sequence_logps(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed response log-probs and token counts: ([2B], [2B]), chosen then rejected
        (packed / shared-prompt batches: pair j's chosen side is sequence j, its rejected side B + j)."""
        logps, mask = self.token_logps(model, batch)
        return self.sequence_sums(logps, mask, batch, 2 * batch["index"].shape[0])

    def packs_with_context(self) -> bool:
        return bool(self.cfg.objective.share_prompt)

    @torch.no_grad()
    def reference_logps(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        if self.mode == "copy":
            return self.sequence_logps(self.ref_model, batch)[0]
        if self.mode == "adapter":  # the base weights in eval mode, like the copy (no dropout)
            was_training = self.model.training
            self.model.eval()
            try:
                with self.model.disable_adapter():
                    return self.sequence_logps(self.model, batch)[0]
            finally:
                self.model.train(was_training)
        table = self.ref_tables[stage].to(self.device)
        pair = table[batch["index"]]  # [B, 2]: chosen, rejected
        return torch.cat([pair[:, 0], pair[:, 1]])

    # ---- precomputed reference ------------------------------------------------------------
    # The tables always come from the initial weights: computed before training (or found in the
    # cache under the initial weights' key), then carried in every checkpoint, so a run resumed in
    # any folder finds them there and never recomputes them from trained weights.
    def _reference_key(self, model: nn.Module) -> str:
        """Initial weights + what changes their log-probs besides the rows: precision, attention."""
        extra = f"{self.cfg.trainer.precision}|{self.cfg.model.attn_implementation}"
        return hashlib.sha256(f"{fingerprint(model)}|{extra}".encode()).hexdigest()[:16]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.mode == "precomputed" and self.ref_tables:
            checkpoint["reference_logps"] = {k: v.cpu() for k, v in self.ref_tables.items()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        if self.mode == "precomputed" and "reference_logps" in checkpoint:
            self.ref_tables.update(checkpoint["reference_logps"])

    def on_fit_start(self) -> None:
        if self.mode != "precomputed":
            return
        dm = self.datamodule
        for stage, rows in (("train", dm.train_rows), ("val", dm.val_rows)):
            if rows and stage not in self.ref_tables:  # else restored with the checkpoint
                self.ref_tables[stage] = self._reference_table(rows, stage)

    def _weights_restored(self) -> bool:
        """Whether the policy already holds a checkpoint's weights (single/DDP restore before
        ``on_fit_start``; FSDP after it)."""
        return self.trainer.ckpt_path is not None and not self.trainer.strategy.restore_checkpoint_after_setup

    def _cache_path(self, rows: list[dict]) -> Path:
        root = self.cfg.objective.reference_cache_dir or str(Path(self.cfg.run_dir) / "ref_cache")
        return Path(root) / f"ref_logps-{self._model_key}-{rows_fingerprint(rows)}.safetensors"

    def _reference_table(self, rows: list[dict], stage: str) -> torch.Tensor:
        path = self._cache_path(rows)
        if path.exists():
            log.info("reference log-probs (%s) from cache %s", stage, path)
            return load_file(path)["logps"]
        if self._weights_restored():
            raise RuntimeError(
                f"objective.reference=precomputed: resuming from {self.trainer.ckpt_path}, which holds no reference "
                f"log-probs ({stage}), and there is no cache of them at {path}. The policy now holds the checkpoint's "
                "trained weights, so they cannot be recomputed from it. Point objective.reference_cache_dir at the "
                "first run's ref_cache folder, or start the run again from its initial model.")
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = ResumableSampler(len(rows), False, 0, rank, world)
        loader = DataLoader(rows, batch_size=self.cfg.data.batch_size, sampler=sampler,
                            collate_fn=self.datamodule.collator())
        was_training = self.model.training
        self.model.eval()
        index, values = [], []
        show = self.trainer.is_global_zero and self.trainer.progress_bar_callback is not None
        with torch.no_grad(), self.trainer.precision_plugin.forward_context():  # as training computes
            for batch in tqdm(loader, desc=f"reference log-probs ({stage})", unit="batch", disable=not show):
                batch = {k: v.to(self.device) for k, v in batch.items()}
                sums = self.sequence_logps(self.model, batch)[0]
                b = batch["index"].shape[0]
                index.append(batch["index"])
                values.append(torch.stack([sums[:b], sums[b:]], dim=-1))
        self.model.train(was_training)
        index_t, values_t = torch.cat(index), torch.cat(values)
        if world > 1:  # every rank computed a strided share; gather all of them
            index_t = self.all_gather(index_t).reshape(-1)
            values_t = self.all_gather(values_t).reshape(-1, 2)
        table = torch.zeros(len(rows), 2, dtype=torch.float32)
        table[index_t.cpu()] = values_t.float().cpu()
        if self.trainer.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            save_file({"logps": table}, str(tmp))
            tmp.rename(path)
            log.info("reference log-probs (%s, %d pairs) written to %s", stage, len(rows), path)
        return table

    # ---- steps -----------------------------------------------------------------------------
    def _pair_terms(self, batch: dict[str, torch.Tensor], stage: str) -> dict[str, torch.Tensor]:
        """Per-pair loss terms and metrics of one micro-batch (all ``[B]``)."""
        o = self.cfg.objective
        b = batch["index"].shape[0]
        policy, counts = self.sequence_logps(self.model, batch)
        ref = self.reference_logps(batch, stage)
        if o.loss_type == "ipo":  # IPO compares length-normalised log-probs
            pol_in, ref_in = average_logps(policy, counts), average_logps(ref, counts)
        else:
            pol_in, ref_in = policy, ref
        out = dpo_loss(pol_in[:b], pol_in[b:], ref_in[:b], ref_in[b:],
                       beta=o.beta, loss_type=o.loss_type, label_smoothing=o.label_smoothing)
        return {"loss": out.losses, "rewards/chosen": out.chosen_rewards, "rewards/rejected": out.rejected_rewards,
                "rewards/accuracies": (out.chosen_rewards > out.rejected_rewards).double(),
                "rewards/margins": out.chosen_rewards - out.rejected_rewards,
                "logps/chosen": policy[:b], "logps/rejected": policy[b:],
                "nll_chosen": -policy[:b], "chosen_tokens": counts[:b]}

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The step's loss: the mean pair loss over the global batch, plus ``sft_weight`` x the
        chosen responses' token-mean NLL over the global batch (both normalised by the step's
        totals, see :meth:`global_mean`); the logged metrics are per-pair means over the step."""
        terms = self._pair_terms(batch, "train")
        pair_loss = self.global_mean(terms["loss"].sum(), batch, "pairs")
        shares = {f"train/{k}": self.global_mean(terms[k].detach().double().sum(), batch, "pairs")
                  for k in _PAIR_METRICS}
        loss = pair_loss
        if self.cfg.objective.sft_weight > 0:
            nll = self.global_mean(terms["nll_chosen"].sum(), batch, "chosen_tokens")
            loss = loss + self.cfg.objective.sft_weight * nll
            shares["train/nll_chosen"] = nll
        shares["train/loss"] = loss
        self.log_step_shares(batch, shares, prog_bar=("train/loss",))
        return loss * self.backward_scale()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        terms = self._pair_terms(batch, "val")
        self.collect_val(batch["index"], torch.stack([terms[k].detach().double() for k in _VAL_COLUMNS], dim=-1))

    def val_metrics(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        cols = dict(zip(_VAL_COLUMNS, values.unbind(-1)))
        out = {k: cols[k].mean() for k in _PAIR_METRICS}
        out["loss"] = cols["loss"].mean()
        if self.cfg.objective.sft_weight > 0:
            out["nll_chosen"] = cols["nll_chosen"].sum() / cols["chosen_tokens"].sum().clamp(min=1)
            out["loss"] = out["loss"] + self.cfg.objective.sft_weight * out["nll_chosen"]
        return out


# Per-pair means logged as train/<name> and val/<name> (TRL's W&B panel names).
_PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                 "logps/chosen", "logps/rejected")
_VAL_COLUMNS = ("loss", *_PAIR_METRICS, "nll_chosen", "chosen_tokens")
