"""``strategy=single|ddp|fsdp`` -> a Lightning strategy (the sharding itself is
:func:`rolemrc.models.sharding.shard_model`, called from the module's ``configure_model``)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy

from rolemrc.checkpointing.io import AtomicModelParallelStrategy

log = logging.getLogger(__name__)


def world_size(t: Any) -> int:
    """devices x num_nodes, with ``devices`` an int, a list of ids or "auto"."""
    devices = t.devices
    if isinstance(devices, str):
        if devices not in ("auto", "-1") and not devices.isdigit():
            raise ValueError(f"trainer.devices={devices!r}: give a number of devices")
        devices = int(devices) if devices.isdigit() else max(1, torch.cuda.device_count())
    elif not isinstance(devices, int):
        devices = len(devices)
    elif devices == -1:
        devices = max(1, torch.cuda.device_count())
    return devices * t.num_nodes


def build_strategy(s: Any, model: Any, trainer: Any) -> Any:
    """The Lightning strategy for the ``strategy`` group ``s`` (checked against the ``model``
    group's options first; FSDP's mesh from the ``trainer`` group's devices)."""
    if s.name == "single":
        return "auto"
    if s.name == "ddp":
        return DDPStrategy(find_unused_parameters=False)
    if s.name == "fsdp":
        if model.quantization.load_in_4bit:
            raise ValueError("strategy=fsdp with 4-bit QLoRA is not supported here (bitsandbytes 4-bit params "
                             "cannot be sharded by FSDP2); use strategy=single or ddp for QLoRA")
        # Pure data parallel: every device of every node holds one shard (no tensor parallelism).
        return AtomicModelParallelStrategy(data_parallel_size=world_size(trainer), tensor_parallel_size=1,
                                           save_distributed_checkpoint=True)
    raise ValueError(f"strategy.name must be single, ddp or fsdp, got {s.name!r}")
