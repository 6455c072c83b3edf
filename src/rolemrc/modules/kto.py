"""KTO: desirable and undesirable examples against a reference
(:func:`rolemrc.objectives.kto.kto_loss`), as TRL 1.16's KTOTrainer computes it.

Each preference pair of the batch is split into one desirable (its chosen row) and one undesirable
(its rejected row) example: a micro-batch of ``B`` pairs is ``2B`` examples, chosen rows then
rejected rows, fed to TRL's loss in that order. The KL estimate (``loss_type=kto``) comes from the
same rows re-paired as TRL re-pairs a batch: example ``j`` gets its own prompt with example
``j - 1``'s completion (example 0 the last one's), scored by the policy and the reference without
gradient, the estimate averaged over ranks before its clamp as TRL gathers it
(``data.batch_size=1`` is refused: its two re-paired examples would share their prompt).
The reference is DPO's (``objective.reference``: copy | adapter). Logged under TRL's names:
``kl``, ``rewards/chosen``/``rejected``/``margins`` (``beta`` x the log ratio, means over the
desirable / undesirable examples), ``logps/chosen``/``rejected`` (summed log-probs).
"""

from __future__ import annotations

import torch

from rolemrc.modules.dpo import DPOModule
from rolemrc.objectives.dpo import pair_mean
from rolemrc.objectives.kto import kto_kl, kto_loss
from rolemrc.objectives.logprobs import IGNORE_INDEX

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def mismatched(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch's rows re-paired for the KL estimate: row ``j`` is row ``j``'s prompt followed by
    row ``j - 1``'s completion (row 0: the last row's), right-padded, the completion labelled."""
    ids, labels = batch["input_ids"], batch["labels"]
    mask = batch.get("attention_mask")
    attended = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
    response = labels != IGNORE_INDEX
    prompts = [ids[r][attended[r] & ~response[r]] for r in range(ids.shape[0])]
    completions = [ids[r][response[r]] for r in range(ids.shape[0])]
    rows = [(prompts[j], completions[j - 1]) for j in range(ids.shape[0])]
    width = max(len(p) + len(c) for p, c in rows)
    out_ids = ids.new_zeros((len(rows), width))
    out_labels = ids.new_full((len(rows), width), IGNORE_INDEX)
    out_mask = ids.new_zeros((len(rows), width))
    for j, (p, c) in enumerate(rows):
        n = len(p) + len(c)
        out_ids[j, :n] = torch.cat([p, c])
        out_labels[j, len(p):n] = c
        out_mask[j, :n] = 1
    return {"input_ids": out_ids, "labels": out_labels, "attention_mask": out_mask, "index": batch["index"]}


def _rank_mean(value: torch.Tensor) -> torch.Tensor:
    """The mean of a scalar over the ranks (each rank's micro-batch estimate, as TRL gathers them)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    value = value.clone()
    dist.all_reduce(value)
    return value / dist.get_world_size()


class KTOModule(DPOModule):
    """``objective``: the kto node (loss_type, beta, desirable_weight, undesirable_weight, reference,
    logprob_chunk_size); ``reference``: as DPO's (:func:`rolemrc.modules.reference.make_reference`)."""

    def packs_with_context(self) -> bool:
        return False

    def on_before_batch_transfer(self, batch: dict[str, torch.Tensor], dataloader_idx: int) -> dict[str, torch.Tensor]:
        """The KL rows are built from the collated batch on the host, where its values are (the
        memory simulation hands its batch through this hook too, before its tensors become fake)."""
        if self.objective.loss_type == "kto" and "kl_input_ids" not in batch:
            batch = {**batch, **{f"kl_{k}": v for k, v in mismatched(batch).items() if k != "index"}}
        return batch

    # the step's passes without gradient: the memory simulation runs each as a module call
    no_grad_passes = ("reference_logps", "kl_logps")

    def kl_logps(self, batch: dict[str, torch.Tensor], stage: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's and the reference's summed log-probs ``[2B]`` of the batch's KL rows (no gradient)."""
        kl_batch = {k: batch[f"kl_{k}"] for k in ("input_ids", "labels", "attention_mask")}
        kl_batch["index"] = batch["index"]
        with torch.no_grad():
            return self.pair_logps(self.model, kl_batch).logps, self.reference.logps(self, kl_batch, stage)

    def _terms(self, batch: dict[str, torch.Tensor], stage: str) -> dict[str, torch.Tensor]:
        """Per-pair terms of one micro-batch (``[B]``; ``loss``: the pair's two examples' losses summed)."""
        o = self.objective
        b = batch["index"].shape[0]
        policy, _ = self.pair_logps(self.model, batch)
        ref = self.reference_logps(batch, stage)
        if o.loss_type == "kto":
            if "kl_input_ids" not in batch:  # a batch that did not come through the trainer's hook
                batch = self.on_before_batch_transfer(batch, 0)
            kl = kto_kl(*self.kl_logps(batch, stage), rank_mean=_rank_mean)
        else:  # apo_zero_unpaired: no KL term (TRL logs 0)
            kl = policy.new_zeros(())
        desirable = torch.arange(2 * b, device=policy.device) < b  # chosen rows, then rejected rows
        out = kto_loss(policy, ref, desirable, kl, beta=o.beta, desirable_weight=o.desirable_weight,
                       undesirable_weight=o.undesirable_weight, loss_type=o.loss_type)
        return {"loss": out.losses[:b] + out.losses[b:], "rewards/chosen": out.rewards[:b],
                "rewards/rejected": out.rewards[b:], "rewards/margins": out.rewards[:b] - out.rewards[b:],
                "logps/chosen": policy[:b].detach(), "logps/rejected": policy[b:].detach(),
                "kl": kl.detach().expand(b)}

    def step_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The mean over the step's examples (two per pair: the step's pairs x 2); the metrics are
        per-pair means over the step, ``kl`` each micro-batch's estimate weighted by its pairs."""
        terms = self._terms(batch, "train")
        pairs = batch["step_pairs"]
        loss = pair_mean(terms["loss"], pairs) / 2
        shares = {f"train/{k}": pair_mean(terms[k].detach().double(), pairs) for k in (*METRICS, "kl")}
        return loss, shares

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        terms = self._terms(batch, "val")
        self.collect_val(batch["index"], torch.stack([terms[k].detach().double() for k in _VAL], dim=-1))

    def val_metrics(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        cols = dict(zip(_VAL, values.unbind(-1)))
        out = {k: pair_mean(cols[k]) for k in (*METRICS, "kl")}
        out["loss"] = pair_mean(cols["loss"]) / 2
        return out


_VAL = ("loss", *METRICS, "kl")
