"""Write a trained model in HF format (safetensors + config + tokenizer + chat template)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from torch import nn

from rolemrc.models.loading import LogprobHead, unwrap

log = logging.getLogger(__name__)


def export_pretrained(model: nn.Module, tokenizer: Any, out_dir: str | Path, merge_lora: bool = True) -> Path:
    """Save ``model`` so ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it.

    LoRA models are merged into the base weights (``merge_lora``) or saved as a PEFT adapter.
    Writes into ``<out_dir>.partial`` and renames at the end, so an interrupted export never
    leaves a folder that looks complete; rerunning simply writes it again.
    """
    out = Path(out_dir)
    partial = out.with_name(out.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    is_peft = hasattr(model, "get_base_model")
    head = unwrap(model).get_output_embeddings()
    if isinstance(head, LogprobHead):
        head.__class__ = nn.Linear  # saved models are plain transformers models
    try:
        if is_peft and merge_lora:
            if getattr(unwrap(model), "is_loaded_in_4bit", False):
                raise ValueError("cannot merge LoRA into 4-bit weights; set model.peft.merge_on_export=false")
            to_save = model.merge_and_unload()
        else:
            to_save = model
        config = unwrap(to_save).config
        training_cache, config.use_cache = config.use_cache, True  # exports are for inference (KV cache)
        try:
            to_save.save_pretrained(partial, safe_serialization=True)
        finally:
            config.use_cache = training_cache
        tokenizer.save_pretrained(partial)
    finally:
        if isinstance(head, nn.Linear) and type(head) is nn.Linear:
            head.__class__ = LogprobHead
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)
    log.info("exported %s to %s", "LoRA adapter" if is_peft and not merge_lora else "model", out)
    return out
