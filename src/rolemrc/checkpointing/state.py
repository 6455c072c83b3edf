"""Model weights out of checkpoints and sharded models, as full (unsharded) state dicts, and a
checkpoint's other entries read without its weights."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from rolemrc.checkpointing.verify import check_checkpoint, reading, storage_reader


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict of a (maybe FSDP2-sharded) model; collective, every rank
    must call it. Rank 0 gets the tensors, the other ranks an empty dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def read_model_state(path: str | Path, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The policy weights stored in a Lightning checkpoint: a single ``.ckpt`` file or a
    distributed (DCP) folder, read on one process without a process group. A truncated or
    corrupt one is a :class:`~rolemrc.errors.CheckpointError` naming it: checked first, cheaply,
    and again for damage only reading the tensors finds (bytes overwritten inside the file)."""
    path = check_checkpoint(path)
    if path.is_dir():
        import torch.distributed.checkpoint as dcp

        reader = storage_reader(path)  # .metadata read without plain pickle (verify.read_metadata)
        meta = reader.read_metadata().state_dict_metadata
        head = "state_dict." + prefix
        template = {
            key[len("state_dict."):]: torch.empty(tuple(m.size), dtype=m.properties.dtype)
            for key, m in meta.items()
            if key.startswith(head) and hasattr(m, "size")
        }
        state = {"state_dict": template}
        with reading(path):
            dcp.load(state, storage_reader=reader, no_dist=True)
        weights = state["state_dict"]
    else:
        with reading(path):
            weights = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


def read_checkpoint_entries(path: str | Path, keys: Iterable[str]) -> dict[str, Any]:
    """The top-level entries ``keys`` of a Lightning checkpoint that it has, read without its
    weights: from a ``.ckpt`` file (memory-mapped; tensors copied out of the map) or from a
    distributed (DCP) folder's ``meta.pt``, where Lightning's ModelParallelStrategy writes the
    non-tensor entries. Raises what reading raises (a missing or unreadable file)."""
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    p = Path(path)
    if p.is_dir():
        ckpt = torch.load(p / _METADATA_FILENAME, map_location="cpu", weights_only=True)
    else:
        ckpt = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    return {k: map_tensors(ckpt[k], torch.Tensor.clone) for k in keys if k in ckpt}  # nothing points into the map


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to every tensor in it (in nested dicts, lists, tuples)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(v, fn) for v in value)
    return value
