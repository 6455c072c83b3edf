"""KTO: desirable and undesirable examples against a reference
(:func:`rolemrc.objectives.kto.kto_loss`), as TRL 1.16's KTOTrainer computes it.

Two batch layouts (:class:`rolemrc.data.datamodule.ChatDataModule`, data kind ``unpaired``):

* unpaired examples (``data.unpaired``): ``N`` rows, each prompt + completion, ``label`` [N] saying
  which are desirable; the step's totals ``step_examples`` / ``step_desirable``;
* pairs split (``data.unpaired`` empty): ``B`` pairs are ``2B`` examples, the chosen rows
  (desirable) then the rejected rows (undesirable), the step's totals ``step_pairs``.

The KL estimate (``loss_type=kto``) comes from the micro-batch's rows re-paired as TRL re-pairs a
batch: example ``j`` gets its own prompt with example ``j - 1``'s completion (example 0 the last
one's), scored by the policy and the reference without gradient, the estimate averaged over ranks
before its clamp as TRL gathers it (``data.batch_size=1`` is refused: a lone example would be
paired with its own completion). TRL fixes that pairing once, over consecutive examples of its
(then unshuffled) dataset; here it is the shuffled micro-batch's own, the same set of completions
as the batch's rewards use, which is what TRL's comment asks of it. The reference is DPO's
(``objective.reference``: copy | adapter). The loss is the mean over the step's examples; logged
under TRL's names: ``kl``, ``rewards/chosen``/``rejected`` (``beta`` x the log ratio, means over
the step's desirable / undesirable examples; NaN for a step without any, where TRL logs nothing),
``rewards/margins`` (their difference), ``logps/chosen``/``rejected`` (summed log-probs).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rolemrc.modules.dpo import DPOModule
from rolemrc.objectives.dpo import pair_mean
from rolemrc.objectives.kto import kto_kl, kto_loss, weight_advice
from rolemrc.objectives.logprobs import IGNORE_INDEX

log = logging.getLogger(__name__)



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


def layout(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(desirable [N] bool, example ids [N], the step's examples, the step's desirable examples)``
    of either batch layout (the totals None where the batch carries none, e.g. validation)."""
    index = batch["index"]
    if "label" in batch:  # unpaired examples
        examples, desirable = batch.get("step_examples"), batch.get("step_desirable")
        return batch["label"].bool(), index, examples, desirable
    b = index.shape[0]  # pairs split: chosen rows, then rejected rows
    desirable_rows = torch.arange(2 * b, device=index.device) < b
    pairs = batch.get("step_pairs")
    return desirable_rows, torch.cat([2 * index, 2 * index + 1]), None if pairs is None else 2 * pairs, pairs


def _group_mean(values: torch.Tensor, mask: torch.Tensor, total: torch.Tensor | None) -> torch.Tensor:
    """The share of a mean over the step's examples in ``mask``: the sum over this micro-batch's
    divided by ``total`` (the step's count; None: this batch's); NaN when there are none. (No
    boolean indexing and no host sync: the memory simulation runs this on fake tensors.)"""
    total = mask.sum() if total is None else total
    summed = torch.where(mask, values, torch.zeros_like(values)).sum()
    total = total.to(values.dtype)
    return torch.where(total > 0, summed / total.clamp(min=1), torch.full_like(summed, float("nan")))


class KTOModule(DPOModule):
    """``objective``: the kto node (loss_type, beta, desirable_weight, undesirable_weight, reference,
    logprob_chunk_size); ``reference``: as DPO's (:func:`rolemrc.modules.reference.make_reference`)."""

    def packs_with_context(self) -> bool:
        return False

    def pair_logps(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        """Summed completion log-probs and token counts of each row ``[N]`` (either layout)."""
        return self.sequence_logps(model, batch, batch["input_ids"].shape[0])

    def on_fit_start(self) -> None:
        """Warns, as TRL does, when unbalanced training labels meet weights outside the paper's range."""
        super().on_fit_start()
        report = getattr(getattr(self.trainer, "datamodule", None), "report", {}).get("train", {})
        if "desirable" in report and self.trainer.is_global_zero:
            advice = weight_advice(report["desirable"], report["undesirable"], self.objective.desirable_weight,
                                   self.objective.undesirable_weight)
            if advice:
                log.warning(advice)

    def on_before_batch_transfer(self, batch: dict[str, torch.Tensor], dataloader_idx: int) -> dict[str, torch.Tensor]:
        """The KL rows are built from the collated batch on the host, where its values are (the
        memory simulation hands its batch through this hook too, before its tensors become fake)."""
        if self.objective.loss_type == "kto" and "kl_input_ids" not in batch:
            batch = {**batch, **{f"kl_{k}": v for k, v in mismatched(batch).items() if k != "index"}}
        return batch

    # the step's passes without gradient: the memory simulation runs each as a module call
    no_grad_passes = ("reference_logps", "kl_logps")

    def kl_logps(self, batch: dict[str, torch.Tensor], stage: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's and the reference's summed log-probs ``[N]`` of the batch's KL rows (no gradient)."""
        kl_batch = {k: batch[f"kl_{k}"] for k in ("input_ids", "labels", "attention_mask")}
        kl_batch["index"] = batch["index"]
        with torch.no_grad():
            return self.pair_logps(self.model, kl_batch).logps, self.reference.logps(self, kl_batch, stage)

    def _terms(self, batch: dict[str, torch.Tensor], stage: str) -> dict[str, torch.Tensor]:
        """Per-example terms of one micro-batch (all ``[N]``)."""
        o = self.objective
        desirable, _, _, _ = layout(batch)
        policy, _ = self.pair_logps(self.model, batch)
        ref = self.reference_logps(batch, stage)
        if o.loss_type == "kto":
            if "kl_input_ids" not in batch:  # a batch that did not come through the trainer's hook
                batch = self.on_before_batch_transfer(batch, 0)
            kl = kto_kl(*self.kl_logps(batch, stage), rank_mean=_rank_mean)
        else:  # apo_zero_unpaired: no KL term (TRL logs 0)
            kl = policy.new_zeros(())
        out = kto_loss(policy, ref, desirable, kl, beta=o.beta, desirable_weight=o.desirable_weight,
                       undesirable_weight=o.undesirable_weight, loss_type=o.loss_type)
        return {"loss": out.losses, "desirable": desirable, "reward": out.rewards, "logps": policy.detach(),
                "kl": kl.detach().expand(policy.shape[0])}

    @staticmethod
    def _metrics(terms: dict[str, torch.Tensor], examples: torch.Tensor | None,
                 desirable_total: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """TRL's metrics (shares of the step's means when the step's totals are given)."""
        good = terms["desirable"]
        bad_total = None if examples is None else examples - desirable_total
        out = {"rewards/chosen": _group_mean(terms["reward"].double(), good, desirable_total),
               "rewards/rejected": _group_mean(terms["reward"].double(), ~good, bad_total),
               "logps/chosen": _group_mean(terms["logps"].double(), good, desirable_total),
               "logps/rejected": _group_mean(terms["logps"].double(), ~good, bad_total)}
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out

    def step_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The mean over the step's examples; the metrics are means over the step's desirable /
        undesirable examples, ``kl`` each micro-batch's estimate weighted by its examples."""
        terms = self._terms(batch, "train")
        _, _, examples, desirable = layout(batch)
        loss = pair_mean(terms["loss"], examples)
        shares = {f"train/{k}": v for k, v in self._metrics(terms, examples, desirable).items()}
        # margins: a difference of means, so its share is the difference of the shares (sums add up)
        shares["train/kl"] = pair_mean(terms["kl"].double(), examples)
        return loss, shares

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        terms = self._terms(batch, "val")
        _, ids, _, _ = layout(batch)
        self.collect_val(ids, torch.stack([terms[k].detach().double() for k in _VAL], dim=-1))

    def val_metrics(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        cols = dict(zip(_VAL, values.unbind(-1)))
        terms = {**cols, "desirable": cols["desirable"].bool()}
        out = self._metrics(terms, None, None)
        out["kl"] = cols["kl"].mean()
        out["loss"] = cols["loss"].mean()
        return out


_VAL = ("loss", "desirable", "reward", "logps", "kl")
