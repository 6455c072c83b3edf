"""Read local JSONL/JSON/Parquet files or hub datasets, validate every record, mix sources.

A source is a :class:`~rolemrc.config.SourceConfig` (``path``, ``weight``, ``split``, ``name``,
``data_files``, ``format``, ``roles``; a plain mapping is read as one): ``path`` is a local file,
folder or glob, or else a hub dataset id loaded with ``datasets``. Bad records stop the run with one
error listing file, line and problem for each; ``on_error="skip"`` drops them and reports.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolemrc.config import SourceConfig, as_schema
from rolemrc.data.roles import rolebench_parser
from rolemrc.data.schemas import PARSERS, DataError, RecordError, parse_dialogue
from rolemrc.errors import InputNotFound

log = logging.getLogger(__name__)

# Source ``format`` values other than "auto", by data kind: RoleBench rows become SFT conversations
# (with RoCIT system instructions), test items (every reference answer kept) or prompts (conversation
# seeds); ``dialogue``: a multi-turn conversation read as a prompt with its later user turns
# (``user_turns``) and its own replies (``reference_turns``), a seed for multi-turn environments.
FORMATS = {("sft", "rolebench"), ("test", "rolebench"), ("prompts", "rolebench"), ("prompts", "dialogue")}

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass
class ReadReport:
    """What reading one kind of data found, per source; printed before training."""

    kept: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)  # first few skip reasons
    held_out: list[Any] = field(default_factory=list)  # ``holdout``: validation records, each once

    def lines(self) -> list[str]:
        out = [f"{src}: {n} records kept, {self.skipped.get(src, 0)} skipped" for src, n in self.kept.items()]
        out += [f"  skipped {e}" for e in self.examples]
        return out


def _local_files(path: str) -> list[Path] | None:
    """Files a local path stands for, or None if it is not local (then it is a hub id)."""
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix in LOCAL_SUFFIXES)
        if not files:
            raise InputNotFound(f"{p}: folder has no {'/'.join(LOCAL_SUFFIXES)} files")
        return files
    if any(ch in path for ch in "*?["):
        files = sorted(Path(f) for f in glob.glob(str(p)))
        if not files:
            raise InputNotFound(f"{path}: glob matches no files")
        return files
    if p.suffix in LOCAL_SUFFIXES or path.startswith((".", "/", "~")):
        raise InputNotFound(f"data file not found: {p}")
    return None


def _not_utf8(err: UnicodeDecodeError, line: bytes) -> str:
    """What a :class:`UnicodeDecodeError` in one line means to whoever fixes the file."""
    return (f"not UTF-8 text: byte 0x{line[err.start]:02x} at byte {err.start + 1} of the line "
            "(re-save the file as UTF-8)")


def iter_file(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line number, record)`` pairs; an undecodable line (bad JSON, bytes that are not UTF-8)
    yields a RecordError instead. An unreadable Parquet file is a :class:`DataError` naming it."""
    if path.suffix == ".parquet":
        yield from _iter_parquet(path)
        return
    if path.suffix == ".json":
        yield from _iter_json(path)
        return
    with path.open("rb") as fh:  # bytes: a line that is not UTF-8 is that line's error, not the file's
        for i, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield i, RecordError(_not_utf8(err, raw))
                continue
            try:
                yield i, json.loads(text)
            except json.JSONDecodeError as err:
                yield i, RecordError(f"invalid JSON: {err.msg} (column {err.colno})")


def _iter_json(path: Path) -> Iterator[tuple[int, Any]]:
    """A ``.json`` file: one record or a list of them (numbered from 1). Bytes that are not UTF-8
    spoil only the records holding them (each a RecordError naming the first such byte's line)."""
    data = path.read_bytes()
    try:
        text, bad = data.decode("utf-8"), None
    except UnicodeDecodeError as err:
        start = data.rfind(b"\n", 0, err.start) + 1
        line_no = data.count(b"\n", 0, err.start) + 1
        bad = (f"not UTF-8 text: byte 0x{data[err.start]:02x} at line {line_no}, byte {err.start - start + 1} "
               "(re-save the file as UTF-8)")
        text = data.decode("utf-8", errors="surrogateescape")  # the rest of the file still parses
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as err:
        yield err.lineno, RecordError(f"invalid JSON: {err.msg} (column {err.colno})")
        return
    for i, row in enumerate(parsed if isinstance(parsed, list) else [parsed], start=1):
        if bad is not None and _has_surrogates(row):
            yield i, RecordError(bad)
        else:
            yield i, row


def _has_surrogates(value: Any) -> bool:
    """Whether ``value`` (parsed JSON) holds a string with an undecodable byte (surrogateescape)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError, UnicodeDecodeError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"{path}: not a readable Parquet file ({reason}); truncated or damaged? "
                        "Write it again, or remove it from the data sources") from None
    yield from enumerate(rows, start=1)


def source_config(source: SourceConfig | Mapping[str, Any]) -> SourceConfig:
    """A data source as its schema; a mapping with an unknown key or without ``path`` is an error."""
    return as_schema(source, SourceConfig)


def iter_source(source: SourceConfig | Mapping[str, Any]) -> Iterator[tuple[str, int, Any]]:
    """``(file, line, record)`` over a local path or a hub dataset (row numbers from 1)."""
    source = source_config(source)
    path = str(source.path)
    files = _local_files(path)
    if files is not None:
        for f in files:
            empty = True
            for line, record in iter_file(f):
                empty = False
                yield str(f), line, record
            if empty:
                raise DataError(f"{f}: empty data file (no records)")
        return
    ds = load_hub(source)
    for i, record in enumerate(ds, start=1):
        yield f"{path}[{source.split or 'train'}]", i, record


def local_files(source: SourceConfig) -> list[Path] | None:
    """The files a local source stands for (None: a hub dataset id)."""
    return _local_files(str(source.path))


def load_hub(source: SourceConfig) -> Any:
    """The ``datasets.Dataset`` of a hub source (read from the datasets cache when offline)."""
    import datasets

    path = str(source.path)
    try:
        return datasets.load_dataset(
            path, source.name, data_files=source.data_files, split=source.split or "train"
        )
    except Exception as err:  # re-raised with the source named: hub ids fail offline
        raise DataError(
            f"could not load {path!r} as a local file or a hub dataset ({type(err).__name__}: {err}). "
            "Offline? Point data paths at local files."
        ) from err


def record_parser(kind: str, source: SourceConfig) -> Callable[[Any], Any]:
    """The function turning one raw record of ``source`` into an example of ``kind`` (its
    ``format``: auto, rolebench with the source's RoCIT ``roles``, dialogue)."""
    fmt = str(source.format or "auto")
    if fmt != "auto" and (kind, fmt) not in FORMATS:
        usable = sorted(f for k, f in FORMATS if k == kind)
        raise ValueError(f"data source {source.path}: format {fmt!r} is not readable as {kind} data"
                         + (f" (for {kind}: auto, {', '.join(usable)})" if usable else ""))
    if fmt == "rolebench":  # RoCIT system instructions from the source's `roles` (profiles, template)
        return rolebench_parser(kind, source.roles)
    if fmt == "dialogue":
        return parse_dialogue
    return PARSERS[kind]


def read_examples(
    sources: list[SourceConfig | Mapping[str, Any]], kind: str, on_error: str = "raise", seed: int = 0, max_shown: int = 20,
    holdout: float = 0.0,
) -> tuple[list[Any], ReadReport]:
    """Read, validate and mix ``sources`` of one ``kind`` ("sft", "pairs", "prompts", "unpaired" or "test").

    ``weight`` per source: 1 keeps every record, 0.5 a seeded random half, 2 each record twice.
    ``holdout``: a seeded fraction of the records (at least one, when there are two or more) is
    set aside in ``report.held_out`` *before* the weights apply, so a record is either trained
    on (maybe several times) or validated on (once), never both.
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"data.on_error must be 'raise' or 'skip', got {on_error!r}")
    if not sources:
        raise DataError(f"no {kind} sources configured (data.{kind} is empty)")
    sources = [source_config(s) for s in sources]
    report = ReadReport()
    per_source: list[list[Any]] = []
    errors: list[str] = []
    for index, source in enumerate(sources):
        label = str(source.path)
        parse = record_parser(kind, source)
        kept: list[Any] = []
        n_bad = 0
        for file, line, record in iter_source(source):
            try:
                if isinstance(record, RecordError):
                    raise record
                example = parse(record)
            except RecordError as err:
                n_bad += 1
                msg = f"{file}:{line}: {err}"
                if on_error == "raise":
                    errors.append(msg)
                elif len(report.examples) < 5:
                    report.examples.append(msg)
                continue
            example.origin = f"{file}:{line}"
            kept.append(example)
        report.kept[label] = len(kept)
        report.skipped[label] = n_bad
        per_source.append(kept)
    bad_records(sum(report.skipped.values()), f"invalid {kind} record(s)", errors or report.examples, on_error, log,
                max_shown)
    per_source, report.held_out = split_holdout(per_source, holdout, seed)
    return mix(per_source, [float(s.weight) for s in sources], seed), report


def bad_records(n: int, what: str, problems: list[str], on_error: str, logger: logging.Logger,
                max_shown: int = 20) -> None:
    """``n`` records ``what`` says (``"invalid sft record(s)"``), ``problems`` the first of them
    (``file:line: problem``): with ``on_error="raise"`` one :class:`DataError` listing up to
    ``max_shown`` of them; with ``skip`` a warning (to ``logger``) naming the first five."""
    if n and on_error != "skip":
        shown = "\n  ".join(problems[:max_shown])
        more = f"\n  ... and {n - max_shown} more" if n > max_shown else ""
        raise DataError(f"{n} {what} (set data.on_error=skip to drop them):\n  {shown}{more}")
    if n:
        logger.warning("data.on_error=skip: skipped %d %s; first: %s", n, what, "; ".join(problems[:5]))


def split_holdout(per_source: list[list[Any]], holdout: float, seed: int) -> tuple[list[list[Any]], list[Any]]:
    """``(per_source without the held-out records, held-out records)``: a seeded ``holdout``
    fraction (at least one, when there are two or more records) over all sources together."""
    n_records = sum(map(len, per_source))
    if not (holdout > 0 and n_records > 1):
        return per_source, []
    order = list(range(n_records))
    random.Random(seed).shuffle(order)
    held = set(order[: max(1, int(round(holdout * n_records)))])
    flat = [(k, ex) for k, kept in enumerate(per_source) for ex in kept]
    held_out = [ex for i, (_, ex) in enumerate(flat) if i in held]
    rest = [[ex for i, (k2, ex) in enumerate(flat) if k2 == k and i not in held] for k in range(len(per_source))]
    return rest, held_out


def mix(per_source: list[list[Any]], weights: list[float], seed: int) -> list[Any]:
    """The sources' records one after another, each source weighted (:func:`_weighted`, seeded
    ``seed + its index``)."""
    mixed: list[Any] = []
    for index, (kept, weight) in enumerate(zip(per_source, weights)):
        mixed.extend(_weighted(kept, weight, seed + index))
    return mixed


def _weighted(items: list[Any], weight: float, seed: int) -> list[Any]:
    if weight < 0:
        raise ValueError(f"source weight must be >= 0, got {weight}")
    whole, frac = int(math.floor(weight)), weight - math.floor(weight)
    out = items * whole
    if frac > 0:
        out += random.Random(seed).sample(items, round(frac * len(items)))
    return out
