"""Where a DPO run's reference log-probs come from: the three ``objective.reference`` modes behind
one small interface (:class:`Reference`).

- ``copy``: a frozen copy of the starting policy, in eval mode (sharded and cast like it);
- ``adapter``: the policy's own base weights with the LoRA adapter switched off, in eval mode like
  the copy (no dropout), the policy's mode restored after;
- ``precomputed``: one pass over the pairs before training, kept as one table per stage (``[N, 2]``:
  chosen, rejected summed log-probs; KTO: ``[N, 1]`` per unpaired example, each column followed by
  its KL row's column with ``loss_type=kto``), row ``i`` of the table for row ``i`` of the stage (the
  data store's stable row index, the batches' ``index``). No reference weights are held during training.

Precomputed tables always come from the *initial* weights: computed at fit start (under the
trainer's precision context, as training computes), or read from the on-disk cache keyed by the
initial weights (fingerprinted at construction, before any checkpoint is restored into them), the
encoded rows (data, tokenizer, template, max lengths), precision, attention implementation and
FSDP compute dtype. Every checkpoint carries the tables (saved and restored with the run's state,
:mod:`rolemrc.run.state`), so a run resumed in any folder finds them
there. A resume whose checkpoint lacks them and whose cache is gone is refused when the policy
already holds the checkpoint's trained weights (single/DDP restore before ``on_fit_start``); FSDP2
(ModelParallelStrategy) restores after it, so the tables are read from the checkpoint early (by the
reader the builder hands in: checkpoint storage is :mod:`rolemrc.checkpointing`'s) and, failing
that, computed from the still-initial weights. A table computed from trained weights
is never used nor written to the cache.

The copy can follow the policy (TR-DPO, TRL's ``sync_ref_model``): built with ``sync=(alpha,
steps)``, after every ``steps``-th optimizer step each of its parameters becomes ``alpha x
policy + (1 - alpha) x reference`` (:func:`mixup_`; buffers stay). The mix is elementwise, so
under FSDP2 each rank mixes its own shards of the two models (sharded alike), with no
communication; under DDP every rank mixes its full replicas alike. Once mixed, the copy's
parameters travel with every checkpoint (``reference_model``: full tensors, gathered from the
shards under FSDP2) and are restored on resume. The adapter reference (the policy's own base
weights) and the precomputed tables have nothing to mix: the configuration refuses them.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from rolemrc.config import REFERENCE_MODES
from rolemrc.data.sampler import ResumableSampler
from rolemrc.fileio import atomic_save
from rolemrc.models.loading import eval_mode

if TYPE_CHECKING:
    from rolemrc.modules.dpo import DPOModule

log = logging.getLogger(__name__)

CKPT_MODEL = "reference_model"  # {parameter name: full tensor} of a synced copy reference

CKPT_TABLES = "reference_logps"  # {stage: [N, 2] float32} in every precomputed run's checkpoint
CKPT_ROWS = "reference_rows"  # {stage: rows_fingerprint} of the rows those tables belong to
ReadCheckpoint = Callable[[Any, Iterable[str]], dict[str, Any]]  # (checkpoint path, keys) -> the entries it has


def fingerprint(model: nn.Module) -> str:
    """A hash of names, shapes, dtypes and a strided sample of every parameter's values."""
    h = hashlib.sha256()
    for name, p in model.state_dict().items():
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        h.update(flat[::step].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def rows_fingerprint(rows: Sequence[dict]) -> str:
    """Hash of the encoded pairs: changes with the data, the tokenizer, the template and the
    max lengths (which truncate them). Rows from the data store carry theirs (a hash of the
    store's checksummed arrays and of the stage's row list), so it costs no pass over them."""
    stored = getattr(rows, "fingerprint", None)
    if stored is not None:
        return f"s{stored}"
    h = hashlib.sha256()
    for r in rows:
        if "completion_ids" in r:  # an unpaired example (KTO)
            h.update(json.dumps([r["prompt_ids"], r["completion_ids"], bool(r["label"])]).encode())
        else:
            h.update(json.dumps([r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]]).encode())
    return h.hexdigest()[:16]


class Reference:
    """One reference mode. ``module`` is the :class:`~rolemrc.modules.dpo.DPOModule` (policy,
    trainer, ``pair_logps``)."""

    mode: str
    per_rank = False  # its checkpoint entries are the same on every rank (rolemrc.run.state.RunState)

    def models(self) -> list[nn.Module]:
        """Frozen models besides the policy, sharded and cast like it (kept out of the module
        tree, so neither trained nor written to checkpoints)."""
        return []

    def logps(self, module: DPOModule, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        """Summed response log-probs ``[2B]`` of the batch's pairs, chosen then rejected."""
        raise NotImplementedError

    def on_fit_start(self, module: DPOModule) -> None:
        pass

    def after_optimizer_step(self, policy: nn.Module, step: int) -> None:
        """Called after optimizer step ``step`` (1-based): a synced copy mixes the policy in."""

    def state_dict(self) -> dict[str, Any]:
        """Entries added to every checkpoint (by :class:`rolemrc.run.state.RunState`)."""
        return {}

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Called with the whole checkpoint dict on restore."""


class CopyReference(Reference):
    mode = "copy"

    def __init__(self, model: nn.Module, sync: tuple[float, int] | None = None) -> None:
        self.model = copy.deepcopy(model).eval()
        self.model.requires_grad_(False)
        self.sync = sync  # (alpha, every so many optimizer steps): TR-DPO's mixup; None: fixed
        self.synced = False  # mixed at least once (then its weights go into checkpoints)

    def models(self) -> list[nn.Module]:
        return [self.model]

    def logps(self, module: DPOModule, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        with torch.no_grad():
            return module.pair_logps(self.model, batch).logps

    def after_optimizer_step(self, policy: nn.Module, step: int) -> None:
        if self.sync is not None and step > 0 and step % self.sync[1] == 0:
            mixup_(self.model, policy, self.sync[0])
            self.synced = True

    def state_dict(self) -> dict[str, Any]:
        if not self.synced:  # still the starting policy: rebuilt from it on resume
            return {}
        return {CKPT_MODEL: {name: _full(p).detach().cpu() for name, p in self.model.named_parameters()}}

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(CKPT_MODEL)
        if saved is None:
            return
        if self.sync is None:
            log.warning("the checkpoint holds a synced reference, but objective.sync_ref_model=false: "
                        "the reference is the starting policy")
            return
        params = dict(self.model.named_parameters())
        if set(params) != set(saved):
            raise ValueError("the checkpoint's synced reference has other parameters than this run's model "
                             f"({len(saved)} vs {len(params)}): resume with the model the run started from")
        with torch.no_grad():
            for name, p in params.items():
                _local(p).copy_(_shard_like(saved[name], p))
        self.synced = True


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 (DTensor) parameter, the tensor itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (collective: every rank calls it), the tensor otherwise."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _shard_like(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``value`` (a whole tensor) laid out as ``p``: this rank's shard of it under FSDP2."""
    if isinstance(p, DTensor):
        value = value.to(device=p.device, dtype=p.dtype)
        return distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None).to_local()
    return value


@torch.no_grad()
def mixup_(reference: nn.Module, policy: nn.Module, alpha: float) -> None:
    """TR-DPO's soft update in place: each reference parameter becomes ``alpha x policy + (1 - alpha)
    x reference``, in the reference's dtype (the policy's fp32 masters enter as they are). The two
    models' parameters pair in order (the reference is a copy of the policy); under FSDP2 each
    rank updates its local shards (the models are sharded alike), no communication."""
    ref_params, pol_params = list(reference.parameters()), list(policy.parameters())
    if len(ref_params) != len(pol_params):
        raise ValueError(f"reference and policy differ in parameters ({len(ref_params)} vs {len(pol_params)})")
    for r, p in zip(ref_params, pol_params):
        r_local, p_local = _local(r), _local(p)
        if r_local.shape != p_local.shape:
            raise ValueError(f"reference and policy shards differ in shape ({tuple(r_local.shape)} vs "
                             f"{tuple(p_local.shape)}): they must be sharded alike")
        r_local.mul_(1.0 - alpha).add_(p_local.to(r_local.device), alpha=alpha)


class AdapterReference(Reference):
    mode = "adapter"

    def __init__(self, model: nn.Module) -> None:
        if not hasattr(model, "disable_adapter"):
            raise ValueError("objective.reference=adapter needs a LoRA model: set model.peft.enabled=true")

    def logps(self, module: DPOModule, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        with torch.no_grad(), eval_mode(module.model), module.model.disable_adapter():
            return module.pair_logps(module.model, batch).logps


class PrecomputedReference(Reference):
    mode = "precomputed"

    def __init__(self, key: str, cache_dir: str, batch_size: int, read_checkpoint: ReadCheckpoint | None = None) -> None:
        self.key = key  # the initial weights (fingerprinted before anything is restored) + settings
        self.cache_dir = cache_dir
        self.batch_size = batch_size
        self.read_checkpoint = read_checkpoint  # (path, keys) -> entries; None: never read early
        self.tables: dict[str, torch.Tensor] = {}
        self.rows: dict[str, str] = {}  # stage -> rows_fingerprint of its table (unknown: absent)

    def logps(self, module: DPOModule, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        # [B, 2] (pairs: chosen, rejected) or [N, 1] (single rows, e.g. KTO's unpaired examples),
        # in the batch's row order: each column's rows after the previous column's
        cols = self.tables[stage].to(module.device)[batch["index"]]
        return cols.T.reshape(-1)

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if not self.tables:
            return {}
        return {CKPT_TABLES: {k: v.cpu() for k, v in self.tables.items()}, CKPT_ROWS: dict(self.rows)}

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        tables, rows = checkpoint.get(CKPT_TABLES) or {}, checkpoint.get(CKPT_ROWS) or {}
        for stage, table in tables.items():
            if self._accept(stage, rows.get(stage)):
                self.tables[stage] = table.float()
                if stage in rows:
                    self.rows[stage] = rows[stage]

    def _accept(self, stage: str, rows_fp: str | None) -> bool:
        """A checkpoint's table serves only the rows it was computed for (FSDP restores after
        ``on_fit_start``, when this run's rows are known)."""
        mine = self.rows.get(stage)
        if mine is None or rows_fp is None or rows_fp == mine:
            return True
        log.warning("the checkpoint's reference log-probs (%s) belong to other data (rows %s, this run's %s): "
                    "not used", stage, rows_fp, mine)
        return False

    # ---- fit start ----------------------------------------------------------------------------
    def on_fit_start(self, module: DPOModule) -> None:
        dm = module.trainer.datamodule
        for stage, rows in (("train", dm.train_rows), ("val", dm.val_rows)):
            if rows is not None and len(rows):
                self._ensure(module, stage, rows)

    def _ensure(self, module: DPOModule, stage: str, rows: Sequence[dict]) -> None:
        # the module's tag: what its columns depend on besides the rows (KTO: the KL pairing)
        fp = rows_fingerprint(rows) + module.reference_table_tag()
        have = self.tables.get(stage)
        if have is not None and self.rows.get(stage, fp) == fp and have.shape[0] == len(rows):
            self.rows[stage] = fp  # restored with the checkpoint (single/DDP restore before fit start)
            return
        self.tables.pop(stage, None)
        self.rows[stage] = fp
        trainer = module.trainer
        restored_later = trainer.ckpt_path is not None and trainer.strategy.restore_checkpoint_after_setup
        if restored_later:  # FSDP2: the checkpoint's tables now, rather than a pass over the data
            found = _broadcast(trainer, self._checkpoint_tables(trainer.ckpt_path) if trainer.is_global_zero else None)
            if found is not None:
                self.load_state_dict(found)
                if stage in self.tables and self.tables[stage].shape[0] == len(rows):
                    log.info("reference log-probs (%s) from checkpoint %s", stage, trainer.ckpt_path)
                    return
                self.tables.pop(stage, None)
        path = self.cache_path(fp)
        table = _broadcast(trainer, load_file(path)["logps"] if trainer.is_global_zero and path.exists() else None)
        if table is not None and table.shape[0] == len(rows):
            log.info("reference log-probs (%s) from cache %s", stage, path)
            self.tables[stage] = table
            return
        if trainer.ckpt_path is not None and not restored_later:
            raise RuntimeError(
                f"objective.reference=precomputed: resuming from {trainer.ckpt_path}, which holds no reference "
                f"log-probs for this run's {stage} pairs, and there is no cache of them at {path}. The policy "
                "already holds the checkpoint's trained weights, so they cannot be recomputed from it (the "
                "reference must be the initial model). Point objective.reference_cache_dir at the first run's "
                "ref_cache folder (and use the same data, model, precision and attention settings), or start "
                "the run again from its initial model.")
        self.tables[stage] = table = compute_table(module, rows, stage, self.batch_size)  # the initial weights
        if trainer.is_global_zero:
            atomic_save(path, lambda tmp: save_file({"logps": table}, tmp))
            log.info("reference log-probs (%s, %d pairs) written to %s", stage, len(rows), path)

    def cache_path(self, rows_fp: str) -> Path:
        """The cache file of a table: the initial weights and settings, the rows (and module tag)."""
        return Path(self.cache_dir) / f"ref_logps-{self.key}-{rows_fp}.safetensors"

    def _checkpoint_tables(self, path: Any) -> dict[str, Any] | None:
        """The reference entries of the checkpoint being resumed, read without its weights by
        the builder's ``read_checkpoint``; None when it has none or cannot be read."""
        if self.read_checkpoint is None:
            return None
        try:
            found = self.read_checkpoint(path, (CKPT_TABLES, CKPT_ROWS))
        except Exception as e:  # noqa: BLE001 - computing from the still-initial weights is correct too
            log.warning("could not read reference log-probs from %s (%s): computing them", path, e)
            return None
        if CKPT_TABLES not in found:
            return None
        return {CKPT_TABLES: found[CKPT_TABLES], CKPT_ROWS: found.get(CKPT_ROWS, {})}


def reference_key(model: nn.Module, settings: str) -> str:
    """The initial weights + ``settings``: what changes their log-probs besides the rows
    (precision, attention implementation, FSDP2's compute dtype; the builder spells them)."""
    return hashlib.sha256(f"{fingerprint(model)}|{settings}".encode()).hexdigest()[:16]


@torch.no_grad()
def compute_table(module: DPOModule, rows: Sequence[dict], stage: str, batch_size: int) -> torch.Tensor:
    """``[len(rows), 2]`` summed log-probs (chosen, rejected) of the policy as it is now (``[len(rows),
    1]`` where a batch has one row per index, e.g. KTO's unpaired examples; a module's
    ``table_logps(batch, stage)`` adds columns, e.g. KTO's KL rows), in eval mode under the
    trainer's precision context; each rank computes a strided share (collective)."""
    trainer = module.trainer
    world, rank = trainer.world_size, trainer.global_rank
    sampler = ResumableSampler(len(rows), False, 0, rank, world)
    loader = DataLoader(rows, batch_size=batch_size, sampler=sampler, collate_fn=trainer.datamodule.collator())
    index, values = [], []
    show = trainer.is_global_zero and trainer.progress_bar_callback is not None
    with eval_mode(module.model), trainer.precision_plugin.forward_context():  # as training computes
        for batch in tqdm(loader, desc=f"reference log-probs ({stage})", unit="batch", disable=not show):
            batch = {k: v.to(module.device) for k, v in batch.items()}
            sums = module.table_logps(batch, stage)  # KTO: its rows', then their KL rows'; DPO: its pairs'
            b = batch["index"].shape[0]
            index.append(batch["index"])
            values.append(sums.reshape(-1, b).T)  # [b, rows per index]: pairs' chosen, rejected columns
    index_t, values_t = torch.cat(index), torch.cat(values)
    if world > 1:  # every rank computed a strided share; gather all of them
        index_t = module.all_gather(index_t).reshape(-1)
        values_t = module.all_gather(values_t).reshape(-1, values_t.shape[-1])
    table = torch.zeros(len(rows), values_t.shape[-1], dtype=torch.float32)
    table[index_t.cpu()] = values_t.float().cpu()
    return table


def _broadcast(trainer: Any, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank: all ranks take the same path (collective compute or not),
    even when only rank 0 sees a file."""
    return trainer.strategy.broadcast(obj, src=0) if trainer.world_size > 1 else obj


def make_reference(model: nn.Module, mode: str, *, cache_dir: str | None = None, batch_size: int = 1,
                   settings: str = "", read_checkpoint: ReadCheckpoint | None = None,
                   sync: tuple[float, int] | None = None) -> Reference:
    """The reference of ``objective.reference`` (``mode``), built from the initial ``model``.
    Precomputed: its tables go to ``cache_dir``, computed ``batch_size`` pairs at a time, keyed by
    the weights and ``settings`` (:func:`reference_key`); ``read_checkpoint(path, keys)``: a
    checkpoint's entries without its weights (the builder passes
    :func:`rolemrc.checkpointing.state.read_checkpoint_entries`), for a precomputed reference
    resumed under FSDP2, whose checkpoint is restored after fit start. ``sync=(alpha, steps)``:
    the copy mixes the policy in every ``steps`` optimizer steps (TR-DPO; copy only)."""
    if sync is not None and mode != "copy":
        raise ValueError(f"objective.sync_ref_model needs objective.reference=copy, got {mode}")
    if mode == "copy":
        return CopyReference(model, sync)
    if mode == "adapter":
        return AdapterReference(model)
    if mode == "precomputed":
        if cache_dir is None:
            raise ValueError("objective.reference=precomputed needs a cache folder")
        return PrecomputedReference(reference_key(model, settings), cache_dir, batch_size, read_checkpoint)
    raise ValueError(f"objective.reference must be one of {REFERENCE_MODES}, got {mode!r}")
