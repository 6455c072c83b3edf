"""Config -> the parts every entry script builds: the chat format, the model and the loggers.

Training's own parts (datamodule, LightningModule, trainer) are :mod:`rolemrc.run.build`'s, which
re-exports these. Nothing here imports Lightning, so evaluate.py and probe.py start without it
(a logger given by ``logger=...`` imports it when instantiated);
``tests/test_import_graph.py`` checks that.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import hydra
from omegaconf import OmegaConf
from torch import nn

from rolemrc.config import typed
from rolemrc.data.templates import ChatFormat
from rolemrc.models.loading import count_parameters, load_model, load_tokenizer

log = logging.getLogger(__name__)


def build_chat(model_cfg: Any) -> ChatFormat:
    """The model's tokenizer wrapped in the chat format that turns messages into ids + labels."""
    model_cfg = typed(model_cfg)  # ModelConfig
    return ChatFormat(load_tokenizer(model_cfg), eot=model_cfg.eot_token)


def build_model(model_cfg: Any, tokenizer: Any, head: str = "lm") -> nn.Module:
    """The HF model ``model_cfg`` (a ``ModelConfig``, typed here) describes: weights or random
    init, dtype, attention, gradient checkpointing, PEFT/QLoRA, kernels; ``head``: ``lm`` (a
    causal LM) or ``score`` (a one-score sequence classifier, ``objective=reward``)."""
    model_cfg = typed(model_cfg)
    model = load_model(model_cfg, tokenizer, head=head)
    _, total = count_parameters(model)
    log.info("model %s: %s parameters", model_cfg.name, f"{total:,}")  # trainable: build_module (training only)
    return model


def build_loggers(cfg: Any) -> list[Any]:
    """evaluate.py's and probe.py's ``cfg.logger``, built (:func:`make_loggers`)."""
    return make_loggers(cfg.logger)


def make_loggers(logger: Any) -> list[Any]:
    """The config's ``logger``: ``{name: {_target_: ...}}``; W&B without a key logs offline into the run folder."""
    loggers = []
    for spec in (logger or {}).values():
        spec = OmegaConf.to_container(spec, resolve=True)
        if spec.get("_target_", "").endswith("WandbLogger") and spec.get("offline") is None:
            spec["offline"] = not os.environ.get("WANDB_API_KEY") and os.environ.get("WANDB_MODE") != "online"
        loggers.append(hydra.utils.instantiate(spec))
    return loggers
