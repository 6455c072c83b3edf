"""Faults of data files and of the data store's storage (issue 35, items 6, 7 and 8):

- a byte that is not UTF-8 in a data file is that line's error (``file:line``), and
  ``data.on_error=skip`` drops and counts it, with and without the store;
- a truncated Parquet file is one error naming it;
- the store's key sees every byte of a source file (a change in the middle, size and mtime
  kept, is a new key); a ``meta.json`` damaged but still valid JSON is rebuilt, not trusted;
- storage: a read-only ``data.cache_dir`` holding a complete store is used as it is; a full disk
  during a build, a ``data.cache_dir`` naming a file and ``data.num_proc=0`` are one-line errors.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from rolemrc import asset
from rolemrc.data import store as store_mod
from rolemrc.data.datamodule import ChatDataModule
from rolemrc.data.schemas import DataError
from rolemrc.data.templates import ChatFormat
from rolemrc.errors import ConfigError, StorageError, UserError

GOOD = {"conversations": [{"role": "User", "content": "Who are you?"},
                          {"role": "Assistant", "content": "A lighthouse keeper, lad."}]}
BAD_BYTES = json.dumps({"conversations": [{"role": "User", "content": "Caf\u00e9?"},
                                          {"role": "Assistant", "content": "Closed."}]}).encode().replace(
    b"\\u00e9", b"\xe9")  # Latin-1 'e acute' in a UTF-8 file


@pytest.fixture(scope="module")
def chat() -> ChatFormat:
    return ChatFormat(AutoTokenizer.from_pretrained(asset("tokenizers/tiny-llama3")))


def data_cfg(path: Path | str, cache_dir: Path, on_error: str = "raise", cache: bool = True, **kw):
    return OmegaConf.create({"name": "t", "sft": [{"path": str(path)}], "sft_val": [], "val_fraction": 0.0,
                             "on_error": on_error, "max_length": 256, "max_prompt_length": 128, "packing": False,
                             "batch_size": 2, "num_workers": 0, "shuffle": False, "cache": cache,
                             "cache_dir": str(cache_dir), **kw})


def setup(chat: ChatFormat, cfg, report_dir: Path | None = None) -> ChatDataModule:
    dm = ChatDataModule(cfg, "sft", chat, report_dir=str(report_dir) if report_dir else None)
    dm.setup()
    return dm


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
@pytest.mark.parametrize("cache", [True, False])
def test_a_byte_that_is_not_utf8_is_its_lines_error_or_skipped(chat, tmp_path: Path, suffix: str, cache: bool) -> None:
    path = tmp_path / f"sft{suffix}"
    good = json.dumps(GOOD).encode()
    if suffix == ".jsonl":
        path.write_bytes(b"\n".join([good, BAD_BYTES, good]) + b"\n")
        where, detail = f"{path}:2: ", "byte 0xe9 at byte 52 of the line"
    else:  # a list: the record holding the byte is the one left out (the file's line named)
        path.write_bytes(b"[\n" + b",\n".join([good, BAD_BYTES, good]) + b"\n]\n")
        where, detail = f"{path}:2: ", "byte 0xe9 at line 3, byte 52"
    assert BAD_BYTES.index(b"\xe9") == 51
    with pytest.raises(DataError) as err:
        setup(chat, data_cfg(path, tmp_path / "c", cache=cache))
    assert f"{where}not UTF-8 text: {detail}" in str(err.value), str(err.value)
    dm = setup(chat, data_cfg(path, tmp_path / "c", "skip", cache=cache), tmp_path / "run")
    assert len(dm.train_rows) == 2
    report = json.loads((tmp_path / "run" / "data_report_sft.json").read_text())
    assert report["skipped"] == {str(path): 1}, report
    assert report["skipped_examples"][0].startswith(f"{where}not UTF-8 text")


def test_a_truncated_parquet_file_is_one_error_naming_it(chat, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "sft.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD] * 4), path)
    assert len(setup(chat, data_cfg(path, tmp_path / "c", cache=False)).train_rows) == 4
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    for cache in (False, True):
        with pytest.raises(DataError, match=rf"^{path}: not a readable Parquet file \(.*\); truncated or damaged\?"):
            setup(chat, data_cfg(path, tmp_path / "c", cache=cache))


def test_the_key_sees_a_change_in_the_middle_of_a_large_file(chat, tmp_path: Path) -> None:
    """Size and mtime kept, one byte changed 3 MiB into a 6 MiB file: a new key (a new store)."""
    path = tmp_path / "sft.jsonl"
    line = json.dumps(GOOD).encode() + b"\n"
    data = bytearray(line * ((6 << 20) // len(line)))
    path.write_bytes(bytes(data))
    spec = store_mod.Spec.of(data_cfg(path, tmp_path / "c"), "sft", 0)
    key = store_mod.store_key(spec.key_parts(chat))
    stat = path.stat()
    middle = data.index(b"lad", 3 << 20)
    data[middle:middle + 3] = b"LAD"
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    assert store_mod.store_key(spec.key_parts(chat)) != key
    data[middle:middle + 3] = b"lad"  # the same content again: the same key
    path.write_bytes(bytes(data))
    assert store_mod.store_key(spec.key_parts(chat)) == key


def test_a_damaged_but_valid_meta_json_is_rebuilt(chat, tmp_path: Path, caplog) -> None:
    cfg = data_cfg(asset("sample/sft.jsonl"), tmp_path / "c")
    first = setup(chat, cfg)
    folder, report, rows = first.store.folder, first.store.report, list(first.train_rows)
    meta = json.loads((folder / "meta.json").read_text())
    meta["report"]["sources"] = {k: v + 5 for k, v in meta["report"]["sources"].items()}  # a wrong data report
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))
    builds = store_mod.BUILDS["count"]
    with caplog.at_level(logging.WARNING, logger="rolemrc.data.store"):
        again = setup(chat, cfg)
    assert "meta.json's checksum differs" in caplog.text and "rebuilding it" in caplog.text
    assert store_mod.BUILDS["count"] == builds + 1
    assert again.store.report == report and list(again.train_rows) == rows
    meta = json.loads((folder / "meta.json").read_text())
    del meta["files"]  # no longer the store's shape (its checksum recomputed as if written so)
    meta["meta_sha256"] = store_mod.meta_checksum(meta)
    (folder / "meta.json").write_text(json.dumps(meta))
    assert list(setup(chat, cfg).train_rows) == rows and store_mod.BUILDS["count"] == builds + 2


class _ReadOnlyLock:
    """What filelock raises for a lock file in a folder this process cannot write (the tests may
    run as root, whom a 0o555 folder does not stop)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def acquire(self) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), self.path)


def test_a_read_only_cache_dir_holding_a_complete_store_is_used_as_is(chat, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "shared"
    cfg = data_cfg(asset("sample/sft.jsonl"), cache)
    rows = list(setup(chat, cfg).train_rows)
    builds = store_mod.BUILDS["count"]
    os.chmod(cache, 0o555)
    try:
        monkeypatch.setattr(store_mod, "FileLock", _ReadOnlyLock)
        assert list(setup(chat, cfg).train_rows) == rows
        assert store_mod.BUILDS["count"] == builds
        with pytest.raises(StorageError) as err:  # other inputs: no store for them there
            setup(chat, data_cfg(asset("sample/sft.jsonl"), cache, max_length=128))
        assert str(err.value).startswith(f"data.cache_dir {cache}: not writable (Permission denied) and it holds no "
                                         "store for these inputs")
        assert "set data.cache_dir to a writable folder" in str(err.value)
    finally:
        os.chmod(cache, 0o755)


def test_a_full_disk_during_a_build_is_one_error(chat, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(self, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store_mod._ArrayFile, "append", full)
    cache = tmp_path / "c"
    with pytest.raises(StorageError) as err:
        setup(chat, data_cfg(asset("sample/sft.jsonl"), cache))
    assert str(err.value) == (f"{cache}: building the data store failed: no space left on the device; free space "
                              "there, or set data.cache_dir to a writable folder with room (or data.cache=false to "
                              "encode in memory)")
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []  # no half-built store


def test_a_cache_dir_naming_a_file_and_num_proc_0_are_one_line_errors(chat, tmp_path: Path) -> None:
    a_file = tmp_path / "cache.txt"
    a_file.write_text("not a folder\n")
    for where in (a_file, a_file / "sub"):
        with pytest.raises(StorageError, match=rf"^data.cache_dir {where}: .*not a folder; point data.cache_dir at a"):
            setup(chat, data_cfg(asset("sample/sft.jsonl"), where))
    with pytest.raises(ConfigError, match=r"^data.num_proc must be at least 1 .*got 0$") as err:
        setup(chat, data_cfg(asset("sample/sft.jsonl"), tmp_path / "c", num_proc=0))
    assert isinstance(err.value, UserError)
