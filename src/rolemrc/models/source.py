"""What ``model.path`` names, turned into something transformers loads.

``model.path`` (and ``compare.path``) may be a hub id, an HF folder, or anything this framework
wrote: a run folder, a ``.ckpt`` file, a sharded (DCP) checkpoint folder, an adapter-only LoRA
export. Checkpoints are exported once (LoRA merged) next to their run and reused while
unchanged; an adapter is merged once into the base its ``adapter_config.json`` names.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from rolemrc.checkpointing.find import checkpoint_run_dir, find_checkpoint, is_training_checkpoint
from rolemrc.checkpointing.verify import check_checkpoint
from rolemrc.config import model_head, register
from rolemrc.errors import InputNotFound
from rolemrc.fileio import atomic_write_json, cache_root
from rolemrc.models.adapters import is_adapter_folder, merged_adapter_path
from rolemrc.models.export import export_checkpoint
from rolemrc.models.loading import check_source

log = logging.getLogger(__name__)


def _signature(checkpoint: Path) -> dict[str, Any]:
    stat = (checkpoint / ".metadata" if checkpoint.is_dir() else checkpoint).stat()
    return {"checkpoint": str(checkpoint), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def hf_model_path(path: str | None) -> str | None:
    """``model.path`` as transformers can load it.

    A training checkpoint (``.ckpt`` file or sharded folder) is exported once, LoRA merged, to
    ``<run>/exports/<checkpoint name>`` (or, where the run folder is not writable, under
    ``$ROLEMRC_CACHE_DIR`` = ``~/.cache/rolemrc``) and that folder is returned; later calls reuse it while
    the checkpoint is unchanged (``last.ckpt`` rewritten: exported again). A run folder stands
    for its final ``export/``, or for its newest checkpoint when it has none. An adapter-only LoRA
    export (``adapter_config.json``, no ``config.json``) stands for its merge with its base model
    (:func:`rolemrc.models.adapters.merged_adapter_path`). Anything else (an HF folder, a hub id,
    None) is returned as it is. Safe to call from every rank at once.
    """
    if path is None or not Path(path).expanduser().exists():
        return path
    source = Path(path).expanduser().resolve()
    if is_adapter_folder(source):
        return merged_adapter_path(source)
    if (source / ".hydra" / "config.yaml").is_file() and not is_training_checkpoint(source):
        if (source / "export" / "config.json").is_file():
            return str(source / "export")
        newest = find_checkpoint(source)
        if newest is None:
            raise InputNotFound(f"run folder {source} has neither export/ nor a checkpoint")
        source = newest.resolve()
    if not is_training_checkpoint(source):
        return path
    check_checkpoint(source)  # truncated or corrupt: named before anything else is looked at
    from filelock import FileLock
    from omegaconf import OmegaConf

    run_dir = checkpoint_run_dir(source)
    out = run_dir / "exports" / source.name.removesuffix(".ckpt")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out.parent).close()  # can we write there at all?
    except OSError as err:  # someone else's run, a read-only mount: a per-user cache instead
        digest = hashlib.sha1(str(source).encode()).hexdigest()[:12]
        out = cache_root() / "exports" / f"{digest}-{source.name.removesuffix('.ckpt')}"
        log.warning("cannot write in %s (%s): exporting %s to %s", run_dir / "exports", err, source, out)
        out.parent.mkdir(parents=True, exist_ok=True)
    marker = out / "rolemrc_source.json"
    with FileLock(str(out) + ".lock"):
        signature = _signature(source)
        if marker.is_file() and json.loads(marker.read_text()) == signature:
            log.info("model.path %s: using its export %s", source, out)
            return str(out)
        register()
        log.info("model.path %s: exporting it to %s", source, out)
        saved = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
        export_checkpoint(saved.model, source, out, merge_lora=True, head=model_head(saved))
        atomic_write_json(marker, signature, indent=None)
    return str(out)


def check_model_path(value: str | None, key: str = "model.path") -> None:
    """Cheap, before any other check of a run: ``value`` names something a model loads from. A
    missing file or folder, a hub id not in the offline cache, and a folder holding no model are
    each one error naming ``key`` (:func:`rolemrc.models.paths.check_source`)."""
    check_source(value, key)


def resolve_model_sources(cfg: Any, *more: str) -> tuple[Any, dict[str, str]]:
    """A copy of ``cfg`` whose ``model.path`` (and the dotted keys in ``more``, e.g.
    ``compare.path``) name loadable folders where they named a checkpoint or run folder of ours
    (:func:`hf_model_path`), and ``{key: what it said before}`` for the keys that changed, for
    the record. ``cfg`` itself is left as it is."""
    from omegaconf import OmegaConf, open_dict

    out = copy.deepcopy(cfg)
    changed = {}
    with open_dict(out):
        for key in ("model.path", *more):
            value = OmegaConf.select(out, key)
            resolved = hf_model_path(value)
            if resolved != value:
                OmegaConf.update(out, key, resolved)
                changed[key] = value
    return out, changed
