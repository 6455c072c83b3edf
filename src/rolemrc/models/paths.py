"""What a model key (``model.path``, ``model.tokenizer``, a reward model's ``path``) names, checked
on the file system before anything slow is imported or loaded: a folder that does not exist or
holds no model (tokenizer) files, a hub id not in the local cache while the hub is switched off,
a config that names code of its own (``auto_map``) while ``model.trust_remote_code`` is off.
Nothing here imports torch or transformers (``train.py`` calls :func:`check_model_paths` before them)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rolemrc.errors import InputNotFound, ModelSourceError


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def offline_hint(key: str, source: str) -> str:
    return (" rolemrc reads the hub only with HF_HUB_OFFLINE=0 set, and it is not in the local cache: "
            f"rerun with HF_HUB_OFFLINE=0 to download it, download it where there is network "
            f"(`hf download {source}`), or point {key} at a local folder.")


def remote_code_refused(key: str, source: str) -> str:
    return (f"{key}={source}: its config names custom code (auto_map) that transformers would have to run, "
            "refused: read that code, and only if you trust it set model.trust_remote_code=true")


def check_remote_code(source: str | None, key: str, trusted: bool) -> None:
    """A local folder whose ``config.json`` names code of its own (``auto_map``) is refused unless
    ``trusted``, before anything reads its shapes (the memory estimate) or loads it: the refusal
    transformers would give at load time, given first."""
    if source is None or trusted:
        return
    config = Path(source).expanduser() / "config.json"
    try:
        spec = json.loads(config.read_text()) if config.is_file() else None
    except (OSError, ValueError):
        return  # unreadable: transformers names it when it loads
    if isinstance(spec, dict) and spec.get("auto_map"):
        raise ModelSourceError(remote_code_refused(key, source))


# What names a file (a training checkpoint, loose weights), not a folder or a hub repository.
_FILE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".safetensors")


# Files of a tokenizer transformers can load (a fast tokenizer, its config, a SentencePiece or BPE vocabulary).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


# Keys that may also name a run folder, checkpoint or adapter export (rolemrc.models.source.resolve_model_sources).
ROLEMRC_SOURCE_KEYS = ("model.path", "compare.path")


def is_rolemrc_source(folder: Path) -> bool:
    """A folder :func:`rolemrc.models.source.hf_model_path` turns into a model: an adapter export,
    a run folder or a sharded training checkpoint."""
    return ((folder / "adapter_config.json").is_file() or (folder / ".hydra" / "config.yaml").is_file()
            or (folder / ".metadata").is_file())


def folder_problem(folder: Path, key: str) -> str | None:
    """What an existing local ``folder`` named by ``key`` lacks to be loaded, or None: a tokenizer
    key (``*.tokenizer``) needs a tokenizer's files, a model key a ``config.json`` (or to be an
    adapter export, run folder or checkpoint of rolemrc's). transformers would otherwise report
    an empty folder as a missing sentencepiece or tiktoken package."""
    if not folder.is_dir():
        return None
    if key.endswith("tokenizer"):
        if any((folder / name).is_file() for name in TOKENIZER_FILES):
            return None
        return (f"{key}={folder}: the folder has no tokenizer files ({', '.join(TOKENIZER_FILES)}): point {key} at "
                "a model export or a tokenizer's folder")
    if (folder / "config.json").is_file() or is_rolemrc_source(folder):
        return None
    if key in ROLEMRC_SOURCE_KEYS:
        return (f"{key}={folder}: the folder has no model files (no config.json, and it is no adapter export, run "
                f"folder or checkpoint of rolemrc's): point {key} at a model export (a run's export/ folder), a run "
                "folder, a checkpoint or a hub id")
    return f"{key}={folder}: the folder has no model files (no config.json): point {key} at a model's folder or a hub id"


def check_source(value: str | None, key: str) -> None:
    """A local folder that does not exist, or holds no model (tokenizer) files, is named as such
    (transformers' own errors would talk about repository ids, or about sentencepiece). A hub id
    is ``owner/name``; anything else is taken as local. With the hub switched off, a hub id whose
    files are not in the local cache is refused here, before anything slow runs (transformers
    would find out only when loading)."""
    if value is not None and Path(value).expanduser().exists():
        problem = folder_problem(Path(value).expanduser(), key)
        if problem is not None:
            raise InputNotFound(problem)
        return
    if value is None:
        return
    if Path(value).suffix in _FILE_SUFFIXES:  # a checkpoint or weights file, never a hub id
        raise InputNotFound(f"{key}={value}: no such file")
    if value.startswith((".", "/", "~")) or value.count("/") > 1:
        raise InputNotFound(f"{key}={value}: no such folder (a hub id is written owner/name)")
    if hub_offline():
        from huggingface_hub import try_to_load_from_cache

        wanted = "tokenizer_config.json" if key.endswith("tokenizer") else "config.json"
        if not isinstance(try_to_load_from_cache(value, wanted), str):
            raise ModelSourceError(f"{key}={value}: cannot load it (no {wanted} of it in the local hub cache)."
                                   + offline_hint(key, value))


def check_model_paths(cfg: Any) -> None:
    """``cfg`` (a ``model`` node): ``model.path`` and ``model.tokenizer`` name something loadable
    (:func:`check_source`), a folder's config names no code of its own unless trusted
    (:func:`check_remote_code`), and a model folder that is also the tokenizer's has its files."""
    check_source(cfg.path, "model.path")
    check_source(cfg.tokenizer, "model.tokenizer")
    check_remote_code(cfg.path, "model.path", bool(cfg.trust_remote_code))
    if cfg.path is not None and cfg.tokenizer is None:  # the tokenizer comes from model.path's folder too
        folder = Path(cfg.path).expanduser()
        if folder.is_dir() and not is_rolemrc_source(folder) and folder_problem(folder, "model.tokenizer"):
            raise InputNotFound(f"model.path={cfg.path}: the folder has a model but no tokenizer files "
                                f"({', '.join(TOKENIZER_FILES)}): set model.tokenizer=<the tokenizer's folder or hub id>")
