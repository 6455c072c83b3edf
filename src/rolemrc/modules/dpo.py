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
from rolemrc.objectives.dpo import average_logps, dpo_loss, metrics

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
        self._model_key = fingerprint(model) if self.mode == "precomputed" else ""
        self.ref_tables: dict[str, torch.Tensor] = {}

    @property
    def ref_model(self) -> nn.Module | None:
        return self._ref[0] if self._ref else None

    def models_to_shard(self) -> list[nn.Module]:
        return [self.model] + self._ref

    def configure_model(self) -> None:
        if self.ref_model is not None:
            self.ref_model.to(self.device)
        super().configure_model()

    # ---- log-probs ------------------------------------------------------------------------
    def sequence_logps(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed response log-probs and token counts: ([2B], [2B]), chosen then rejected.

        Unpacked batches hold one sequence per row; packed / shared-prompt ones say which
        sequence each position belongs to (``sequence_ids``: pair j's chosen side is j, its
        rejected side B + j).
        """
        logps, mask = self.token_logps(model, batch)
        if "sequence_ids" in batch:
            owner = batch["sequence_ids"][mask]  # same row-major order as logps
            n = 2 * batch["index"].shape[0]
        else:
            owner = mask.nonzero()[:, 0]
            n = mask.shape[0]
        sums = torch.zeros(n, dtype=logps.dtype, device=logps.device).index_add(0, owner, logps)
        counts = torch.zeros(n, dtype=torch.long, device=logps.device).index_add(0, owner, torch.ones_like(owner))
        return sums, counts

    def packs_with_context(self) -> bool:
        return bool(self.cfg.objective.share_prompt)

    @torch.no_grad()
    def reference_logps(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        if self.mode == "copy":
            return self.sequence_logps(self.ref_model, batch)[0]
        if self.mode == "adapter":
            with self.model.disable_adapter():
                return self.sequence_logps(self.model, batch)[0]
        table = self.ref_tables[stage].to(self.device)
        pair = table[batch["index"]]  # [B, 2]: chosen, rejected
        return torch.cat([pair[:, 0], pair[:, 1]])

    # ---- precomputed reference ------------------------------------------------------------
    def on_fit_start(self) -> None:
        if self.mode != "precomputed":
            return
        dm = self.datamodule
        for stage, rows in (("train", dm.train_rows), ("val", dm.val_rows)):
            if rows:
                self.ref_tables[stage] = self._reference_table(rows, stage)

    def _cache_path(self, rows: list[dict]) -> Path:
        root = self.cfg.objective.reference_cache_dir or str(Path(self.cfg.run_dir) / "ref_cache")
        return Path(root) / f"ref_logps-{self._model_key}-{rows_fingerprint(rows)}.safetensors"

    def _reference_table(self, rows: list[dict], stage: str) -> torch.Tensor:
        path = self._cache_path(rows)
        if path.exists():
            log.info("reference log-probs (%s) from cache %s", stage, path)
            return load_file(path)["logps"]
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = ResumableSampler(len(rows), False, 0, rank, world)
        loader = DataLoader(rows, batch_size=self.cfg.data.batch_size, sampler=sampler,
                            collate_fn=self.datamodule.collator())
        was_training = self.model.training
        self.model.eval()
        index, values = [], []
        show = self.trainer.is_global_zero and self.trainer.progress_bar_callback is not None
        with torch.no_grad():
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
    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
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
        loss = out.losses.mean()
        logged = {f"{stage}/{k}": v for k, v in metrics(out, policy[:b], policy[b:]).items()}
        if o.sft_weight > 0:
            nll = -policy[:b].sum() / counts[:b].sum().clamp(min=1)
            loss = loss + o.sft_weight * nll
            logged[f"{stage}/nll_chosen"] = nll.detach()
        self.log_dict(logged, batch_size=b, sync_dist=stage == "val", prog_bar=False)
        self.log(f"{stage}/loss", loss.detach(), batch_size=b, prog_bar=True, sync_dist=stage == "val")
        return loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "val")
