"""Adapter-only LoRA exports (``adapter_config.json`` + ``adapter_model.safetensors``, no
``config.json``) as ``model.path``: the adapter is loaded through peft onto the base model its
``adapter_config.json`` names (``base_model_name_or_path``, which rolemrc's exports always
write), merged, and saved once, in rolemrc's cache, as a plain HF folder that everything else loads.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from rolemrc.errors import ModelSourceError
from rolemrc.fileio import atomic_dir, atomic_write_json, cache_root

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"


def is_adapter_folder(path: str | Path) -> bool:
    """A PEFT adapter export: ``adapter_config.json`` and no ``config.json`` of a full model."""
    path = Path(path)
    return path.is_dir() and (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file()


def adapter_base(adapter: str | Path) -> str:
    """The base model an adapter export was trained on (a hub id or a folder), checked."""
    adapter = Path(adapter)
    config_file = adapter / ADAPTER_CONFIG
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ModelSourceError(f"{config_file}: unreadable ({type(err).__name__}: {err})") from None
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not base:
        raise ModelSourceError(
            f"{adapter} is an adapter-only LoRA export whose {ADAPTER_CONFIG} names no base model "
            "(base_model_name_or_path is null): export the run merged (python export.py <checkpoint> --merge), "
            "or write the base model's hub id or folder into base_model_name_or_path")
    local = Path(base).expanduser()
    beside = adapter / local
    if not local.is_absolute() and beside.is_dir():  # a base shipped inside the export, named relatively
        local = beside
    shipped = _shipped_base(adapter)
    if shipped is not None:  # the copy that travels with the export, whatever the config names (export.py: _ship_base)
        local = shipped
    elif not local.exists():  # the folder named moved: where it lies from the export, if recorded
        relative = _recorded(adapter, "base_relative")
        if isinstance(relative, str) and (adapter / relative / "config.json").is_file():
            local = adapter / relative
    if not local.exists() and (base.startswith((".", "/", "~")) or base.count("/") > 1):
        raise ModelSourceError(f"{config_file}: base_model_name_or_path={base}: no such folder")
    if not (adapter / "adapter_model.safetensors").is_file() and not (adapter / "adapter_model.bin").is_file():
        raise ModelSourceError(f"{adapter}: {ADAPTER_CONFIG} without adapter_model.safetensors")
    return str(local.resolve()) if local.exists() else base


def _recorded(adapter: Path, key: str) -> object:
    """``key`` of the export's ``rolemrc_base.json`` (None without one)."""
    record = adapter / "rolemrc_base.json"
    if not record.is_file():
        return None
    try:
        return json.loads(record.read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError, AttributeError) as err:
        raise ModelSourceError(f"{record}: unreadable ({type(err).__name__}: {err})") from None


def _shipped_base(adapter: Path) -> Path | None:
    """The base model folder shipped inside ``adapter``, as its ``rolemrc_base.json`` names it."""
    record = adapter / "rolemrc_base.json"
    name = _recorded(adapter, "shipped_base")
    if name is None:
        return None
    if not isinstance(name, str) or Path(name).is_absolute() or not (adapter / name / "config.json").is_file():
        raise ModelSourceError(f"{record}: shipped_base={name!r}: no base model folder inside {adapter}")
    return adapter / name


# The files of an adapter export that make its merge what it is (weights, config, tokenizer).
_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "tokenizer*",
                  "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.*")


def merge_key(adapter: Path, base: str) -> str:
    """The content key of ``adapter`` merged into ``base``: a hash of the adapter's files
    (:data:`_ADAPTER_FILES`) and of the base: a hub id as it is, a folder by its files' names,
    sizes and modification times (not read: a base may be 16 GB). The same adapter and base give
    the same key wherever the export lies; a changed adapter or base, another."""
    digest = hashlib.sha256()
    for f in sorted(p for p in adapter.iterdir() if p.is_file() and any(p.match(pat) for pat in _ADAPTER_FILES)):
        digest.update(f"{f.name}\0".encode())
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                digest.update(block)
    local = Path(base)
    if local.is_dir():
        for f in sorted(p for p in local.iterdir() if p.is_file()):
            stat = f.stat()
            digest.update(f"base:{f.name}:{stat.st_size}:{stat.st_mtime_ns}\0".encode())
    else:
        digest.update(f"base:{base}".encode())
    return digest.hexdigest()[:32]


def merged_adapter_path(adapter: str | Path) -> str:
    """A plain HF folder holding ``adapter`` merged into its base model, in rolemrc's cache
    (``$ROLEMRC_CACHE_DIR/merged/<content key>``, :func:`merge_key`; the adapter's own folder is
    never written): written once (under a file lock, into ``<out>.partial`` then swapped in) and
    reused while the adapter and its base are unchanged."""
    from filelock import FileLock

    adapter = Path(adapter).expanduser().resolve()
    base = adapter_base(adapter)
    key = merge_key(adapter, base)
    out = cache_root() / "merged" / key
    out.parent.mkdir(parents=True, exist_ok=True)
    marker = out / "rolemrc_source.json"
    signature = {"key": key, "adapter": str(adapter), "base": base}
    with FileLock(str(out) + ".lock"):
        if marker.is_file() and json.loads(marker.read_text()).get("key") == key:
            log.info("model.path %s: using its merge with %s in %s", adapter, base, out)
            return str(out)
        log.info("model.path %s: merging the adapter into its base %s, once, into %s", adapter, base, out)
        _merge(adapter, base, out)
        atomic_write_json(marker, signature, indent=None)
    return str(out)


def _merge(adapter: Path, base: str, out: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    revision = json.loads((adapter / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("revision")
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype="auto", trust_remote_code=False, revision=revision)
    except OSError as err:
        raise ModelSourceError(f"{adapter / ADAPTER_CONFIG}: its base model {base} cannot be loaded "
                               f"({str(err).splitlines()[0]})") from None
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    has_tokenizer = any((adapter / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    tokenizer = AutoTokenizer.from_pretrained(str(adapter) if has_tokenizer else base, trust_remote_code=False)
    merged.config.use_cache = True
    with atomic_dir(out) as partial:
        merged.save_pretrained(partial, safe_serialization=True)
        tokenizer.save_pretrained(partial)
