"""Reading what a W&B offline run wrote: the history records of its ``.wandb`` transaction log.

wandb 0.31 writes offline runs with its Go core and ships no Python reader for the log any more,
so this decodes the (LevelDB-style) framing itself: a 7-byte file header, then 32 KiB blocks of
chunks ``crc32 (4) | length (2) | type (1) | payload``, type 1 = a whole record, 2/3/4 = first,
middle, last piece of one; a block tail shorter than a chunk header is zero padding. Each record
is a ``wandb_internal_pb2.Record`` protobuf.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: str | Path) -> list[Any]:
    """Every record of a ``run-*.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B transaction log (header {data[:7]!r})")
    payloads: list[bytes] = []
    pending = b""
    pos = HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            payloads.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            payloads.append(pending + chunk)
            pending = b""
    records = []
    for raw in payloads:
        record = pb.Record()
        record.ParseFromString(raw)
        records.append(record)
    return records


def finished_records(path: Path, timeout: float = 60.0) -> list[Any]:
    """The records of a run that has finished. wandb's core process writes the log on its own
    schedule, so ``run.finish()`` can return before the last records are on disk (seen here on a
    loaded machine): read until the run's ``exit`` record is there, which comes after every
    history row."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        records = wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def wandb_history(run_dir: str | Path) -> list[dict[str, Any]]:
    """The logged rows (``run.log`` calls) of the single offline run under ``<run_dir>/wandb``,
    values decoded from JSON; nested keys joined with ``/``."""
    files = list(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
    if len(files) != 1:
        raise AssertionError(f"expected one offline run under {run_dir}/wandb, found {files}")
    rows = []
    for record in finished_records(files[0]):
        if record.WhichOneof("record_type") == "history":
            rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
