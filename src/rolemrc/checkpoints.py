"""Checkpoints that never look valid when half-written, RNG state, full state dicts from
sharded models and checkpoints, and HF export from any checkpoint."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy

log = logging.getLogger(__name__)


def _swap_in(tmp: Path, final: Path) -> None:
    """Replace ``final`` by ``tmp``; a crash leaves either the old or the new one (or
    ``<final>.old``, which :func:`find_checkpoint` falls back to), never a mix."""
    if final.is_dir():
        old = final.with_name(final.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Single-file checkpoints written to ``<path>.partial``, fsynced, then renamed."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        final = Path(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(final.name + ".partial")
        with tmp.open("wb") as fh:
            torch.save(checkpoint, fh)
            fh.flush()
            os.fsync(fh.fileno())
        _swap_in(tmp, final)


class AtomicModelParallelStrategy(ModelParallelStrategy):
    """FSDP2 strategy whose distributed (DCP) checkpoints are written to a ``.partial``
    folder by all ranks and renamed by rank 0 once every shard is on disk."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        final = Path(filepath)
        tmp = final.with_name(final.name + ".partial")
        if self.is_global_zero and tmp.exists():
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        self.barrier("checkpoint-start")
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier("checkpoint-written")
        if self.is_global_zero:
            _swap_in(tmp, final)
        self.barrier("checkpoint-renamed")


def find_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run: ``checkpoints/last.ckpt`` (or its ``.old``
    twin after a crash mid-swap) or a SLURM preemption checkpoint ``hpc_ckpt_<n>.ckpt``."""
    run_dir = Path(run_dir)
    candidates = [run_dir / "checkpoints" / "last.ckpt", *run_dir.glob("hpc_ckpt_*.ckpt")]
    if not candidates[0].exists():
        candidates[0] = run_dir / "checkpoints" / "last.ckpt.old"
    existing = [c for c in candidates if c.exists()]
    return max(existing, key=lambda c: c.stat().st_mtime) if existing else None


def rng_state() -> dict[str, Any]:
    import numpy as np

    # Plain types and tensors only, so checkpoints load with torch.load(weights_only=True).
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    random.setstate(tuple(state["python"][:1]) + (tuple(state["python"][1]),) + tuple(state["python"][2:]))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict of a (maybe FSDP2-sharded) model; collective, every rank
    must call it. Rank 0 gets the tensors, the other ranks an empty dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def read_model_state(path: str | Path, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The policy weights stored in a Lightning checkpoint: a single ``.ckpt`` file or a
    distributed (DCP) folder, read on one process without a process group."""
    path = Path(path)
    if path.is_dir():
        import torch.distributed.checkpoint as dcp

        if not (path / ".metadata").exists():
            raise ValueError(f"{path}: not a complete distributed checkpoint (no .metadata)")
        reader = dcp.FileSystemReader(str(path))
        meta = reader.read_metadata().state_dict_metadata
        head = "state_dict." + prefix
        template = {
            key[len("state_dict."):]: torch.empty(tuple(m.size), dtype=m.properties.dtype)
            for key, m in meta.items()
            if key.startswith(head) and hasattr(m, "size")
        }
        state = {"state_dict": template}
        dcp.load(state, storage_reader=reader, no_dist=True)
        weights = state["state_dict"]
    else:
        weights = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


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

    from rolemrc.models.export import export_pretrained
    from rolemrc.models.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(run_cfg.model)
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
    merge = run_cfg.model.peft.merge_on_export if merge_lora is None else merge_lora
    return export_pretrained(model, tokenizer, out_dir, merge)


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


def is_training_checkpoint(path: str | Path) -> bool:
    """A Lightning checkpoint this framework writes: a ``.ckpt`` file or a sharded (DCP) folder."""
    path = Path(path)
    return (path.is_file() and path.suffix == ".ckpt") or (path.is_dir() and (path / ".metadata").is_file())


def checkpoint_run_dir(checkpoint: str | Path) -> Path:
    """The run folder (holding ``.hydra/config.yaml``) of a checkpoint: ``<run>/checkpoints/last.ckpt``
    or a SLURM preemption checkpoint ``<run>/hpc_ckpt_<n>.ckpt``."""
    checkpoint = Path(checkpoint).resolve()
    for folder in (checkpoint.parent, checkpoint.parent.parent):
        if (folder / ".hydra" / "config.yaml").is_file():
            return folder
    raise FileNotFoundError(f"{checkpoint}: no .hydra/config.yaml in {checkpoint.parent} or its parent; the run's "
                            "config rebuilds the model (export.py --run-dir <run folder> names it)")


def _signature(checkpoint: Path) -> dict[str, Any]:
    stat = (checkpoint / ".metadata" if checkpoint.is_dir() else checkpoint).stat()
    return {"checkpoint": str(checkpoint), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def hf_model_path(path: str | None) -> str | None:
    """``model.path`` as transformers can load it.

    A training checkpoint (``.ckpt`` file or sharded folder) is exported once, LoRA merged, to
    ``<run>/exports/<checkpoint name>`` (or, where the run folder is not writable, under
    ``$ROLEMRC_CACHE_DIR`` = ``~/.cache/rolemrc``) and that folder is returned; later calls reuse it while
    the checkpoint is unchanged (``last.ckpt`` rewritten: exported again). A run folder stands
    for its final ``export/``, or for its newest checkpoint when it has none. Anything else (an
    HF folder, a hub id, None) is returned as it is. Safe to call from every rank at once.
    """
    if path is None or not Path(path).expanduser().exists():
        return path
    source = Path(path).expanduser().resolve()
    if (source / ".hydra" / "config.yaml").is_file() and not is_training_checkpoint(source):
        if (source / "export" / "config.json").is_file():
            return str(source / "export")
        newest = find_checkpoint(source)
        if newest is None:
            raise FileNotFoundError(f"run folder {source} has neither export/ nor a checkpoint")
        source = newest.resolve()
    if not is_training_checkpoint(source):
        return path
    from filelock import FileLock
    from omegaconf import OmegaConf

    from rolemrc.config import register

    run_dir = checkpoint_run_dir(source)
    out = run_dir / "exports" / source.name.removesuffix(".ckpt")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out.parent).close()  # can we write there at all?
    except OSError as err:  # someone else's run, a read-only mount: a per-user cache instead
        cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        cache = Path(os.environ.get("ROLEMRC_CACHE_DIR") or cache_home / "rolemrc")
        digest = hashlib.sha1(str(source).encode()).hexdigest()[:12]
        out = cache / "exports" / f"{digest}-{source.name.removesuffix('.ckpt')}"
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
        export_checkpoint(OmegaConf.load(run_dir / ".hydra" / "config.yaml"), source, out, merge_lora=True)
        marker.write_text(json.dumps(signature))
    return str(out)


def use_checkpoint_as_model(cfg: Any, *more: str) -> dict[str, str]:
    """Point ``cfg.model.path`` (and the dotted keys in ``more``, e.g. ``compare.path``) at a
    loadable folder where they name a checkpoint or run folder of ours (:func:`hf_model_path`).
    Returns ``{key: what it said before}`` for the keys it changed, for the record."""
    from omegaconf import OmegaConf, open_dict

    changed = {}
    with open_dict(cfg):
        for key in ("model.path", *more):
            value = OmegaConf.select(cfg, key)
            resolved = hf_model_path(value)
            if resolved != value:
                OmegaConf.update(cfg, key, resolved)
                changed[key] = value
    return changed
