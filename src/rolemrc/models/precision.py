"""The precision policy of a training run: fp32 master weights, half-precision compute.

``trainer.precision`` says how the run computes, ``model.dtype`` how frozen and inference weights
are stored:

- trainable parameters (the full model, or the LoRA adapters) and so their gradients and AdamW
  states are fp32 ("master weights") under ``32-true``, ``bf16-mixed`` and ``16-mixed``; the
  matmuls of ``*-mixed`` runs are bf16/fp16 through autocast (single, DDP) or FSDP2's
  ``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=float32)`` over fp32 shards;
- frozen weights (the DPO reference copy, the LoRA/QLoRA base) stay in ``model.dtype``;
- ``bf16-true`` / ``16-true`` store everything in half precision, masters included: AdamW steps
  smaller than the weight's rounding step (bf16: 2**-8 of its magnitude) are lost. The run
  warns, naming the reason, unless only LoRA adapters are trained.

Exports are written in ``model.dtype`` from the masters (rounded once).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)

_HALF = {"bf16": torch.bfloat16, "16": torch.float16}


@dataclass(frozen=True)
class PrecisionPolicy:
    master: torch.dtype  # trainable parameters, their gradients and optimizer states
    frozen: torch.dtype  # weights that are not trained: reference copy, LoRA/QLoRA base
    compute: torch.dtype  # what the matmuls run in


def precision_policy(precision: str, model_dtype: str) -> PrecisionPolicy:
    """The policy for ``trainer.precision`` and ``model.dtype`` (see the module docstring)."""
    name = str(precision)
    frozen = getattr(torch, model_dtype)
    kind, _, mode = name.partition("-")
    if kind in _HALF and mode == "true":
        return PrecisionPolicy(master=_HALF[kind], frozen=_HALF[kind], compute=_HALF[kind])
    if kind in _HALF and mode == "mixed":
        return PrecisionPolicy(master=torch.float32, frozen=frozen, compute=_HALF[kind])
    if kind in ("32", "64"):
        return PrecisionPolicy(master=torch.float32, frozen=frozen, compute=torch.float32)
    raise ValueError(f"trainer.precision={name!r}: expected 32-true, bf16-mixed, 16-mixed, bf16-true or 16-true")


def check_policy(precision: str, model_dtype: str, full_finetune: bool) -> PrecisionPolicy:
    """The policy, with a warning when it trains half-precision master weights."""
    policy = precision_policy(precision, model_dtype)
    if policy.master != torch.float32 and full_finetune:
        log.warning("trainer.precision=%s stores the trained weights and AdamW states in %s: updates smaller than "
                    "a weight's rounding step (bf16: ~0.4%% of it) are lost, e.g. most of DPO's at lr 4e-7. "
                    "Use trainer.precision=bf16-mixed (fp32 masters, bf16 compute) unless memory forbids it.",
                    precision, str(policy.master).removeprefix("torch."))
    return policy


def cast_trainable(module: nn.Module, dtype: torch.dtype) -> int:
    """Cast the trainable floating-point parameters of ``module`` to ``dtype`` in place (frozen
    ones and buffers stay); returns how many were cast."""
    n = 0
    for p in module.parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            n += 1
    return n
