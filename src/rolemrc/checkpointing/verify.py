"""A cheap look at a checkpoint before anything loads it: a truncated, empty or corrupt one (or
something that is not a checkpoint) is a :class:`~rolemrc.errors.CheckpointError` naming the
path and what is wrong, not an ``EOFError`` from deep inside ``torch.load``.

Cheap means the tensors are not read: a single-file checkpoint's zip directory is checked
against the file's size and its pickle is unpickled with ``weights_only=True`` over a memory
map; a sharded (DCP) folder's ``.metadata`` is read and every shard file it points at must
exist and be long enough.

Nothing here unpickles arbitrary objects. ``.metadata`` is a plain pickle (torch's
``FileSystemReader.read_metadata`` calls ``pickle.load``): it is read by :func:`read_metadata`,
an unpickler that builds only DCP's metadata classes, torch dtypes/layouts/``Size`` and paths,
so a crafted one is refused before it can run anything. The small non-tensor entries a DCP
shard holds (optimizer hyper-parameters: torch's loader reads them with ``weights_only=False``)
and Lightning's ``meta.pt`` must load with ``weights_only=True``. Every file the folder's
checkpoint reads (``.metadata``, the shards, ``meta.pt``) must be inside the folder, also once
links are followed; and every tensor ``.metadata`` declares must fit in the bytes the shards
hold for it (a crafted size would otherwise be allocated in full by a reader that builds its
tensors from ``.metadata``, e.g. :func:`rolemrc.checkpointing.state.read_model_state`).

Damage inside the tensor records (bytes overwritten, the file still of its right size) shows
only when the tensors are read: :func:`reading` turns what reading raises
into a :class:`~rolemrc.errors.CheckpointError` naming the file. Bytes flipped inside a tensor's
own data, headers intact, are not detected.
"""

from __future__ import annotations

import io
import pickle
import re
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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


# What a DCP ``.metadata`` pickle may build (torch 2.x writes exactly these): anything else,
# e.g. ``os.system`` or ``builtins.eval``, is refused by find_class before it can be called.
_DCP_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # name -> torch.layout, a table look-up
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :data:`_DCP_GLOBALS` and torch dtypes, layouts and
    memory formats."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        plain_values = (torch.dtype, torch.layout, torch.memory_format)  # torch.float32, torch.strided, ...
        if module == "torch" and isinstance(getattr(torch, name, None), plain_values):
            return getattr(torch, name)
        if name in _DCP_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a checkpoint's metadata never holds "
                                     "(refused: unpickling it could run code)")


def read_metadata(path: str | Path) -> Any:
    """The ``Metadata`` of the sharded (DCP) checkpoint folder ``path``, read without running any
    code the file names (:class:`_MetadataUnpickler`) and checked for shape; a crafted or damaged
    file is a :class:`~rolemrc.errors.CheckpointError` naming it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta

    metadata = Path(path) / ".metadata"
    try:
        with metadata.open("rb") as fh:
            meta = _MetadataUnpickler(fh).load()
    except Exception as err:  # a truncated/corrupt/crafted pickle: EOFError, UnpicklingError, ...
        raise CheckpointError(f"{metadata}: unreadable, the checkpoint is corrupt or not a checkpoint "
                              f"({_first_line(err)})") from None
    if not (isinstance(meta, Metadata) and isinstance(getattr(meta, "storage_data", None), dict)
            and isinstance(getattr(meta, "state_dict_metadata", None), dict)):
        raise CheckpointError(f"{metadata}: not a sharded checkpoint's metadata (a {type(meta).__name__})")
    for index, item in meta.storage_data.items():
        if not (isinstance(index, MetadataIndex) and isinstance(index.fqn, str) and isinstance(item, _StorageInfo)
                and isinstance(item.relative_path, str) and isinstance(item.offset, int)
                and isinstance(item.length, int) and item.offset >= 0 and item.length >= 0):
            raise CheckpointError(f"{metadata}: malformed storage entry {index!r:.120}")
        if Path(item.relative_path).name != item.relative_path or item.relative_path in ("", ".", ".."):
            raise CheckpointError(f"{metadata}: storage entry {index.fqn} points outside the checkpoint folder "
                                  f"({item.relative_path!r})")
    if getattr(meta, "storage_meta", None) is None:  # as torch's reader does for old checkpoints
        meta.storage_meta = StorageMeta()
    return meta


def storage_reader(path: str | Path) -> Any:
    """A ``FileSystemReader`` for ``dcp.load`` whose ``read_metadata`` is :func:`read_metadata`."""
    from torch.distributed.checkpoint import FileSystemReader

    class _SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            meta = read_metadata(self.path)
            meta.storage_meta.load_id = self.load_id
            return meta

    return _SafeReader(str(path))


def _refused(err: pickle.UnpicklingError) -> str:
    """What torch's ``weights_only`` unpickler refused. Its message advises ``weights_only=False``,
    which would run arbitrary code: never pass that on, keep only what the unpickler found."""
    found = re.search(r"WeightsUnpickler error: ([^\n]*)", str(err))
    return found.group(1).split(" Please use")[0].strip() if found else "it holds objects other than tensors"


def _check_plain(path: Path, what: str, data: Any) -> None:
    """``data`` (a file or file-like) must load with ``torch.load(weights_only=True)``."""
    import torch

    try:
        torch.load(data, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path}: {what} is not plain data (torch.load with weights_only=True: {_refused(err)}); "
                              "refused: loading it could run code") from None
    except Exception as err:
        raise CheckpointError(f"{path}: {what} is corrupt ({_first_line(err)})") from None


def _inside(folder: Path, relative: str) -> None:
    """``folder/relative``, followed through any links, must stay inside ``folder``."""
    entry = folder / relative
    if not (entry.is_symlink() or entry.exists()):
        return  # missing: the caller names it
    target = entry.resolve()
    if not target.is_relative_to(folder.resolve()):
        raise CheckpointError(f"{folder}: {relative} is a link to {target}, outside the checkpoint folder; refused "
                              "(a checkpoint reads only its own files: copy the file into the folder if you trust it)")


def _human(size: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:,} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    return str(size)


def _check_declared_sizes(path: Path, meta: Any) -> None:
    """Each tensor of ``.metadata`` fits in the bytes its shard entries hold (each chunk inside the
    tensor's declared shape): checked before anything allocates a tensor of the declared size.
    Entries stored through transforms (compression) are only checked for shape."""
    import math

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored: dict[str, int] = {}
    transformed: set[str] = set()
    for index, item in meta.storage_data.items():
        stored[index.fqn] = stored.get(index.fqn, 0) + int(item.length)
        if getattr(item, "transform_descriptors", None):
            transformed.add(index.fqn)
    for fqn, tensor in meta.state_dict_metadata.items():
        if not isinstance(tensor, TensorStorageMetadata):
            continue
        shape = tuple(int(d) for d in tensor.size)
        dtype = getattr(tensor.properties, "dtype", None)
        itemsize = getattr(dtype, "itemsize", None)
        if any(d < 0 for d in shape) or not isinstance(itemsize, int):
            raise CheckpointError(f"{path / '.metadata'}: entry {fqn} declares an invalid tensor ({shape}, {dtype})")
        for chunk in tensor.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                    o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape)):
                raise CheckpointError(f"{path / '.metadata'}: entry {fqn} has a chunk (offsets {list(offsets)}, sizes "
                                      f"{list(sizes)}) outside its declared shape {list(shape)}; refused")
        if fqn in transformed:
            continue
        needs = math.prod(shape) * itemsize
        if needs > stored.get(fqn, 0):
            raise CheckpointError(
                f"{path / '.metadata'}: entry {fqn} declares a tensor of shape {list(shape)} ({_human(needs)} of "
                f"{str(dtype).removeprefix('torch.')}) but the shards hold {_human(stored.get(fqn, 0))} for it; refused "
                "(a damaged or crafted checkpoint: nothing was allocated)")


def _check_sharded(path: Path) -> None:
    metadata = path / ".metadata"
    if not metadata.is_file():
        raise CheckpointError(f"{path}: not a complete sharded checkpoint (no .metadata; an interrupted save?)")
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    _inside(path, ".metadata")
    meta = read_metadata(path)
    needed: dict[str, int] = {}
    for item in meta.storage_data.values():
        end = int(item.offset) + int(item.length)
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), end)
    for relative, end in sorted(needed.items()):
        shard = path / relative
        _inside(path, relative)
        if not shard.is_file():
            raise CheckpointError(f"{path}: shard file {relative} is missing")
        size = shard.stat().st_size
        if size < end:
            raise CheckpointError(f"{shard}: truncated ({size} bytes; .metadata places data up to byte {end})")
    _check_declared_sizes(path, meta)
    # torch's loader unpickles these entries with weights_only=False: they must be plain values
    for index, item in meta.storage_data.items():
        if not isinstance(meta.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        if item.transform_descriptors:
            raise CheckpointError(f"{path}: entry {index.fqn} is stored through transforms "
                                  f"{list(item.transform_descriptors)} that rolemrc cannot check; refused")
        with (path / item.relative_path).open("rb") as fh:
            fh.seek(item.offset)
            blob = fh.read(item.length)
        _check_plain(path / item.relative_path, f"entry {index.fqn}", io.BytesIO(blob))
    extra = path / "meta.pt"  # Lightning's non-tensor entries (lightning.fabric's _METADATA_FILENAME)
    _inside(path, "meta.pt")
    if extra.is_file():
        _check_plain(extra, "Lightning's meta.pt", extra)


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
    import torch

    try:
        content = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path}: corrupt, or not a checkpoint of plain tensors and containers "
                              f"(torch.load with weights_only=True: {_refused(err)})") from None
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
