"""Atomic file writes: the one helper every writer of finished results uses.

A file is written to a temporary sibling, flushed and fsynced, then renamed over the target,
so a reader (or a resumed run) sees either the old content or the new, never a torn file.
A folder (an export, a sharded checkpoint) is written as ``<name>.partial`` and swapped in
complete (:func:`atomic_dir`, :func:`swap_in`).

The files a user hands in are read here too: a YAML/JSON mapping (:func:`read_mapping`) and the
placeholders of a prompt template (:func:`template_fields`), each fault a one-line ConfigError.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import string
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import IO, Any

import yaml

from rolemrc.errors import ConfigError, StorageError

# Storage faults a user fixes (room, permissions, a read-only mount), not bugs.
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def storage_error(err: OSError, path: str | Path, what: str, elsewhere: str) -> StorageError | OSError:
    """``err`` as a one-line :class:`~rolemrc.errors.StorageError` when it is a storage fault
    (:data:`STORAGE_ERRNOS`): ``<path>: <what> failed: <reason>; free space there (a full disk or
    quota) / make it writable (the rest), or <elsewhere>``; any other error is returned as it is."""
    if isinstance(err, StorageError) or err.errno not in STORAGE_ERRNOS:
        return err
    reason = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
              errno.EROFS: "read-only file system"}.get(err.errno, err.strerror or type(err).__name__)
    remedy = "free space there" if err.errno in (errno.ENOSPC, errno.EDQUOT) else "make it writable"
    return StorageError(f"{path}: {what} failed: {reason}; {remedy}, or {elsewhere}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_temps(folder: str | Path, name: str) -> list[Path]:
    """Delete the temporary files ``.<target>.tmp<pid>`` in ``folder`` (what :func:`atomic_open`
    and :func:`atomic_save` write before the rename) of targets whose name matches the regular
    expression ``name``, left by a process that is no longer alive on this machine (killed
    mid-write); a live writer's, or this process's, is left alone. Returns what was deleted."""
    pattern = re.compile(r"\.(?:" + name + r")\.tmp(\d+)")
    removed = []
    for tmp in Path(folder).glob(".*.tmp*"):
        found = pattern.fullmatch(tmp.name)
        if found is None or int(found.group(1)) == os.getpid() or _pid_alive(int(found.group(1))):
            continue
        remove(tmp)
        removed.append(tmp)
    return removed


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO[Any]]:
    """``with atomic_open(p) as f: f.write(...)``: ``p`` appears complete when the block ends,
    and is untouched if the block raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    binary = "b" in mode
    try:
        with open(tmp, mode, encoding=None if binary else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)


def atomic_write_json(path: str | Path, obj: Any, indent: int | None = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, ensure_ascii=False) + "\n")


def atomic_save(path: str | Path, save: Callable[[str], None]) -> None:
    """For writers that take a path (``safetensors.save_file``, ``torch.save``): ``save(tmp)``,
    fsync, rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        save(str(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def read_mapping(path: str | Path, key: str, expected: str, about: str = "") -> tuple[Path, dict[Any, Any]]:
    """The file ``path`` (given as ``key``) read as a non-empty YAML (or JSON) mapping, and its
    expanded path. A fault is a ConfigError: ``<key>=<path>: no such file (<about>)``, ``not UTF-8
    YAML/JSON (<the parser's first line>)``, or ``expected <expected>``."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{key}={path}: no such file" + (f" ({about})" if about else ""))
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}={p}: not UTF-8 YAML/JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{key}={p}: expected {expected}")
    return p, raw


def _braced(names: Collection[str]) -> str:
    return ", ".join("{" + n + "}" for n in names)


def template_fields(text: str, where: str, known: Collection[str], label: str = "known:",
                    error: type[Exception] = ConfigError) -> set[str]:
    """The ``{name}`` placeholders of the ``str.format`` template ``text``, checked: balanced braces
    (a literal brace is ``{{`` or ``}}``) and only ``known`` names (listed in their order after
    ``label``). A fault is an ``error`` starting with ``where``."""
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}
    except ValueError as e:
        raise error(f"{where}: bad braces ({e}); write a literal brace as {{{{ or }}}}") from None
    bad = sorted(n for n in names if n not in known)
    if bad:
        raise error(f"{where}: unknown placeholder(s) {_braced(bad)}; {label} {_braced(known)}")
    return names


def cache_root() -> Path:
    """rolemrc's cache folder: ``$ROLEMRC_CACHE_DIR``, else ``$XDG_CACHE_HOME/rolemrc``
    (``~/.cache/rolemrc``). Caches live in folders of their own under it."""
    root = os.environ.get("ROLEMRC_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "rolemrc"


def remove(path: str | Path) -> None:
    """Delete the file or folder at ``path``, if there is one."""
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def partial_path(path: str | Path) -> Path:
    """Where a folder (or file) is written before :func:`swap_in` puts it at ``path``."""
    path = Path(path)
    return path.with_name(path.name + ".partial")


def swap_in(tmp: str | Path, final: str | Path) -> None:
    """Put the finished ``tmp`` in ``final``'s place. A folder already at ``final`` is renamed
    to its ``<final>.old`` twin, ``tmp`` renamed in, then the twin deleted: a crash leaves the
    old folder, the new one, or the old one as ``<final>.old`` (which checkpoint lookup falls
    back to), never a mix and never a moment without either. Otherwise one rename over it."""
    tmp, final = Path(tmp), Path(final)
    if final.is_dir():
        old = final.with_name(final.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """``with atomic_dir(out) as tmp: <write the folder into tmp>``: ``tmp`` is
    ``<out>.partial``, emptied first; when the block ends it is swapped in for ``out``
    (:func:`swap_in`). If the block raises, ``out`` is untouched and the partial folder stays
    behind (never taken for a finished one; the next attempt clears it)."""
    out = Path(path)
    tmp = partial_path(out)
    remove(tmp)
    tmp.mkdir(parents=True)
    yield tmp
    swap_in(tmp, out)
