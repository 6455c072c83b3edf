"""A cheap look at a checkpoint before anything loads it: a truncated, empty or corrupt one (or
something that is not a checkpoint) is a :class:`~rolemrc.errors.CheckpointError` naming the
path and what is wrong, not an ``EOFError`` from deep inside ``torch.load``.

Cheap means the tensors are not read: a single-file checkpoint's zip directory is checked
against the file's size and its pickle is unpickled with ``weights_only=True`` over a memory
map; a sharded (DCP) folder's ``.metadata`` is read and every shard file it points at must
exist and be long enough. Damage inside the tensor records (bytes overwritten, the file still of
its right size) shows only when the tensors are read: :func:`reading` turns what reading raises
into a :class:`~rolemrc.errors.CheckpointError` naming the file. Bytes flipped inside a tensor's
own data, headers intact, are not detected.
"""

from __future__ import annotations

import re
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rolemrc.errors import CheckpointError, InputNotFound, UserError


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _reason(err: BaseException) -> str:
    """What went wrong reading a checkpoint, in one line: a distributed checkpoint's failure is the
    first rank's own exception; torch's advice after the first sentence is left out."""
    failures = getattr(err, "failures", None)  # torch.distributed.checkpoint's CheckpointException
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        err = inner[0] if isinstance(inner, tuple) else inner
    line = _first_line(err)
    return line.split(". ")[0].removesuffix(".")


@contextmanager
def reading(path: str | Path) -> Iterator[None]:
    """Around reading a checkpoint's tensors (``torch.load``, ``dcp.load``, Lightning's restore):
    an error of the file's content (a zip record with a bad header, a shard whose bytes were
    overwritten) becomes a :class:`~rolemrc.errors.CheckpointError` naming the checkpoint."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (RuntimeError, EOFError, OSError, ValueError, CheckpointException) as err:
        if isinstance(err, UserError) or (isinstance(err, OSError) and not Path(path).exists()):
            raise
        raise CheckpointError(f"{path}: corrupt, cannot be read ({_reason(err)})") from err


def _check_sharded(path: Path) -> None:
    metadata = path / ".metadata"
    if not metadata.is_file():
        raise CheckpointError(f"{path}: not a complete sharded checkpoint (no .metadata; an interrupted save?)")
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # a truncated/corrupt pickle: any of EOFError, UnpicklingError, ...
        raise CheckpointError(f"{metadata}: unreadable, the checkpoint is corrupt ({_first_line(err)})") from None
    needed: dict[str, int] = {}
    for item in (meta.storage_data or {}).values():
        end = int(item.offset) + int(item.length)
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), end)
    for relative, end in sorted(needed.items()):
        shard = path / relative
        if not shard.is_file():
            raise CheckpointError(f"{path}: shard file {relative} is missing")
        size = shard.stat().st_size
        if size < end:
            raise CheckpointError(f"{shard}: truncated ({size} bytes; .metadata places data up to byte {end})")


def _check_file(path: Path) -> None:
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"{path}: empty file (0 bytes), not a checkpoint")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path}: truncated or not a PyTorch checkpoint (no zip directory at its end; "
                              f"{size} bytes)")
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError) as err:
        raise CheckpointError(f"{path}: corrupt zip directory ({_first_line(err)})") from None
    for entry in entries:
        if entry.header_offset + entry.compress_size > size:
            raise CheckpointError(f"{path}: truncated ({size} bytes; entry {entry.filename} ends past the end)")
    import pickle

    import torch

    try:
        content = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        # torch's message advises weights_only=False, which would run arbitrary code: never pass
        # that on. Keep only what the unpickler found.
        found = re.search(r"WeightsUnpickler error: ([^\n]*)", str(err))
        why = found.group(1).split(" Please use")[0].strip() if found else "it holds objects other than tensors"
        raise CheckpointError(f"{path}: corrupt, or not a checkpoint of plain tensors and containers "
                              f"(torch.load with weights_only=True: {why})") from None
    except Exception as err:
        raise CheckpointError(f"{path}: corrupt ({_first_line(err)})") from None
    if not isinstance(content, dict) or "state_dict" not in content:
        raise CheckpointError(f"{path}: not a Lightning checkpoint (no state_dict in it)")


def check_checkpoint(path: str | Path) -> Path:
    """``path`` if it looks like a complete checkpoint (a ``.ckpt`` file or a sharded DCP folder),
    else :class:`~rolemrc.errors.CheckpointError` (or :class:`~rolemrc.errors.InputNotFound`)
    saying what is wrong with it."""
    path = Path(path).expanduser()
    if path.is_dir():
        _check_sharded(path)
    elif path.is_file():
        _check_file(path)
    else:
        raise InputNotFound(f"checkpoint not found: {path}")
    return path
