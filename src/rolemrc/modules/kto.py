"""KTO: desirable and undesirable examples against a reference
(:func:`rolemrc.objectives.kto.kto_loss`), as TRL 1.16's KTOTrainer computes it.

Two batch layouts (:class:`rolemrc.data.datamodule.ChatDataModule`, data kind ``unpaired``):

* unpaired examples (``data.unpaired``): ``N`` rows, each prompt + completion, ``label`` [N] saying
  which are desirable; the step's totals ``step_examples`` / ``step_desirable``;
* pairs split (``data.unpaired`` empty): ``B`` pairs are ``2B`` examples, the chosen rows
  (desirable) then the rejected rows (undesirable), the step's totals ``step_pairs``.

The KL estimate (``loss_type=kto``) comes from mismatched rows, fixed per dataset example as
TRL 1.16's KTOTrainer fixes them once when it prepares its dataset (:func:`fixed_kl_completions`):
the stage's examples in dataset order are cut into chunks of ``data.batch_size`` (TRL's
``per_device_train_batch_size``, for its eval set too) and example ``i`` gets its own prompt with
example ``i - 1``'s completion of its chunk (the chunk's first example its last one's). With the
pairs split, a chunk of ``data.batch_size`` pairs gives its chosen examples, then its rejected ones
(the rows of its unshuffled micro-batch). Unshuffled on one device, each micro-batch is a chunk and
its KL rows are its own rows rotated by one (:func:`mismatched`), TRL's batch exactly; shuffled
(TRL refuses shuffling with KL) or strided over ranks, each example keeps its KL row but a
micro-batch's KL completions are no longer its own set. The rows are scored by the policy and the
reference without gradient, the estimate averaged over ranks before its clamp as TRL gathers it
(``data.batch_size=1`` is refused: a lone example would be paired with its own completion).
Being fixed, the KL rows' reference log-probs fit a precomputed table (``objective.reference=
precomputed``: one more column per row, :meth:`KTOModule.table_logps`). The reference is DPO's
(``objective.reference``: copy | adapter | precomputed). The loss is the mean over the step's examples; logged
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
    """The batch's rows re-paired within the batch: row ``j`` is row ``j``'s prompt followed by row
    ``j - 1``'s completion (row 0: the last row's). This is the fixed pairing
    (:func:`fixed_kl_completions`) of an unshuffled micro-batch; used for a batch whose stage rows
    are not at hand (one built outside the trainer, the memory simulation's)."""
    response = batch["labels"] != IGNORE_INDEX
    completions = [batch["input_ids"][r][response[r]] for r in range(batch["input_ids"].shape[0])]
    return _kl_rows(batch, [completions[j - 1] for j in range(len(completions))])


def kl_partner(i: int, n: int, chunk: int) -> int:
    """TRL's fixed KL pairing: the dataset's ``n`` examples cut into consecutive chunks of
    ``chunk``, example ``i`` takes the completion of example ``i - 1`` of its chunk (the chunk's
    first example: its last one's)."""
    start = i - i % chunk
    return i - 1 if i > start else min(start + chunk, n) - 1


def _pair_side(v: int, n_pairs: int, chunk: int) -> tuple[int, str]:
    """Pairs split: virtual example ``v`` -> (pair, side). Each chunk of ``chunk`` pairs is its
    chosen examples then its rejected ones (the rows of its unshuffled micro-batch)."""
    start = (v // (2 * chunk)) * chunk  # the chunk's first pair
    m = min(chunk, n_pairs - start)
    k = v - 2 * start
    return (start + k, "chosen_ids") if k < m else (start + k - m, "rejected_ids")


def _pair_position(pair: int, side: int, n_pairs: int, chunk: int) -> int:
    """Pairs split: the virtual example of ``pair``'s chosen (``side`` 0) or rejected (1) row."""
    start = pair - pair % chunk
    return 2 * start + side * min(chunk, n_pairs - start) + pair - start


def fixed_kl_completions(rows: Any, index: list[int], chunk: int, pairs: bool) -> list[list[int]]:
    """The KL completion of each row of a batch (its ``index``; pairs split: the chosen rows then
    the rejected rows), fixed per dataset example as TRL fixes it (:func:`kl_partner` over the
    stage's examples in dataset order; pairs split: pair ``p`` gives examples chosen then rejected
    per chunk of ``chunk`` pairs, the ``2 * chunk`` rows of one unshuffled micro-batch)."""
    n = len(rows)
    if not pairs:
        return [rows[kl_partner(i, n, chunk)]["completion_ids"] for i in index]
    out = []
    for side in (0, 1):
        for p in index:
            v = kl_partner(_pair_position(p, side, n, chunk), 2 * n, 2 * chunk)
            q, key = _pair_side(v, n, chunk)
            out.append(rows[q][key])
    return out


def _kl_rows(batch: dict[str, torch.Tensor], completions: list[Any]) -> dict[str, torch.Tensor]:
    """Row ``j``: the batch's row ``j``'s prompt followed by ``completions[j]``, right-padded, the
    completion labelled."""
    ids, labels = batch["input_ids"], batch["labels"]
    mask = batch.get("attention_mask")
    attended = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
    response = labels != IGNORE_INDEX
    rows = [(ids[r][attended[r] & ~response[r]], torch.as_tensor(completions[r], dtype=ids.dtype, device=ids.device))
            for r in range(ids.shape[0])]
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
        trainer = self._trainer
        return self._with_kl(batch, "train" if trainer is None or trainer.training else "val")

    def _with_kl(self, batch: dict[str, torch.Tensor], stage: str) -> dict[str, torch.Tensor]:
        """``batch`` with its KL rows (``kl_input_ids`` ...), for ``loss_type=kto``."""
        if self.objective.loss_type != "kto" or "kl_input_ids" in batch:
            return batch
        return {**batch, **{f"kl_{k}": v for k, v in self._kl_batch(batch, stage).items() if k != "index"}}

    def _kl_batch(self, batch: dict[str, torch.Tensor], stage: str) -> dict[str, torch.Tensor]:
        """The KL rows: each example's fixed partner (:func:`fixed_kl_completions`, over the stage's
        rows, chunks of ``data.batch_size``); without the stage's rows at hand (no trainer or
        datamodule), the batch's own rotation (:func:`mismatched`)."""
        dm = getattr(self._trainer, "datamodule", None)
        rows = None if dm is None else (dm.train_rows if stage == "train" else dm.val_rows)
        if rows is None or not len(rows):
            return mismatched(batch)
        completions = fixed_kl_completions(rows, batch["index"].tolist(), dm.cfg.batch_size, "label" not in batch)
        return _kl_rows(batch, completions)

    # the step's passes without gradient: the memory simulation runs each as a module call
    no_grad_passes = ("reference_logps", "kl_logps")

    def reference_table_tag(self) -> str:
        """What a precomputed table's columns depend on besides the rows: the KL pairing's chunk."""
        if self.objective.loss_type != "kto":
            return ""
        dm = getattr(self._trainer, "datamodule", None)
        return f"-kl{dm.cfg.batch_size}" if dm is not None else "-kl"

    def table_logps(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        """A precomputed reference's columns of a batch: the rows' summed log-probs, then (``kto``)
        their KL rows' (each example's fixed partner, so one table serves every shuffled epoch)."""
        logps = self.pair_logps(self.model, batch).logps
        if self.objective.loss_type != "kto":
            return logps
        kl = {k: v.to(logps.device) for k, v in self._kl_batch(batch, stage).items()}
        return torch.cat([logps, self.pair_logps(self.model, kl).logps])

    def kl_logps(self, batch: dict[str, torch.Tensor], stage: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's and the reference's summed log-probs ``[N]`` of the batch's KL rows (no gradient)."""
        kl_batch = {k: batch[f"kl_{k}"] for k in ("input_ids", "labels", "attention_mask")}
        kl_batch["index"] = batch["index"]
        with torch.no_grad():
            if self.reference.mode == "precomputed":  # the table's KL columns, after the rows'
                ref = self.reference.logps(self, batch, stage)[batch["input_ids"].shape[0]:]
            else:
                ref = self.reference.logps(self, kl_batch, stage)
            return self.pair_logps(self.model, kl_batch).logps, ref

    def _terms(self, batch: dict[str, torch.Tensor], stage: str) -> dict[str, torch.Tensor]:
        """Per-example terms of one micro-batch (all ``[N]``)."""
        o = self.objective
        desirable, _, _, _ = layout(batch)
        policy, _ = self.pair_logps(self.model, batch)
        # [:N]: a precomputed table's lookup also holds the KL rows' columns, after the rows'
        # (:meth:`table_logps`); the memory simulation's stand-in, two per index
        ref = self.reference_logps(batch, stage)[: policy.shape[0]]
        if o.loss_type == "kto":
            batch = self._with_kl(batch, stage)  # a batch that did not come through the trainer's hook
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
