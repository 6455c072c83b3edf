"""Write a trained model in HF format (safetensors + config + tokenizer + chat template): from a
live model (:func:`export_pretrained`), from a full state dict in a meta-device skeleton of a
run's model (:func:`export_state`) or from a checkpoint file/folder (:func:`export_checkpoint`)."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rolemrc.checkpointing.state import read_model_state
from rolemrc.fileio import atomic_dir
from rolemrc.models.loading import load_model, load_tokenizer, unwrap
from rolemrc.models.logprob_head import install_logprob_head, restore_linear_head

log = logging.getLogger(__name__)

SHIPPED_BASE = "base_model"  # the folder, inside an adapter export, of a random-init run's base weights
SHIPPED_BASE_RECORD = "rolemrc_base.json"  # beside adapter_config.json: the shipped base's relative name


def export_pretrained(model: nn.Module, tokenizer: Any, out_dir: str | Path, merge_lora: bool = True,
                      base: str | None = None) -> Path:
    """Save ``model`` so ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it.

    LoRA models are merged into the base weights (``merge_lora``) or saved as a PEFT adapter
    whose ``adapter_config.json`` names its base model, so ``peft.AutoPeftModelForCausalLM``
    loads it: ``base`` (the ``model.path`` it was loaded from: a hub id, or a folder written as
    an absolute path) or, for a random-init base, the base weights saved next to the adapter in
    ``<out_dir>/base_model`` (:func:`_ship_base`). Writes into ``<out_dir>.partial`` and swaps it in at the end
    (:func:`rolemrc.fileio.atomic_dir`), so an interrupted export never leaves a folder that looks
    complete and a previous export stays in place until the new one is; rerunning simply writes it again.
    """
    out = Path(out_dir)
    is_peft = hasattr(model, "get_base_model")
    if is_peft and getattr(unwrap(model), "is_loaded_in_4bit", False):
        # QLoRA: the adapter goes onto the full-precision base, as it would be served
        return export_pretrained(_onto_full_precision_base(model, base), tokenizer, out, merge_lora, base)
    restore_linear_head(model)  # saved models are plain transformers models
    try:
        if is_peft and merge_lora:
            to_save = model.merge_and_unload()
        else:
            to_save = model
        config = unwrap(to_save).config
        training_cache, config.use_cache = config.use_cache, True  # exports are for inference (KV cache)
        try:
            with atomic_dir(out) as partial:  # <out>.partial, swapped in for <out> once complete
                if is_peft and not merge_lora:
                    _save_adapter(to_save, partial, out, base)
                else:
                    to_save.save_pretrained(partial, safe_serialization=True)
                tokenizer.save_pretrained(partial)
        finally:
            config.use_cache = training_cache
    finally:
        install_logprob_head(model)
    log.debug("exported %s to %s", "LoRA adapter" if is_peft and not merge_lora else "model", out)
    return out


def _onto_full_precision_base(model: nn.Module, base: str | None) -> nn.Module:
    """A QLoRA model's adapter on its base model loaded unquantized (in the dtype the run named,
    ``model.dtype``), so that merging gives full-precision weights (as LLaMA-Factory and axolotl
    export QLoRA) and an adapter export names a base anyone can load."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    if base is None:
        raise ValueError("a 4-bit (QLoRA) model without the path of its base weights cannot be exported")
    name = model.active_adapter if isinstance(model.active_adapter, str) else "default"
    adapter = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    dtype = unwrap(model).config.dtype
    full = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=dtype), copy.deepcopy(model.peft_config[name]))
    _load_adapter(full, adapter, "the live QLoRA model")
    return full


def _load_adapter(model: nn.Module, adapter: dict[str, torch.Tensor], origin: str) -> None:
    """``adapter`` (every trainable tensor of a QLoRA run, by name) into ``model``'s, exactly."""
    trainable = {k: p for k, p in model.named_parameters() if p.requires_grad}
    missing = sorted(set(trainable) - set(adapter))
    unexpected = sorted(set(adapter) - set(trainable))
    if missing or unexpected:
        raise ValueError(f"{origin}: adapter weights do not match the run's LoRA model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    with torch.no_grad():
        for k, p in trainable.items():
            p.copy_(adapter[k].to(p.dtype))


def _save_adapter(model: nn.Module, partial: Path, out: Path, base: str | None) -> None:
    """The adapter alone, its config naming the base model (peft writes ``null`` for a base that
    was built from a config or whose ``_name_or_path`` is a relative folder)."""
    if base is not None and Path(base).expanduser().exists():
        base = str(Path(base).expanduser().resolve())  # a folder: valid from any working directory
    for config in model.peft_config.values():
        config.base_model_name_or_path = base or SHIPPED_BASE  # a shipped base: re-pointed by _ship_base
    with warnings.catch_warnings():
        # peft looks for the base's config to see whether the vocabulary changed; a random-init
        # base is written just below (same vocabulary), so its warning would only mislead.
        warnings.filterwarnings("ignore", message="Could not find a config file in .*base_model", category=UserWarning)
        model.save_pretrained(partial, safe_serialization=True)
    if base is None:  # random init: the adapter means nothing without these very base weights
        model.unload().save_pretrained(partial / SHIPPED_BASE, safe_serialization=True)
        _ship_base(partial)


def _ship_base(partial: Path) -> None:
    """Make an adapter export with its base shipped inside (``base_model/``) loadable after the
    folder moves. peft (0.21) hands ``base_model_name_or_path`` to ``from_pretrained`` as it is,
    so a relative name resolves against the working directory, and an absolute path into the
    export breaks when it moves. The name written is therefore an absolute path outside the export
    that does not move: a copy of the base in rolemrc's cache, keyed by its content
    (``$ROLEMRC_CACHE_DIR/bases/<sha256>``, else ``~/.cache/rolemrc/bases``). The shipped copy's
    relative name is recorded beside (``rolemrc_base.json``): rolemrc loads the shipped copy, so the
    folder also works on another machine, where peft needs the path edited to its ``base_model``."""
    from filelock import FileLock

    shipped = partial / SHIPPED_BASE
    digest = hashlib.sha256()
    for f in sorted(shipped.glob("*.safetensors")) + [shipped / "config.json"]:
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                digest.update(block)
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    cache = Path(os.environ.get("ROLEMRC_CACHE_DIR") or cache_home / "rolemrc").resolve()
    cached = cache / "bases" / digest.hexdigest()[:32]
    cached.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cached) + ".lock"):
        if not (cached / "config.json").is_file():
            with atomic_dir(cached) as tmp:
                for f in shipped.iterdir():
                    shutil.copy2(f, tmp / f.name)
    config_file = partial / "adapter_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = str(cached)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (partial / SHIPPED_BASE_RECORD).write_text(json.dumps({"shipped_base": SHIPPED_BASE, "cached_copy": str(cached)},
                                                          indent=2) + "\n", encoding="utf-8")


def export_checkpoint(run_cfg: Any, checkpoint: str | Path, out_dir: str | Path, merge_lora: bool | None = None) -> Path:
    """Load a checkpoint's weights into the run's model and export it in HF format."""
    return export_state(run_cfg, read_model_state(checkpoint), out_dir, merge_lora, origin=str(checkpoint))


def export_state(run_cfg: Any, state: dict[str, torch.Tensor], out_dir: str | Path, merge_lora: bool | None = None,
                 origin: str = "state dict") -> Path:
    """Build the model skeleton from a run's config, load ``state`` (full, unsharded), export.

    The skeleton's parameters live on the meta device (no pretrained weights are read, nothing
    is initialised, no second copy of an 8B model is held): ``state``'s tensors, cast to the
    run's dtype, become the parameters. A missing or extra key is an error.
    """
    from accelerate import init_empty_weights

    tokenizer = load_tokenizer(run_cfg.model)
    merge = run_cfg.model.peft.merge_on_export if merge_lora is None else merge_lora
    if run_cfg.model.quantization.load_in_4bit:  # QLoRA: its adapter onto the full-precision base
        model = load_model(_unquantized(run_cfg.model), tokenizer)
        trainable = {k for k, p in model.named_parameters() if p.requires_grad}
        _load_adapter(model, {k: v for k, v in state.items() if k in trainable or "lora_" in k}, origin)
        return export_pretrained(model, tokenizer, out_dir, merge, base=run_cfg.model.path)
    with init_empty_weights(include_buffers=False):  # buffers (rotary tables) are computed for real
        model = load_model(skeleton_config(run_cfg.model), tokenizer)
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        raise ValueError(f"{origin}: weights do not match the run's model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    cast = {k: v.to(expected[k].dtype) for k, v in state.items()}
    model.load_state_dict(cast, strict=True, assign=True)
    del cast
    model.tie_weights()  # assign=True replaced tied tensors by two copies of the same values
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise ValueError(f"{origin}: no weights for {still_meta[:5]} after loading")
    return export_pretrained(model, tokenizer, out_dir, merge, base=run_cfg.model.path)


def _unquantized(model_cfg: Any) -> Any:
    """A copy of a QLoRA run's ``model_cfg`` that loads its base weights unquantized, in ``model.dtype``."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(model_cfg, resolve=True)
    cfg["quantization"]["load_in_4bit"] = False
    cfg["gradient_checkpointing"] = False
    if "kernels" in cfg:
        cfg["kernels"] = "none"  # training kernels: an export does not need them
    return OmegaConf.create(cfg)


def skeleton_config(model_cfg: Any) -> Any:
    """A copy of ``model_cfg`` that builds the same architecture without reading weights."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(model_cfg, resolve=True)
    if cfg["path"] is not None:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(cfg["path"], trust_remote_code=cfg["trust_remote_code"])
        cfg["tokenizer"] = cfg["tokenizer"] or cfg["path"]
        cfg["arch"] = hf.model_type
        cfg["init"] = {k: v for k, v in hf.to_diff_dict().items()
                       if k not in ("model_type", "architectures", "transformers_version", "dtype", "torch_dtype")}
        cfg["path"] = None
    cfg["quantization"]["load_in_4bit"] = False
    cfg["gradient_checkpointing"] = False
    return OmegaConf.create(cfg)
