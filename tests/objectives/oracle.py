"""A test oracle for the chunked log-prob function: the full ``[B, T, V]`` logits, no tiling."""

from __future__ import annotations

import torch
from torch import Tensor

IGNORE_INDEX = -100


def naive_token_logprobs(
    hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[Tensor, Tensor]:
    """``token_logprobs``' contract computed the obvious way: fp32 logits (fp64 for fp64 inputs),
    ``log_softmax``, gather; memory grows with ``B * T * V``."""
    mask = labels != ignore_index
    cdt = torch.promote_types(torch.promote_types(torch.float32, hidden.dtype), weight.dtype)
    logits = hidden.to(cdt) @ weight.to(cdt).T
    if bias is not None:
        logits = logits + bias.to(cdt)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, labels.masked_fill(~mask, 0).long().unsqueeze(-1)).squeeze(-1)
    return logp[mask], mask

