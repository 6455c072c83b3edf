"""Per-layer activations at the last prompt token, captured with forward hooks.

Works on any HF decoder-only model (Llama, Qwen2, ... maybe PEFT-wrapped): the decoder layers
and each site's block come from :mod:`rolemrc.models.family`, and the layer count and width are
read from the tensors, never assumed.

Sites (what "a layer's output activation" means):

- ``mlp_out``: output of the layer's MLP block (``layer.mlp``), before the residual add.
- ``attn_out``: first output of the layer's self-attention (``layer.self_attn``), after o_proj.
- ``residual``: the decoder layer's output, i.e. the residual stream after the layer.

Prompts are rendered by :class:`rolemrc.data.templates.ChatFormat` exactly as for generation and
batched with **left** padding, so the last prompt token of every row sits at position -1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from rolemrc.models.family import SITES, check_site, decoder, decoder_layers, family_of, site_module
from rolemrc.models.loading import eval_mode
from rolemrc.rollout.hf import left_padded as padded_rows

__all__ = ["SITES", "LastTokenCapture", "capture_activations", "check_site", "decoder_layers", "encode_prompts",
           "iter_activations", "left_padded", "replace_site_tensor", "site_module", "site_tensor"]

def site_tensor(output: Any) -> torch.Tensor:
    """The activation inside a module's forward output: the tensor itself or element 0 of a tuple
    (attention returns ``(attn_output, attn_weights)``); shape [B, T, H]."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"cannot find the activation tensor in a module output of type {type(output).__name__}")


def replace_site_tensor(output: Any, new: torch.Tensor) -> Any:
    """``output`` with its activation tensor replaced by ``new`` (same container type)."""
    if isinstance(output, torch.Tensor):
        return new
    return type(output)([new, *output[1:]]) if isinstance(output, list) else (new, *output[1:])


class LastTokenCapture:
    """Context manager: while active, each forward of ``model`` appends, per layer, the site
    activation at position -1 (the last prompt token under left padding).

    After the forward, :meth:`pop` returns them stacked as [B, L, H] float32 on CPU.
    """

    def __init__(self, model: nn.Module, site: str) -> None:
        self.layers = decoder_layers(model)
        self.family = family_of(model)
        self.site = check_site(site)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._latest: list[torch.Tensor | None] = [None] * len(self.layers)

    def _hook(self, index: int) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            # float32 on CPU: maps and restraint selection work in one precision whatever the model's
            self._latest[index] = site_tensor(output)[:, -1, :].detach().float().cpu()

        return hook

    def __enter__(self) -> LastTokenCapture:
        for i, layer in enumerate(self.layers):
            self._handles.append(site_module(layer, self.site, self.family).register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def pop(self) -> torch.Tensor:
        """[B, L, H] activations of the last forward; clears them."""
        missing = [i for i, t in enumerate(self._latest) if t is None]
        if missing:
            raise RuntimeError(f"no activation captured for layers {missing}: did the forward run every layer?")
        out = torch.stack(self._latest, dim=1)  # type: ignore[arg-type]
        self._latest = [None] * len(self.layers)
        return out


def encode_prompts(chat: Any, items: Sequence[Any], max_prompt_length: int | None = None) -> list[list[int]]:
    """Prompt ids (template + generation prompt) of each test item; long prompts lose their start,
    as in training, so the last prompt token is always kept."""
    prompts = [chat.encode_prompt(item.question) for item in items]
    if max_prompt_length is not None:
        prompts = [ids[-max_prompt_length:] for ids in prompts]
    return prompts


def left_padded(prompts: Sequence[list[int]], pad_id: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` and ``position_ids`` ([B, T] each), left-padded.

    Position ids count real tokens only, so a padded row sees the same positions as alone.
    """
    if not all(prompts):
        raise ValueError("empty prompt: nothing to forward")
    ids, mask = padded_rows(prompts, pad_id)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "position_ids": positions.to(device)}


def iter_activations(
    model: nn.Module,
    prompts: Sequence[list[int]],
    site: str,
    pad_id: int,
    batch_size: int = 4,
) -> Iterator[tuple[list[int], torch.Tensor]]:
    """Forward ``prompts`` once each (no generation), ``batch_size`` at a time.

    Yields ``(indices, acts)``: the prompts' indices in ``prompts`` and their activations
    [len(indices), L, H] float32 on CPU. Prompts are grouped by length to waste little on padding,
    so indices come out of order. Only the decoder runs: no [T, vocab] logits are made.
    Hooks and eval mode last until the generator is exhausted or closed.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
    stack = decoder(model)
    device = next(model.parameters()).device
    with eval_mode(model), torch.no_grad(), LastTokenCapture(model, site) as capture:
        for start in range(0, len(order), batch_size):
            indices = order[start:start + batch_size]
            batch = left_padded([prompts[i] for i in indices], pad_id, device)
            stack(**batch, use_cache=False)
            yield indices, capture.pop()


def capture_activations(
    model: nn.Module,
    prompts: Sequence[list[int]],
    site: str,
    pad_id: int,
    batch_size: int = 4,
) -> torch.Tensor:
    """All activations at once, in prompt order: [N, L, H] float32 on CPU (N*L*H floats: for
    large runs prefer :func:`rolemrc.probing.maps.compute_frequency_maps`, which streams)."""
    out: torch.Tensor | None = None
    for indices, acts in iter_activations(model, prompts, site, pad_id, batch_size):
        if out is None:
            out = torch.empty((len(prompts), *acts.shape[1:]), dtype=acts.dtype)
        out[indices] = acts
    if out is None:
        raise ValueError("no prompts to capture")
    return out
