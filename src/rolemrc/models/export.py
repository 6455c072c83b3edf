"""Write a trained model in HF format (safetensors + config + tokenizer + chat template): from a
live model (:func:`export_pretrained`), from a full state dict in a meta-device skeleton of a
run's model (:func:`export_state`) or from a checkpoint file/folder (:func:`export_checkpoint`)."""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import hashlib
import json
import logging
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rolemrc.checkpointing.state import read_model_state
from rolemrc.errors import CheckpointError, DestinationError, StorageError
from rolemrc.fileio import atomic_dir, atomic_write_json, cache_root, partial_path, storage_error
from rolemrc.models.family import base_model
from rolemrc.models.loading import load_model, load_tokenizer
from rolemrc.models.logprob_head import install_logprob_head, restore_linear_head

log = logging.getLogger(__name__)

SHIPPED_BASE = "base_model"  # the folder, inside an adapter export, of a random-init run's base weights
SHIPPED_BASE_RECORD = "rolemrc_base.json"  # beside adapter_config.json: the shipped base's relative name
MANIFEST = "rolemrc_export.json"  # in every export folder: what wrote it and the entries it wrote
# What an HF export folder holds (an export written before exports carried MANIFEST is recognised
# by holding nothing else); rolemrc_source.json marks an export made for model.path, merged/ the
# merge evaluate.py once cached inside an adapter export.
EXPORT_ENTRIES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                  "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                  "chat_template.*", "adapter_config.json", "README.md", SHIPPED_BASE, SHIPPED_BASE_RECORD,
                  "rolemrc_source.json", MANIFEST, "merged", "merged.lock")
RUN_ENTRIES = (".hydra", "checkpoints", "*.ckpt", ".metadata", "csv", "wandb", "run_summary.json")  # a run, a checkpoint


def _run_entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if any(fnmatch.fnmatch(p.name, pat) for pat in RUN_ENTRIES))


def _foreign_entries(folder: Path) -> list[str]:
    """The entries of ``folder`` that no export writes: those its manifest does not list (beside
    what rolemrc adds to an export later), or, without a manifest, those outside EXPORT_ENTRIES."""
    manifest = folder / MANIFEST
    listed: set[str] | None = None
    if manifest.is_file():
        try:
            files = json.loads(manifest.read_text(encoding="utf-8")).get("files")
            listed = set(files) if isinstance(files, list) else None
        except (OSError, ValueError, AttributeError):
            listed = None
    names = sorted(p.name for p in folder.iterdir())
    if listed is not None:
        return [n for n in names if n not in listed and n not in (MANIFEST, "rolemrc_source.json", "merged",
                                                                   "merged.lock")]
    foreign = [n for n in names if not any(fnmatch.fnmatch(n, pat) for pat in EXPORT_ENTRIES)]
    if not foreign and names and not {"config.json", "adapter_config.json", MANIFEST} & set(names):
        return names  # tokenizer files alone: not an export
    return foreign


def _describe(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names)} entries)" if len(names) > n else "")


def check_replaceable(out: Path, keep: tuple[Path, ...] = ()) -> None:
    """Refuse (:class:`~rolemrc.errors.DestinationError`) to write an export at ``out`` where that
    would delete what no export wrote: ``out``, or the ``<out>.partial``/``<out>.old`` twins that
    writing it clears, being a file, a link, a run folder (``.hydra``, checkpoints), a folder
    holding ``keep`` (the checkpoint read, its run folder) or a folder of other files. An empty
    folder, or a previous export, may be replaced."""
    out = Path(out)
    resolved = out.resolve()
    for kept in keep:
        kept = Path(kept).resolve()
        if resolved == kept or resolved in kept.parents:
            raise DestinationError(f"{out} holds {kept}: an export never replaces the checkpoint it reads or "
                                   "its run folder; choose another folder for the export")
    for path in (out, partial_path(out), out.with_name(out.name + ".old")):
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise DestinationError(f"{path} is a {'link' if path.is_symlink() else 'file'}, not a folder: an export "
                                   "is a folder; choose another folder for the export")
        if not path.is_dir() or not any(path.iterdir()):
            continue
        run = _run_entries(path)
        if run:
            raise DestinationError(f"{path} holds a training run or checkpoint ({_describe(run)}): an export never "
                                   "replaces it; choose another folder for the export, e.g. "
                                   f"{path / 'export'}")
        foreign = _foreign_entries(path)
        if foreign:
            mark = "" if (path / MANIFEST).is_file() else f" (no {MANIFEST})"
            raise DestinationError(f"{path} is not empty and holds files no export wrote{mark}: {_describe(foreign)}; "
                                   "an export is written only into a new or empty folder or over a previous "
                                   "export: move those files away, or choose another folder for the export")


def check_export_destination(out: str | Path, overwrite: bool, keep: tuple[Path, ...] = ()) -> Path:
    """export.py's ``--out`` checked before anything loads (:func:`check_replaceable`; a previous
    export is replaced only with ``overwrite``; the nearest existing folder above must be
    writable): ``out`` made absolute, or a one-line :class:`~rolemrc.errors.UserError`."""
    out = Path(out).expanduser().absolute()
    for above in reversed(out.parents):  # a file where a folder must be: mkdir would fail
        if above.exists() and not above.is_dir():
            raise DestinationError(f"{above} is a file, not a folder: {out} cannot be created; choose another "
                                   "folder for the export")
    check_replaceable(out, keep)
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise DestinationError(f"{out} holds a previous export: pass --overwrite to replace it, or --out <another "
                               "folder>")
    parent = next(p for p in out.parents if p.exists())
    # where <out>.partial is made and swapped in, and a previous export's folder, emptied on replacing it
    for folder in (parent, *([out] if out.is_dir() and any(out.iterdir()) else [])):
        if not os.access(folder, os.W_OK | os.X_OK):
            reason = "read-only file system" if _read_only_mount(folder) else "permission denied"
            raise StorageError(f"{out}: cannot write the export in {folder} ({reason}); make it writable, or choose "
                               "another folder with --out")
    return out


def _read_only_mount(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


@contextlib.contextmanager
def export_dir(out: Path, kind: str, source: str | None) -> Iterator[Path]:
    """``with export_dir(out, kind, source) as partial:`` write an export into ``<out>.partial``,
    swapped in for ``out`` when the block ends (:func:`rolemrc.fileio.atomic_dir`), after
    :func:`check_replaceable`. The manifest (:data:`MANIFEST`: kind, source, the entries written)
    is written first and completed last, so a partial or finished export is known as one. A
    full disk or read-only folder is a one-line :class:`~rolemrc.errors.StorageError`."""
    check_replaceable(out)
    record = {"written_by": "rolemrc", "kind": kind, "source": source, "complete": False}
    try:
        with atomic_dir(out) as partial:
            atomic_write_json(partial / MANIFEST, record)
            yield partial
            names = sorted(p.name for p in partial.iterdir())
            atomic_write_json(partial / MANIFEST, {**record, "complete": True, "files": names})
    except OSError as err:
        raise storage_error(err, out, "writing the export", "choose another folder for it") from None


def export_pretrained(model: nn.Module, tokenizer: Any, out_dir: str | Path, merge_lora: bool = True,
                      base: str | None = None, source: str | None = None) -> Path:
    """Save ``model`` so ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it (a reward
    model, ``objective=reward``: ``AutoModelForSequenceClassification``).

    LoRA models are merged into the base weights (``merge_lora``) or saved as a PEFT adapter
    whose ``adapter_config.json`` names its base model, so ``peft.AutoPeftModelForCausalLM``
    loads it: ``base`` (the ``model.path`` it was loaded from: a hub id, or a folder written as
    an absolute path) or, for a random-init base, the base weights saved next to the adapter in
    ``<out_dir>/base_model`` (:func:`_ship_base`). Writes into ``<out_dir>.partial`` and swaps it in at the end
    (:func:`export_dir`), so an interrupted export never leaves a folder that looks complete and a
    previous export stays in place until the new one is; rerunning simply writes it again. ``out_dir``
    may be new, empty or a previous export, never a folder of other files (:func:`check_replaceable`).
    ``source`` (the checkpoint) is recorded in the export's manifest (:data:`MANIFEST`).
    """
    out = Path(out_dir)
    is_peft = hasattr(model, "get_base_model")
    if is_peft and getattr(base_model(model), "is_loaded_in_4bit", False):
        # QLoRA: the adapter goes onto the full-precision base, as it would be served
        return export_pretrained(_onto_full_precision_base(model, base), tokenizer, out, merge_lora, base, source)
    restore_linear_head(model)  # saved models are plain transformers models
    try:
        if is_peft and merge_lora:
            to_save = model.merge_and_unload()
        else:
            to_save = model
        config = base_model(to_save).config
        training_cache, config.use_cache = config.use_cache, True  # exports are for inference (KV cache)
        try:
            kind = "adapter" if is_peft and not merge_lora else "model"
            with export_dir(out, kind, source) as partial:  # <out>.partial, swapped in for <out> once complete
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
    dtype = base_model(model).config.dtype
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
    was built from a config or whose ``_name_or_path`` is a relative folder): a hub id as it is
    (a snapshot folder of the hub cache as its hub id and revision); a folder as an absolute path
    (what peft loads from any working directory), its path relative to the export recorded in
    ``rolemrc_base.json`` (``base_relative``), which rolemrc follows when the absolute path is gone
    (the export and its base moved together, to another machine say); a random-init base shipped
    inside (:func:`_ship_base`)."""
    relative = None
    revision = None
    if base is not None and Path(base).expanduser().exists():
        folder = Path(base).expanduser().resolve()
        hub = _hub_snapshot(folder)
        if hub is not None:  # a snapshot in the HF hub cache: its hub id and revision load anywhere
            base, revision = hub
        else:  # a folder: absolute, valid from any working directory; relative too, for rolemrc
            base = str(folder)
            relative = os.path.relpath(folder, out.resolve())
    for config in model.peft_config.values():
        config.base_model_name_or_path = base or SHIPPED_BASE  # a shipped base: re-pointed by _ship_base
        if revision is not None:
            config.revision = revision
    with warnings.catch_warnings():
        # peft looks for the base's config to see whether the vocabulary changed; a random-init
        # base is written just below (same vocabulary), so its warning would only mislead.
        warnings.filterwarnings("ignore", message="Could not find a config file in .*base_model", category=UserWarning)
        model.save_pretrained(partial, safe_serialization=True)
    if base is None:  # random init: the adapter means nothing without these very base weights
        model.unload().save_pretrained(partial / SHIPPED_BASE, safe_serialization=True)
        _ship_base(partial)
    elif relative is not None:  # where the base lies seen from the export: found again after both move
        atomic_write_json(partial / SHIPPED_BASE_RECORD, {"base_relative": relative})


def _hub_snapshot(folder: Path) -> tuple[str, str] | None:
    """(hub id, revision) of a folder of the HF hub cache (``models--<org>--<name>/snapshots/<rev>``)."""
    repo = folder.parent.parent.name
    if folder.parent.name != "snapshots" or not repo.startswith("models--"):
        return None
    return repo.removeprefix("models--").replace("--", "/"), folder.name


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
    cached = cache_root().resolve() / "bases" / digest.hexdigest()[:32]
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


def export_checkpoint(model_cfg: Any, checkpoint: str | Path, out_dir: str | Path, merge_lora: bool | None = None,
                      head: str = "lm") -> Path:
    """Load a checkpoint's weights into the run's model and export it in HF format."""
    return export_state(model_cfg, read_model_state(checkpoint), out_dir, merge_lora, origin=str(checkpoint), head=head)


def export_state(model_cfg: Any, state: dict[str, torch.Tensor], out_dir: str | Path, merge_lora: bool | None = None,
                 origin: str = "state dict", head: str = "lm") -> Path:
    """Build the model skeleton from a run's ``model`` group (its ``head``: the objective's, ``lm``
    or ``score``), load ``state`` (full, unsharded), export.

    The skeleton's parameters live on the meta device (no pretrained weights are read, nothing
    is initialised, no second copy of an 8B model is held): ``state``'s tensors, cast to the
    run's dtype, become the parameters. A missing or extra key is an error.
    """
    from accelerate import init_empty_weights

    tokenizer = load_tokenizer(model_cfg)
    merge = model_cfg.peft.merge_on_export if merge_lora is None else merge_lora
    if model_cfg.quantization.load_in_4bit:  # QLoRA: its adapter onto the full-precision base
        model = load_model(_unquantized(model_cfg), tokenizer)
        trainable = {k for k, p in model.named_parameters() if p.requires_grad}
        _load_adapter(model, {k: v for k, v in state.items() if k in trainable or "lora_" in k}, origin)
        return export_pretrained(model, tokenizer, out_dir, merge, base=model_cfg.path, source=origin)
    with init_empty_weights(include_buffers=False):  # buffers (rotary tables) are computed for real
        model = load_model(skeleton_config(model_cfg), tokenizer, head=head)
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        raise CheckpointError(f"{origin}: weights do not match the run's model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    shapes = [f"{k} {list(v.shape)} (the model's: {list(expected[k].shape)})" for k, v in state.items()
              if tuple(v.shape) != tuple(expected[k].shape)]
    if shapes:
        raise CheckpointError(f"{origin}: weights of another shape than the run's model: {', '.join(shapes[:3])}"
                              f"{f' and {len(shapes) - 3} more' if len(shapes) > 3 else ''}")
    cast = {k: v.to(expected[k].dtype) for k, v in state.items()}
    model.load_state_dict(cast, strict=True, assign=True)
    del cast
    model.tie_weights()  # assign=True replaced tied tensors by two copies of the same values
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise ValueError(f"{origin}: no weights for {still_meta[:5]} after loading")
    return export_pretrained(model, tokenizer, out_dir, merge, base=model_cfg.path, source=origin)


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
