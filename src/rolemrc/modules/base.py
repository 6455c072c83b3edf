"""What SFT and DPO share: the policy model, its forward to per-sequence log-probs (the
objectives' :func:`~rolemrc.objectives.sequence_logprobs` through the model's
:class:`~rolemrc.models.logprob_head.LogprobHead`), loss normalisation over the global batch,
the optimizer/schedule and FSDP2 sharding.

Every loss term is computed by :mod:`rolemrc.objectives`; the modules only feed them.

A module receives what it needs, not the whole config: the model, the ``objective`` and
``optim`` settings (schema dataclasses), the precision policy and (for FSDP2) the ``strategy``
settings."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from torch import nn

from rolemrc.config import SCHEDULERS, TrainStep
from rolemrc.models.forward import policy_hidden
from rolemrc.models.loading import decoder_and_head
from rolemrc.models.precision import PrecisionPolicy, cast_trainable
from rolemrc.models.sharding import shard_model
from rolemrc.modules.reference import Reference
from rolemrc.objectives.dpo import average_logps, pair_mean, preference_loss
from rolemrc.objectives.logprobs import SequenceLogProbs, shift_labels


def _gather_rows(index: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All ranks' rows (counts may differ per rank: packs hold different numbers of items)."""
    import torch.distributed as dist

    n = torch.tensor([index.shape[0]], device=index.device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    width = int(max(s.item() for s in sizes))
    pad = width - index.shape[0]
    idx = torch.cat([index, index.new_full((pad,), -1)])
    val = torch.cat([values, values.new_zeros((pad, values.shape[1]))])
    idx_all = [torch.empty_like(idx) for _ in sizes]
    val_all = [torch.empty_like(val) for _ in sizes]
    dist.all_gather(idx_all, idx)
    dist.all_gather(val_all, val)
    keep = torch.cat(idx_all) >= 0
    return torch.cat(idx_all)[keep], torch.cat(val_all)[keep]


def lr_lambda(kind: str, warmup: int, total: int, min_ratio: float):
    """Multiplier of the peak lr at optimizer step ``s`` (0-based): linear warmup that reaches the
    peak on its last step (``(s + 1) / warmup``: no step is spent at lr 0), then from step
    ``warmup`` on cosine/linear decay to ``min_ratio`` at step ``total`` (as transformers'
    schedules) or constant."""
    if kind not in SCHEDULERS:
        raise ValueError(f"optim.scheduler must be cosine, linear or constant, got {kind!r}")

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "cosine":
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            decay = 1.0 - progress
        return min_ratio + (1.0 - min_ratio) * decay

    return f


class TokensSeen:
    """TRL's ``num_tokens`` (its ``state.num_input_tokens_seen``): the tokens the run has trained on
    (GRPO: every rollout's prompt and completion tokens; a reward model: its pairs' tokens), over every
    rank; in every checkpoint under ``key`` (a :func:`run_state_parts` part), so a resumed run counts on."""

    per_rank = False  # counted over every rank: one state

    def __init__(self, key: str) -> None:
        self.key, self.count = key, 0

    def state_dict(self) -> dict[str, Any]:
        return {self.key: self.count}

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        self.count = int(checkpoint.get(self.key, 0))


class PolicyModule(L.LightningModule):
    """Holds ``self.model`` (a transformers causal LM, maybe PEFT-wrapped), and declares every
    hook the run, resume, the reference and sizing call on an objective's module, each with its
    default here (the objective contract, docs/architecture.md): an objective overrides only what
    it does differently; nothing outside asks a module what it has."""

    # ---- the contract: attributes and hooks with their defaults ------------------------------
    reference: Reference | None = None  # a frozen reference's log-probs (rolemrc.modules.reference), or none
    # Methods of the step that run without gradient (the reference's passes, KTO's KL rows): the
    # memory simulation runs each as a module call.
    no_grad_passes: tuple[str, ...] = ()
    memory_note: str = ""  # what of the step the memory simulation leaves out (printed with its report)

    def __init__(self, model: nn.Module, objective: Any, optim: Any, policy: PrecisionPolicy,
                 sharding: Any = None, packed_attention: str = "auto") -> None:
        super().__init__()
        # from_pretrained returns a model in eval mode and Lightning keeps module modes as it
        # finds them: without this, a model loaded from a path trains with dropout off and, worse,
        # with gradient checkpointing silently inactive (transformers checkpoints only in training).
        model.train()
        self.model = model
        self.objective = objective
        self.optim = optim
        self.policy = policy
        self.sharding = sharding  # the strategy node: FSDP2 unit options (used under a device mesh)
        self.packed_attention = packed_attention  # model.packed_attention: route for packed rows
        self._sharded = False
        self._val_items: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.summary_notes: dict[str, str] = {}  # run summary figure -> what it is the mean of (GRPO's rewards)

    def run_state_parts(self) -> tuple[Any, ...]:
        """Objects saved in every checkpoint and restored on resume (:class:`rolemrc.run.state.RunState`)."""
        return () if self.reference is None else (self.reference,)

    @property
    def ref_model(self) -> nn.Module | None:
        """The frozen reference copy (``copy`` mode), kept out of the module tree; else None."""
        models = self.reference.models() if self.reference is not None else []
        return models[0] if models else None

    def reference_table_tag(self) -> str:
        """What a precomputed reference table's columns depend on besides the rows (KTO: its KL pairing)."""
        return ""

    def table_logps(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        """A precomputed reference's columns of a batch: its pairs' summed log-probs, chosen then rejected."""
        return self.sequence_logps(self.model, batch, 2 * batch["index"].shape[0]).logps

    # sizing (rolemrc.sizing.simulate): an objective whose step is not the collated rows it trains on says so
    @staticmethod
    def memory_batch(step: TrainStep, batch_size: int, vocab: int, length: int | None = None) -> dict[str, torch.Tensor] | None:
        """The simulated micro-batch, laid out by the objective (GRPO's rollouts); None: the run's collator's."""
        return None

    @staticmethod
    def memory_rollout(step: TrainStep, batch_size: int) -> dict[str, Any] | None:
        """A generation phase of the step to simulate before it (GRPO's ``generate``); None: none."""
        return None

    @staticmethod
    def memory_resident(step: TrainStep, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors the step keeps on the device beside its micro-batch (GRPO: its other rollouts)."""
        return {}

    def memory_mask_counts(self, batch: dict[str, torch.Tensor]) -> dict[tuple[int, ...], int]:
        """Boolean masks of the step besides the scored labels' (shape -> true count), for the simulation."""
        return {}

    # ---- forward -------------------------------------------------------------------------
    def sequence_logps(self, model: nn.Module, batch: dict[str, torch.Tensor], n: int,
                       sequence_ids: torch.Tensor | None = None) -> SequenceLogProbs:
        """Summed log-probs of the labelled tokens of each of the batch's ``n`` sequences, and
        their counts (``[n]`` fp32, ``[n]`` long).

        The lm_head is applied only at labelled positions, in chunks (never ``[B*T, V]``
        logits). Packed batches (``segments``, ``sequence_ids``, ``position_ids`` from
        :class:`~rolemrc.data.collate.PackedCollator`) attend within each piece only, and a
        piece's last token is never trained to predict the next piece's first. ``sequence_ids``
        (``[B, T]``, -1 for none) overrides which of the ``n`` sums each position adds to.
        """
        decoder, head = decoder_and_head(model)
        head.chunk_size = self.objective.logprob_chunk_size
        hidden = policy_hidden(model, decoder, batch, self.packs_with_context(), self.packed_attention)
        ids = batch.get("sequence_ids") if sequence_ids is None else sequence_ids
        return head(hidden, labels=self.trained_labels(batch), sequence_ids=ids, num_sequences=n)

    def trained_labels(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The labels the head scores, aligned with the hidden states (``-100``: not scored). The
        memory simulation counts the scored positions from these too."""
        labels = batch.get("shifted_labels")
        if labels is None:
            labels = shift_labels(batch["labels"], batch.get("sequence_ids"))
        return labels

    def packs_with_context(self) -> bool:
        """Whether packed pieces may see a context span (shared-prompt DPO); SFT: never."""
        return False

    # ---- loss normalisation over the global batch -----------------------------------------
    # A micro-batch's loss is its share of the optimizer step's mean: the objectives' functions
    # (token_nll, preference_loss) divide its sums by the step's totals (label tokens, pairs,
    # chosen tokens) over every micro-batch of every rank, which come with the batch
    # (``step_tokens``, ``step_pairs``, ``step_chosen_tokens``; see
    # :class:`~rolemrc.data.sampler.StepBatchSampler`). Summed over the step's micro-batches and
    # ranks, the shares are the mean over the whole global batch, however it is cut, a short last
    # step of an epoch included.
    def backward_scale(self) -> int:
        """Lightning divides each micro-batch's loss by ``accumulate_grad_batches`` and DDP/FSDP
        average gradients over ranks: the loss handed back is multiplied by both, so that the
        gradient that reaches the optimizer is the gradient of the sum of the micro-batches'
        shares, i.e. of the global-batch mean."""
        return self.trainer.accumulate_grad_batches * self.trainer.world_size

    def log_step_shares(self, batch: dict[str, torch.Tensor], shares: dict[str, torch.Tensor],
                        prog_bar: tuple[str, ...] = ()) -> None:
        """Add up per-micro-batch shares over a step's micro-batches; when the step's last
        micro-batch is done, sum them over ranks and log them once for the step: the logged
        ``train/loss`` is the loss the optimizer step minimised."""
        acc = self.__dict__.setdefault("_step_acc", {})
        for key, value in shares.items():
            acc[key] = acc.get(key, 0.0) + value.detach().double()
        if not bool(batch["step_end"]):
            return
        self.__dict__["_step_acc"] = {}
        for key, value in acc.items():
            self.log(key, value.float(), prog_bar=key in prog_bar, batch_size=1, reduce_fx="sum",
                     sync_dist=self.trainer.world_size > 1, on_step=True, on_epoch=False)

    # ---- the step: one function, used by training and by the memory simulation -------------
    def step_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share of the step's loss and of its logged metrics (``train/<name>``
        -> share). :meth:`training_step` logs and scales them; ``python -m rolemrc.memory --simulate``
        (:mod:`rolemrc.sizing.simulate`) runs exactly this, so each objective is simulated as itself."""
        raise NotImplementedError

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, shares = self.step_loss(batch)
        self.log_step_shares(batch, {**shares, "train/loss": loss}, prog_bar=("train/loss",))
        return loss * self.backward_scale()

    # ---- validation: per-item statistics, reduced once over the whole set ---------------
    def on_validation_epoch_start(self) -> None:
        self._val_items: list[tuple[torch.Tensor, torch.Tensor]] = []

    def collect_val(self, index: torch.Tensor, values: torch.Tensor) -> None:
        """Keep per-item statistics ``values`` ``[N, K]`` of dataset items ``index`` ``[N]``."""
        self._val_items.append((index.detach(), values.detach().double()))

    def on_validation_epoch_end(self) -> None:
        """Reduce the whole validation set once: gather every rank's items, count each item once
        (the sampler repeats a few to give ranks equal shares) and log :meth:`val_metrics`."""
        items = self._val_items
        if not items:
            return
        index = torch.cat([i for i, _ in items])
        values = torch.cat([v for _, v in items])
        if self.trainer.world_size > 1:
            index, values = _gather_rows(index, values)
        order = torch.argsort(index, stable=True)
        index, values = index[order], values[order]
        first = torch.ones_like(index, dtype=torch.bool)
        first[1:] = index[1:] != index[:-1]
        metrics = self.val_metrics(values[first])
        self.log_dict({f"val/{k}": v.float() for k, v in metrics.items()}, batch_size=1, sync_dist=False,
                      prog_bar=False)
        self._val_items = []

    def val_metrics(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        optimizers = self.trainer.optimizers
        if optimizers:
            self.log("train/lr", optimizers[0].param_groups[0]["lr"], batch_size=1)

    # ---- optimisation --------------------------------------------------------------------
    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's step, then the reference's turn (a synced copy mixes the policy in,
        :mod:`rolemrc.modules.reference`): before any callback sees the step's end, so a checkpoint
        taken then holds the reference as it is after the step."""
        super().optimizer_step(*args, **kwargs)
        if self.reference is not None:  # the step is counted once this hook returns: this is step global_step + 1
            self.reference.after_optimizer_step(self.model, self.trainer.global_step + 1)

    def configure_optimizers(self) -> Any:
        o = self.optim
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                                      fused=self.fused_adamw(params) or None)
        total = int(self.trainer.estimated_stepping_batches)
        warmup = int(round(o.warmup_ratio * total))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(o.scheduler, warmup, total, o.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def fused_adamw(self, params: list[torch.nn.Parameter]) -> bool:
        """torch's fused AdamW for plain CPU parameters: torch's default there is its single-tensor
        loop, about ten elementwise ops per parameter per step (each a parallel region), which
        benchmarks/profile_sft.py measured at up to ~10% of a packed proxy SFT step with two
        threads; the fused kernel is one vectorised pass per parameter (transformers' default
        ``adamw_torch_fused``). CUDA keeps torch's default, the multi-tensor ``foreach`` kernels
        that the memory simulation (:mod:`rolemrc.sizing.simulate`) models; sharded (DTensor)
        parameters keep it too, and so do ``*-mixed`` precisions (Lightning's AMP plugin refuses
        gradient clipping with an optimizer that unscales internally, as fused ones do)."""
        return (self.device_mesh is None and bool(params) and "mixed" not in str(self.trainer.precision)
                and all(p.device.type == "cpu" and type(p.data) is torch.Tensor for p in params))

    # ---- sharding ------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Trainable parameters become fp32 masters (:mod:`rolemrc.models.precision`); FSDP2
        shards each decoder layer, then the rest, casting unit by unit (see rolemrc.run.strategies)."""
        if self._sharded:
            return
        ref = self.ref_model
        if ref is not None:  # frozen: stored as the precision policy says (bf16-true: bf16 like the policy)
            if next(ref.parameters()).dtype != self.policy.frozen:
                ref.to(dtype=self.policy.frozen)
            ref.to(self.device)
        if self.device_mesh is None:
            cast_trainable(self.model, self.policy.master)
        else:
            for m in self.models_to_shard():
                shard_model(m, self.device_mesh, self.sharding, self.policy.master)
        self._sharded = True

    def models_to_shard(self) -> list[nn.Module]:
        """The policy, and the reference's frozen models (sharded and cast like it)."""
        return [self.model] + (self.reference.models() if self.reference is not None else [])


class PairModule(PolicyModule):
    """An objective over preference pairs (DPO, SimPO, ORPO, a user's own): it gives :meth:`pair_terms`
    and, when needed, :meth:`pair_loss`; training, validation and their per-pair metrics are here."""

    pair_metrics: tuple[str, ...] = ()  # per-pair means logged as train/<name> and val/<name>
    nll_metric = "nll_loss"  # the chosen NLL term's logged name
    val_extra: tuple[str, ...] = ("chosen_sum", "chosen_tokens")  # columns pair_loss reads at validation

    sft_weight = 0.0  # the weight of the chosen responses' token-mean NLL in pair_loss

    @property
    def val_columns(self) -> tuple[str, ...]:
        return ("loss", *self.pair_metrics, *self.val_extra)

    def pair_logps(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> SequenceLogProbs:
        """Summed response log-probs and token counts ``[2B]``, chosen then rejected."""
        return self.sequence_logps(model, batch, 2 * batch["index"].shape[0])

    def pair_terms(self, batch: dict[str, torch.Tensor], stage: str) -> dict[str, torch.Tensor]:
        """Per-pair loss terms and metrics of one micro-batch (all ``[B]``)."""
        raise NotImplementedError

    def pair_loss(self, terms: dict[str, torch.Tensor], pairs: torch.Tensor | None = None,
                  chosen_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, other logged terms): a micro-batch's share of its step's (``pairs``, ``chosen_tokens``:
        the step's totals), or (None) the validation set's; default: :func:`~rolemrc.objectives.dpo.preference_loss`."""
        tokens = terms["chosen_tokens"].sum() if chosen_tokens is None else chosen_tokens
        loss, nll = preference_loss(terms["loss"], terms["chosen_sum"], sft_weight=self.sft_weight, num_pairs=pairs,
                                    num_chosen_tokens=tokens)
        return loss, ({} if nll is None else {self.nll_metric: nll})

    def step_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        terms = self.pair_terms(batch, "train")
        pairs = batch["step_pairs"]
        loss, more = self.pair_loss(terms, pairs, batch["step_chosen_tokens"])
        shares = {f"train/{k}": pair_mean(terms[k].detach().double(), pairs) for k in self.pair_metrics}
        return loss, {**shares, **{f"train/{k}": v for k, v in more.items()}}

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        terms = self.pair_terms(batch, "val")
        self.collect_val(batch["index"], torch.stack([terms[k].detach().double() for k in self.val_columns], dim=-1))

    def val_metrics(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        cols = dict(zip(self.val_columns, values.unbind(-1)))
        out = {k: pair_mean(cols[k]) for k in self.pair_metrics}
        out["loss"], more = self.pair_loss(cols)
        return {**out, **more}


# Per-pair means logged as train/<name> and val/<name> (TRL's W&B panel names).
REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                  "logps/rejected")


def reward_metrics(chosen: torch.Tensor, rejected: torch.Tensor, prefix: str = "rewards") -> dict[str, torch.Tensor]:
    """TRL's four metrics of the pairs' rewards ``[B]``: ``<prefix>/chosen``, ``/rejected``,
    ``/accuracies`` (chosen above rejected) and ``/margins``."""
    return {f"{prefix}/chosen": chosen, f"{prefix}/rejected": rejected,
            f"{prefix}/accuracies": (chosen > rejected).double(), f"{prefix}/margins": chosen - rejected}


def reward_terms(out: Any, logps: torch.Tensor, counts: torch.Tensor) -> dict[str, torch.Tensor]:
    """A reference-free pair loss's terms under TRL's names: ``loss``, ``rewards/*``, ``logps/*`` (average)."""
    b = counts.shape[0] // 2
    avg = average_logps(logps, counts).detach()
    return {"loss": out.losses, **reward_metrics(out.chosen_rewards, out.rejected_rewards), "logps/chosen": avg[:b],
            "logps/rejected": avg[b:]}
