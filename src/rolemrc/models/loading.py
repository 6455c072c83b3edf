"""Load a tokenizer and a causal LM from config: hub id, local folder, or random init."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from rolemrc.config import plain
from rolemrc.data.templates import load_template
from rolemrc.errors import ModelSourceError
from rolemrc.models import family
from rolemrc.models.kernels import apply_kernels, check_kernels
from rolemrc.models.logprob_head import install_logprob_head
from rolemrc.models.paths import check_model_paths, check_source, hub_offline, offline_hint, remote_code_refused

log = logging.getLogger(__name__)


@contextmanager
def _naming(key: str, source: str) -> Iterator[None]:
    """transformers' OSError for weights it cannot find, with the config key that named them and,
    when the hub is switched off, what to do about it."""
    try:
        yield
    except OSError as err:
        hint = offline_hint(key, source) if hub_offline() else ""
        raise ModelSourceError(f"{key}={source}: cannot load it ({str(err).splitlines()[0]}).{hint}") from err
    except ValueError as err:  # transformers' refusal to run a model's own code (an auto_map in its config)
        if "trust_remote_code" not in str(err):
            raise
        raise ModelSourceError(remote_code_refused(key, source)) from None


def check_model_cfg(cfg: Any) -> None:
    """Settings that cannot work, refused before anything is read or loaded."""
    if cfg.quantization.load_in_4bit and not cfg.peft.enabled:
        raise ValueError("model.quantization.load_in_4bit=true trains only adapters: set model.peft.enabled=true")
    if cfg.quantization.load_in_4bit and cfg.path is None:
        raise ValueError("4-bit quantization needs pretrained weights (model.path)")
    check_model_paths(cfg)
    if getattr(cfg, "kernels", "none") != "none":
        check_kernels(cfg.kernels)


def load_tokenizer(cfg: Any) -> Any:
    """Fast tokenizer for ``cfg.tokenizer`` (or ``cfg.path``), chat template overridden if asked."""
    from transformers import AutoTokenizer

    source = cfg.tokenizer or cfg.path
    if source is None:
        raise ValueError("model.tokenizer or model.path must be set")
    key = "model.tokenizer" if cfg.tokenizer else "model.path"
    check_source(source, key)
    with _naming(key, source):
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    if cfg.chat_template:
        tokenizer.chat_template = load_template(cfg.chat_template)
    if tokenizer.pad_token is None:  # padded positions are masked out of attention and loss
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def resolve_attn_implementation(name: str) -> str:
    """``auto`` picks flash_attention_2 on a GPU when flash-attn is installed, else sdpa."""
    have_flash = importlib.util.find_spec("flash_attn") is not None
    if name == "auto":
        return "flash_attention_2" if have_flash and torch.cuda.is_available() else "sdpa"
    if name == "flash_attention_2" and not have_flash:
        raise ImportError("model.attn_implementation=flash_attention_2 needs flash-attn, which is not installed "
                          "(GPU nodes: pip install 'rolemrc[gpu]'); use model.attn_implementation=sdpa")
    return name


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"model.dtype: unknown dtype {name!r}")
    return dtype


def load_model(cfg: Any, tokenizer: Any, head: str = "lm") -> nn.Module:
    """The causal LM, with LoRA/QLoRA applied and the lm_head able to return chunked log-probs;
    ``head="score"``: the same architecture with a one-score sequence-classification head
    (``AutoModelForSequenceClassification``, ``num_labels=1``: a reward model; from a causal LM's
    weights the head is new, randomly initialised), LoRA keeping the head trainable (peft's
    ``SEQ_CLS`` task saves it with the adapter)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if head not in ("lm", "score"):
        raise ValueError(f"head must be 'lm' or 'score', got {head!r}")
    auto = AutoModelForCausalLM if head == "lm" else AutoModelForSequenceClassification
    extra: dict[str, Any] = {} if head == "lm" else {"num_labels": 1}
    check_model_cfg(cfg)
    attn = resolve_attn_implementation(cfg.attn_implementation)
    dtype = _dtype(cfg.dtype)
    quant = cfg.quantization.load_in_4bit
    if cfg.path is None:
        from transformers import AutoConfig

        kwargs = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        kwargs.update(plain(cfg.init))  # an explicit vocab_size (e.g. a padded hub vocab) wins
        try:
            config = AutoConfig.for_model(cfg.arch, **kwargs)
        except ValueError as err:
            raise ValueError(f"model.arch={cfg.arch!r} is not a transformers model type ({err})") from err
        config.update(extra)
        model = auto.from_config(config, attn_implementation=attn, dtype=dtype)
    else:
        kwargs: dict[str, Any] = {}
        if quant:
            from transformers import BitsAndBytesConfig

            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type=cfg.quantization.quant_type,
                bnb_4bit_use_double_quant=cfg.quantization.double_quant,
                bnb_4bit_compute_dtype=_dtype(cfg.quantization.compute_dtype))
        with _naming("model.path", cfg.path):
            model = auto.from_pretrained(cfg.path, dtype=dtype, attn_implementation=attn,
                                         trust_remote_code=cfg.trust_remote_code, **extra, **kwargs)
    model.config.use_cache = False
    if head == "score":  # the head reads each row's last token that is not padding
        model.config.pad_token_id = tokenizer.pad_token_id
    if quant:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing)
    elif cfg.gradient_checkpointing:
        # transformers >= 5.2x names it activation_checkpointing_enable (the old name warns); older: the old name
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.peft.enabled:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(
            r=cfg.peft.r, lora_alpha=cfg.peft.alpha, lora_dropout=cfg.peft.dropout,
            target_modules=plain(cfg.peft.target_modules), task_type="CAUSAL_LM" if head == "lm" else "SEQ_CLS"))
    if head == "lm":
        install_logprob_head(model)
    if getattr(cfg, "kernels", "none") != "none":  # optional GPU kernels (rolemrc.models.kernels), imported lazily
        apply_kernels(model, cfg.kernels)
    return model


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode (no dropout) inside the block, its previous train/eval mode
    restored after (so a reference pass or a training callback can use the live model)."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The decoder stack (embeddings, layers, final norm) and the output head, each called as a module."""
    return family.decoder(model), family.output_head(model)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, total
