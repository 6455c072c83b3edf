"""``callbacks=throughput``: training speed as the figures that matter, to every logger.

    python train.py callbacks=[default,throughput] logger=wandb
    python train.py callbacks=[default,throughput] callbacks.throughput.peak_tflops=312   # unknown GPU

Every ``log_every_n_steps`` training batches, over the batches since the last log (all ranks):

- ``perf/tokens_per_s``: non-padding input tokens per second; ``perf/tokens_per_s_per_device``;
- ``perf/trained_tokens_per_s``: tokens carrying a loss label;
- ``perf/samples_per_s``: conversations (SFT) or preference pairs (DPO) per second;
- ``perf/padding_fraction``: share of the token slots the forward computes that is padding (0 for
  packed batches, which are flattened to their real tokens first);
- ``perf/step_time_s``: mean seconds per training batch;
- ``perf/mfu`` (CUDA, or any device given ``peak_tflops``): model FLOPs per second over the devices' peak. Model FLOPs are the ones
  the policy's training step needs, from the model config: ``6 x`` the non-embedding parameters
  per input token, ``6 x`` the lm_head per trained token (rolemrc applies the head only there),
  and causal attention, ``12 x layers x attention width`` per (query, visible key) pair, counted
  from the batch's real sequence lengths (so packing is credited with what it saves, not with
  the [T, T] square). The DPO reference forward is not counted. The peak comes from the device
  name (bf16 dense; halved for 32-bit training, i.e. TF32) or ``peak_tflops``.

Time spent in validation is left out. Counts stay on the device between logs (no per-step sync).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

from rolemrc.models import family
from rolemrc.objectives import IGNORE_INDEX

log = logging.getLogger(__name__)

# Dense bf16 tensor-core peaks (TFLOP/s) by device-name fragment, most specific first.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("GH200", 989.4),
    ("H200", 989.4),
    ("H100", 989.4),
    ("H800", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("RTX 4090", 165.2),
    ("RTX 3090", 71.0),
    ("V100", 125.0),  # fp16
    ("T4", 65.0),  # fp16
)


def peak_flops(device_name: str, precision: str) -> float | None:
    """Peak FLOP/s of one device for ``precision`` (Lightning's string), None if unknown."""
    for fragment, tflops in PEAK_BF16_TFLOPS:
        if fragment.lower() in device_name.lower():
            return tflops * 1e12 / (2.0 if str(precision).startswith("32") else 1.0)
    return None


def model_flop_coefficients(model: nn.Module) -> tuple[float, float, float]:
    """``(per input token, per trained token, per attended query-key pair)`` training FLOPs."""
    base = family.base_model(model)
    embed, head = family.input_embeddings(base), family.output_head(base)
    skip = {id(p) for m in (embed, head) if m is not None for p in m.parameters()}
    body = sum(p.numel() for p in base.parameters() if id(p) not in skip)
    head_params = sum(p.numel() for p in head.parameters()) if head is not None else 0
    cfg = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    heads = getattr(cfg, "num_attention_heads", 0)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // max(heads, 1)
    width = heads * head_dim
    return 6.0 * body, 6.0 * head_params, 12.0 * cfg.num_hidden_layers * width


def batch_counts(batch: dict[str, Tensor]) -> Tensor:
    """``[5]`` float64 on the batch's device: input tokens, trained tokens, samples, tensor slots,
    attended (query, key) pairs. Tensor ops only, so nothing waits for the device."""
    ids = batch["input_ids"]
    if "sequence_ids" in batch:
        real = (batch["sequence_ids"] >= 0).sum()
    elif "attention_mask" in batch and batch["attention_mask"].dim() == 2:
        real = batch["attention_mask"].sum()
    else:
        real = torch.tensor(ids.numel(), device=ids.device)
    if "segments" in batch and batch["segments"].numel():
        seg = batch["segments"].double()
        n, ctx = seg[:, 2] - seg[:, 1], seg[:, 4] - seg[:, 3]
        pairs = (n * (n + 1) / 2 + n * ctx).sum()
    else:
        if "attention_mask" in batch and batch["attention_mask"].dim() == 2:
            n = batch["attention_mask"].sum(-1).double()
        else:
            n = torch.full((ids.shape[0],), float(ids.shape[-1]), device=ids.device, dtype=torch.float64)
        pairs = (n * (n + 1) / 2).sum()
    trained = (batch["labels"][..., 1:] != IGNORE_INDEX).sum() if "labels" in batch else real * 0
    samples = batch["index"].shape[0] if "index" in batch else ids.shape[0]
    # Packed rows are flattened to their real tokens before the forward (rolemrc's default
    # routes), so they compute no padding slot; padded batches compute every slot.
    slots = real if "segments" in batch else torch.tensor(float(ids.numel()), device=ids.device)
    values = [real.double(), trained.double(), torch.tensor(float(samples), device=ids.device, dtype=torch.float64),
              slots.double(), pairs.to(ids.device)]
    return torch.stack([v.reshape(()).to(ids.device) for v in values])


class ValidationPause(L.Callback):
    """Keeps validation time out of training time: ``_paused``, the seconds spent validating
    (each subclass resets it where its clock starts)."""

    _paused = 0.0
    _pause_start: float | None = None

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pause_start = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._pause_start is not None:
            self._paused += time.perf_counter() - self._pause_start
        self._pause_start = None


class ThroughputMonitor(ValidationPause):
    """Logs ``perf/*`` throughput (and MFU on CUDA); see the module docstring.

    Args:
        log_every_n_steps: training batches between logs (None: the trainer's ``log_every_n_steps``).
        peak_tflops: peak TFLOP/s of one device, overriding the name lookup (e.g. an unlisted GPU).
        skip_first: batches left out at the start (allocator warm-up, kernel autotuning).
    """

    def __init__(self, log_every_n_steps: int | None = None, peak_tflops: float | None = None,
                 skip_first: int = 1) -> None:
        self.every = log_every_n_steps
        self.peak_tflops = peak_tflops
        self.skip_first = skip_first
        self.last: dict[str, float] = {}  # the latest logged figures (also for tests/benchmarks)
        self._coef: tuple[float, float, float] | None = None
        self._peak: float | None = None
        self._reset()
        self._seen = 0

    def _reset(self) -> None:
        self._counts: Tensor | None = None
        self._batches = 0
        self._t0: float | None = None
        self._paused = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        try:
            self._coef = model_flop_coefficients(pl_module.model)
        except (AttributeError, TypeError) as err:  # not a module over a transformers causal LM: no MFU
            log.info("throughput: no model FLOPs (%s); MFU not logged", err)
            self._coef = None
        self._peak = None
        if self.peak_tflops:  # named by the user: MFU against it on any device
            self._peak = float(self.peak_tflops) * 1e12
        elif pl_module.device.type == "cuda":
            name = torch.cuda.get_device_name(pl_module.device)
            self._peak = peak_flops(name, trainer.precision)
            if self._peak is None:
                log.warning("throughput: unknown peak FLOP/s for %r; set callbacks.throughput.peak_tflops "
                            "to log perf/mfu", name)
        self._reset()
        self._seen = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self._seen += 1
        if self._seen <= self.skip_first:  # the clock starts at the end of the skipped batches
            self._t0 = time.perf_counter()
            return
        counts = batch_counts(batch)
        self._counts = counts if self._counts is None else self._counts + counts
        self._batches += 1
        every = self.every or trainer.log_every_n_steps or 1
        if self._batches >= every:
            self._log(trainer)

    def _log(self, trainer: L.Trainer) -> None:
        now = time.perf_counter()
        elapsed = now - (now if self._t0 is None else self._t0) - self._paused
        world = trainer.world_size
        counts = self._counts
        if world > 1:  # one collective per log, every rank reaches it at the same batch
            counts = trainer.strategy.reduce(counts, reduce_op="sum")
        real, trained, samples, slots, pairs = counts.tolist()
        batches = self._batches
        self._reset()
        self._t0 = now
        if elapsed <= 0:
            return
        metrics = {
            "perf/tokens_per_s": real / elapsed,
            "perf/tokens_per_s_per_device": real / elapsed / world,
            "perf/trained_tokens_per_s": trained / elapsed,
            "perf/samples_per_s": samples / elapsed,
            "perf/padding_fraction": 1.0 - real / max(slots, 1.0),
            "perf/step_time_s": elapsed / batches,
        }
        if self._coef is not None and self._peak:
            per_token, per_trained, per_pair = self._coef
            flops = per_token * real + per_trained * trained + per_pair * pairs
            metrics["perf/mfu"] = flops / elapsed / (self._peak * world)
        self.last = metrics
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
