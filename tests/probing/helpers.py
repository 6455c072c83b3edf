"""Tiny random-init decoders and hand-made test items for the probing tests."""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import nn

from rolemrc.data.schemas import TestItem
from rolemrc.data.templates import ChatFormat
from rolemrc.models.loading import load_model, load_tokenizer
from rolemrc.tasks import TEST_TASKS
from tests.conftest import compose_train

ARCHS = {"llama": "tiny", "qwen2": "tiny_qwen"}
SMALL = ["model.init.hidden_size=32", "model.init.intermediate_size=64", "model.init.num_attention_heads=4",
         "model.init.num_key_value_heads=2"]


def model_cfg(arch: str = "llama", layers: int = 3) -> DictConfig:
    """The shipped tiny model config (``model=tiny``/``tiny_qwen``), shrunk further."""
    return compose_train([f"model={ARCHS[arch]}", *SMALL, f"model.init.num_hidden_layers={layers}"]).model


def tiny(arch: str = "llama", layers: int = 3, seed: int = 0, extra_tokens: list[str] | None = None
         ) -> tuple[nn.Module, ChatFormat]:
    """(random-init model in eval mode, its ChatFormat); ``extra_tokens`` are added to the vocab."""
    cfg = model_cfg(arch, layers)
    tokenizer = load_tokenizer(cfg)
    if extra_tokens:
        tokenizer.add_tokens(extra_tokens)
    torch.manual_seed(seed)
    model = load_model(cfg, tokenizer).eval()
    return model, ChatFormat(tokenizer)


def items(per_task: int = 2, marker: str | None = None, marked: tuple[str, ...] = (), repeats: int = 4
          ) -> list[TestItem]:
    """``per_task`` short items for each of the 18 tasks; tasks in ``marked`` carry ``marker``
    ``repeats`` times in their system message."""
    out = []
    for t, task in enumerate(TEST_TASKS):
        for i in range(per_task):
            system = f"You are Keeper {t}, who minds lamp {i} on the cliff."
            if marker and task in marked:
                system += " Rule:" + f" {marker}" * repeats
            user = "What is the weather like" + " today" * (i + t % 3) + "?"  # uneven lengths: padding
            out.append(TestItem(task=task, question=[{"role": "system", "content": system},
                                                     {"role": "user", "content": user}], reference="Calm."))
    return out
