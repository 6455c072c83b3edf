"""The policy's weights as a rollout engine takes them: full tensors (FSDP2's shards gathered), under
the HF checkpoint names (what ``vllm``'s ``model.load_weights`` and a PEFT adapter folder expect).

Under FSDP2 every rank must call these together (each sharded tensor is all-gathered in turn, in
the same order on every rank)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

PEFT_PREFIX = "base_model.model."


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (an FSDP2 shard) gathered whole; a plain tensor as it is (detached)."""
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach()


def _lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """PEFT's LoRA layers by module name (those with ``base_layer``, ``lora_A``, ``lora_B``, ``scaling``)."""
    return {name: m for name, m in model.named_modules()
            if hasattr(m, "base_layer") and hasattr(m, "lora_A") and hasattr(m, "scaling")}


def is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


def merged_weights(model: nn.Module, adapter: str = "default") -> dict[str, torch.Tensor]:
    """The policy's weights under HF names, a LoRA adapter merged in (``W + scaling * B @ A``, as
    PEFT's ``merge_and_unload`` computes it for linear layers; computed in float32 and stored in the
    weight's dtype). A plain model: its state dict, gathered."""
    state = model.state_dict()
    if not is_peft(model):
        return {k: _full(v) for k, v in state.items()}
    layers = _lora_layers(model)
    out: dict[str, torch.Tensor] = {}
    lora: dict[str, torch.Tensor] = {}
    for key, value in state.items():  # one pass in the state dict's order: the same on every rank
        tensor = _full(value)
        if ".lora_" in key:
            lora[key] = tensor
        else:
            out[key] = tensor
    for name, layer in layers.items():
        if adapter not in layer.lora_A:
            continue
        if getattr(layer, "fan_in_fan_out", False):
            raise NotImplementedError(f"{name}: a LoRA layer with fan_in_fan_out (Conv1D) cannot be merged here")
        a = lora[f"{name}.lora_A.{adapter}.weight"].float()
        b = lora[f"{name}.lora_B.{adapter}.weight"].float()
        key = f"{name}.base_layer.weight"
        base = out[key]
        out[key] = (base.float() + (b @ a) * float(layer.scaling[adapter])).to(base.dtype)
    return {hf_name(k): v for k, v in out.items()}


def hf_name(key: str) -> str:
    """A PEFT model's state-dict key as the base model's HF checkpoint name."""
    if key.startswith(PEFT_PREFIX):
        key = key[len(PEFT_PREFIX):]
    return key.replace(".base_layer.", ".")


def adapter_weights(model: nn.Module, adapter: str = "default") -> dict[str, torch.Tensor]:
    """The LoRA adapter's tensors, gathered, under the names PEFT saves them with
    (``adapter_model.safetensors``), through PEFT's own ``get_peft_model_state_dict``."""
    from peft import get_peft_model_state_dict

    state = {k: _full(v) for k, v in model.state_dict().items() if ".lora_" in k or "modules_to_save" in k}
    return get_peft_model_state_dict(model, state_dict=state, adapter_name=adapter)


def save_adapter(model: Any, weights: dict[str, torch.Tensor], folder: Any, adapter: str = "default") -> None:
    """A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) that
    ``vllm serve --enable-lora`` loads: written to a temporary name and renamed, so a server never
    reads half a folder."""
    import os
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.peft_config[adapter].save_pretrained(str(tmp))
    save_file({k: v.contiguous().cpu() for k, v in weights.items()}, str(tmp / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
