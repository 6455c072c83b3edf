"""FSDP2 sharding of a transformers decoder: one ``fully_shard`` unit per decoder layer, then
the embeddings, the decoder (final norm) and the output head, each unit cast to fp32 masters
just before it is sharded."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from rolemrc.models.family import decoder_layers, fsdp_units, tied_embeddings
from rolemrc.models.precision import cast_trainable

log = logging.getLogger(__name__)


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def shard_model(model: nn.Module, device_mesh: Any, s: Any, master_dtype: torch.dtype = torch.float32) -> None:
    """FSDP2 ``fully_shard`` on each unit of :func:`rolemrc.models.family.fsdp_units`: each decoder
    layer, the embeddings, the decoder (final norm) and lm_head.

    rolemrc calls the decoder and the lm_head as modules (not the top-level model), so each
    is its own FSDP unit and its forward hooks gather its parameters. Tied embeddings (one
    parameter for ``embed_tokens`` and ``lm_head``) are sharded once, in one unit holding both
    modules, so they stay one parameter that receives both gradients. Each unit's trainable
    parameters are cast to ``master_dtype`` (fp32 masters) just before it is sharded, so no rank
    ever holds a full fp32 copy of the model; ``strategy.param_dtype`` is what the gathered
    parameters compute in.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    # The full mesh would silently become HSDP; shard over the data-parallel dimension.
    mesh = device_mesh["data_parallel"]
    mp_policy = MixedPrecisionPolicy(param_dtype=_dtype(s.param_dtype), reduce_dtype=_dtype(s.reduce_dtype))
    offload_policy = CPUOffloadPolicy() if s.cpu_offload else OffloadPolicy()
    kwargs = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)

    def shard(unit: nn.Module | list[nn.Module]) -> None:
        for m in unit if isinstance(unit, list) else [unit]:
            cast_trainable(m, master_dtype)
        fully_shard(unit, **kwargs)

    # activation checkpointing: model.gradient_checkpointing, enabled when it loaded
    for unit in fsdp_units(model):
        shard(unit)
    tied = tied_embeddings(model)
    log.info("FSDP2: sharded %d decoder layers over %d ranks%s", len(decoder_layers(model)), mesh.size(),
             " (tied embeddings: one unit for embed_tokens and lm_head)" if tied else "")
