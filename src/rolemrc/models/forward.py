"""The decoder's last hidden states for a training batch: padded rows, or packed rows whose
pieces attend only within themselves (and their context span), see
:mod:`rolemrc.models.packed_attention`."""

from __future__ import annotations

import torch
from torch import nn

from rolemrc.models.packed_attention import packed_hidden, packed_route


def policy_hidden(model: nn.Module, decoder: nn.Module, batch: dict[str, torch.Tensor],
                  packs_with_context: bool = False, packed_attention: str = "auto") -> torch.Tensor:
    """``[B, T, H]`` last hidden states of ``batch`` (before the lm_head); ``packed_attention``
    (``model.packed_attention``) picks the route for packed rows."""
    if "segments" in batch:
        return packed_hidden(decoder, batch, packed_route(model, packs_with_context, packed_attention))
    return decoder(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                   position_ids=batch.get("position_ids")).last_hidden_state
