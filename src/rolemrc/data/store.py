"""The encoded-row store: a run's data read, validated, encoded and packed once, kept on disk as
compact arrays, memory-mapped read-only by every rank and every later run with the same inputs.

Layout of one store (a folder ``<data.cache_dir>/<kind>-<key>/``; raw little-endian arrays,
dtype and length in ``meta.json``):

- *units*: every record that passed validation, once, in reading order (train sources, then
  explicit validation sources). SFT: ``ids`` (int32 tokens, all units back to back), ``mask``
  (uint8, 1 where the token is trained: labels are the ids there, -100 elsewhere), ``offsets``
  (int64, ``U + 1``). Pairs: ``prompt``/``chosen``/``rejected`` (int32) with their offsets.
- per stage (``train``, ``val``): ``<stage>_rows`` (int32: the unit of each row, in the order
  the loaders index rows: the mix with its source weights and holdout applied, records the
  template cannot encode or with no trained token dropped, as :func:`encode_sft` and
  :func:`encode_pairs` drop them), ``<stage>_totals`` (int64 ``[R, K]``: what each row adds to
  its optimizer step's normalisers), and the packing plans ``<stage>_pack<layout>`` (int32 row
  ids, best-fit decreasing at ``max_length``) with their offsets.
- ``meta.json``: the key and what it covers, the data report, each array's dtype, length and
  sha256, and ``meta_sha256`` (a sha256 of the rest, :func:`meta_checksum`); written last, so a
  folder without it is never trusted, and one whose checksum or key does not match is rebuilt.

Row ``i`` of a stage is the stable identity the sampler, the batches' ``index`` and the
precomputed reference table use. The key (sha256) covers: each source's settings (path, weight,
split, name, data files, format, RoCIT roles) and each file's identity (resolved path, size and
an xxh3-128 of all its bytes, :func:`content_hash`; a hub dataset: the same of its Arrow cache files),
the seed, the validation holdout, the tokenizer (its ``tokenizer.json`` content), chat template
and end-of-turn marker, ``max_length``, ``max_prompt_length``, ``on_error`` and the encoder's code
(this module, readers, schemas, roles, templates, packing) and the tokenizers/transformers/jinja2
versions. A changed input gets a new key and is built; an unchanged one is reused.

Evaluation's test prompts have a store of their own (``prompts-<key>/``: ``prompt`` int32 ids and
``prompt_offsets``, one prompt per test item in order; :func:`open_or_build_prompts`), keyed by the
questions' content (roles and contents, in order), the tokenizer, chat template and the encoder's
code: the items are read and validated at every start anyway (their references feed the metrics),
so their content is at hand, and a digest of it is a stricter key than the files' identity.

Rows the datamodule encodes itself (GRPO's prompt rows, KTO's unpaired examples) are stored as it
makes them, one store per kind (``promptrows-<key>/``, ``unpairedrows-<key>/``: each field of
:data:`ROW_FIELDS` per stage, :func:`open_or_build_encoded_rows`), keyed by the sources' files as
above (:func:`encoded_rows_key_parts`).

Building: under a file lock (``<key>.lock``), into ``<key>.tmp-<pid>`` renamed into place when
complete; a killed build leaves only a tmp folder that the next build removes. A store whose files
do not match their recorded sizes and checksums is logged, removed and rebuilt. A read-only
``data.cache_dir`` holding a complete store is used as it is (no lock: nothing is written);
storage faults (a full disk, a cache_dir that is a file or cannot be written) are a one-line
:class:`~rolemrc.errors.StorageError` naming the folder and what to do. Input files are
streamed in chunks through ``num_proc`` worker processes, so the build holds a few chunks, the
per-record bookkeeping (a few ints each) and the output files' buffers, not the data.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import itertools
import json
import logging
import multiprocessing as mp
import os
import shutil
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from filelock import FileLock
from tqdm.auto import tqdm

from rolemrc.config import DataConfig, SourceConfig
from rolemrc.data import readers
from rolemrc.data.packing import plan_packs
from rolemrc.data.readers import bad_records, iter_source, mix, source_config, split_holdout
from rolemrc.data.schemas import DataError, RecordError
from rolemrc.data.templates import ChatFormat, TemplateRenderError, check_pair_lengths
from rolemrc.errors import ConfigError, StorageError
from rolemrc.fileio import cache_root, storage_error
from rolemrc.objectives import IGNORE_INDEX

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
# The files whose code decides the rows (hashed into every key: an edit rebuilds).
_ENCODER_FILES = ("store.py", "readers.py", "schemas.py", "roles.py", "templates.py", "packing.py")
_ENCODER_PACKAGES = ("tokenizers", "transformers", "jinja2")
HASH_CHUNK = 8 << 20  # bytes read at a time when hashing an input file (content_hash)
CHUNK = 64  # records per task handed to a worker
SMALL_INPUT = 4 << 20  # local inputs below this many bytes are encoded in-process (no pool)

# Unit status
OK, TEMPLATE_ERROR, EMPTY = 0, 1, 2
# Pair layouts a packing plan is stored for: SFT has one, pairs two (share_prompt off/on)
LAYOUTS = {"sft": (False,), "pairs": (False, True)}


def default_num_proc() -> int:
    """The CPUs this process may run on, capped at 16."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(n, 16))


# ---------------------------------------------------------------------------------------------- key


def content_hash(path: Path) -> str:
    """xxh3-128 of every byte of ``path``, streamed (``HASH_CHUNK`` bytes at a time into one
    reused buffer): the store key's view of a source file, so a change anywhere in it, size and
    mtime kept, is a new key. Non-cryptographic: it detects changes, it does not resist forgery."""
    h = xxhash.xxh3_128()
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    with path.open("rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _file_identity(path: Path) -> dict[str, Any]:
    return {"file": str(path.resolve()), "size": path.stat().st_size, "xxh3_128": content_hash(path)}


def _source_identity(source: SourceConfig) -> dict[str, Any]:
    settings = {
        "path": str(source.path), "weight": float(source.weight), "split": source.split, "name": source.name,
        "data_files": _plain(source.data_files), "format": str(source.format or "auto"), "roles": _plain(source.roles),
    }
    files = readers.local_files(source)
    if files is not None:
        return {**settings, "files": [_file_identity(f) for f in files]}
    ds = readers.load_hub(source)
    return {**settings, "hub_files": [_file_identity(Path(f["filename"])) for f in ds.cache_files]}


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    from dataclasses import asdict, is_dataclass

    from omegaconf import OmegaConf

    if is_dataclass(value):
        return _plain(asdict(value))
    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def tokenizer_identity(chat: ChatFormat) -> dict[str, str]:
    tok = chat.tokenizer
    backend = getattr(tok, "backend_tokenizer", None)
    content = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
    return {
        "class": type(tok).__name__,
        "tokenizer_sha256": hashlib.sha256(content.encode()).hexdigest(),
        "template_sha256": hashlib.sha256(str(tok.chat_template).encode()).hexdigest(),
        "eot": chat.eot,
    }


def encoder_version() -> str:
    h = hashlib.sha256(f"format {FORMAT_VERSION}".encode())
    here = Path(__file__).parent
    for name in _ENCODER_FILES:
        h.update((here / name).read_bytes())
    for pkg in _ENCODER_PACKAGES:
        try:
            h.update(f"{pkg}=={importlib.metadata.version(pkg)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{pkg} missing".encode())
    return h.hexdigest()[:16]


@dataclass
class Spec:
    """Everything the rows of one datamodule depend on."""

    kind: str  # sft | pairs (prompts, unpaired: their rows' key, encoded_rows_key_parts)
    sources: list[SourceConfig]
    val_sources: list[SourceConfig]
    holdout: float
    seed: int
    max_length: int
    max_prompt_length: int
    on_error: str

    @classmethod
    def of(cls, cfg: DataConfig, kind: str, seed: int) -> Spec:
        sources = [source_config(s) for s in getattr(cfg, kind)]
        val_sources = [source_config(s) for s in getattr(cfg, f"{kind}_val")]
        holdout = 0.0 if val_sources else float(cfg.val_fraction)
        return cls(kind, sources, val_sources, holdout, int(seed), int(cfg.max_length), int(cfg.max_prompt_length),
                   str(cfg.on_error))

    def key_parts(self, chat: ChatFormat) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "sources": [_source_identity(s) for s in self.sources],
            "val_sources": [_source_identity(s) for s in self.val_sources],
            "holdout": self.holdout, "seed": self.seed,
            "max_length": self.max_length,
            "max_prompt_length": self.max_prompt_length if self.kind == "pairs" else None,
            "on_error": self.on_error,
            "tokenizer": tokenizer_identity(chat),
            "encoder": encoder_version(),
        }


def store_key(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


# ------------------------------------------------------------------------------------ the worker side

_WORK: dict[str, Any] = {}  # set before the pool forks: kind, parsers, chat, lengths


def encode_examples(chat: ChatFormat, kind: str, examples: Sequence[Any], max_length: int,
                    max_prompt_length: int | None) -> list[Any]:
    """Conversations (``kind="sft"``), preference pairs or unpaired examples tokenised in one batch call: per example
    what ``encode_conversation``/``encode_pair`` gives one by one, or its TemplateRenderError."""
    if kind == "sft":
        return chat.encode_conversations([ex.messages for ex in examples], max_length)
    if kind == "unpaired":  # a pair's encoding with the completion on both sides: a pair's cuts and ids
        return chat.encode_pairs([(ex.prompt, ex.completion, ex.completion) for ex in examples], max_length,
                                 max_prompt_length)
    return chat.encode_pairs([(ex.prompt, ex.chosen, ex.rejected) for ex in examples], max_length,
                             max_prompt_length)


def _encode_chunk(task: tuple[int, list[tuple[str, int, Any]]]) -> list[tuple]:
    """Parse and encode one chunk of records of source ``task[0]``. Per record, one of
    ``("bad", "file:line: problem")``, ``("tpl", file, line, message)``,
    ``("ok", file, line, empty, flags, arrays...)``."""
    source_index, records = task
    kind, chat = _WORK["kind"], _WORK["chat"]
    parse = _WORK["parsers"][source_index]
    out: list[tuple | None] = []
    parsed: list[tuple[int, str, int, Any]] = []  # (place in out, file, line, example)
    for file, line, record in records:
        try:
            if isinstance(record, RecordError):
                raise record
            example = parse(record)
        except RecordError as err:
            out.append(("bad", f"{file}:{line}: {err}"))
            continue
        parsed.append((len(out), file, line, example))
        out.append(None)
    encoded = encode_examples(chat, kind, [ex for _, _, _, ex in parsed], _WORK["max_length"],
                              _WORK["max_prompt_length"])
    for (k, file, line, ex), enc in zip(parsed, encoded, strict=True):
        if isinstance(enc, TemplateRenderError):
            out[k] = ("tpl", file, line, str(enc))
        else:
            out[k] = ("ok", file, line, *(_sft_row(enc) if kind == "sft" else _pair_row(enc, ex)))
    return out  # type: ignore[return-value]


def _sft_row(enc: Any) -> tuple:
    """(no trained token, truncated, ids, loss mask, shifted trained tokens, trained tokens)."""
    ids = np.asarray(enc.input_ids, dtype=np.int32)
    mask = np.asarray(enc.labels, dtype=np.int64) != IGNORE_INDEX
    return (not mask[1:].any(), int(enc.truncated), ids.tobytes(), mask.astype(np.uint8).tobytes(), int(mask[1:].sum()),
            int(mask.sum()))


def _pair_row(enc: Any, example: Any) -> tuple:
    """(a side empty, truncation flags, prompt, chosen and rejected ids, the margin as stored: NaN
    where the record gave none)."""
    flags = int(enc.prompt_truncated) | (int(enc.response_truncated) << 1)
    return (not enc.chosen_ids or not enc.rejected_ids, flags, np.asarray(enc.prompt_ids, np.int32).tobytes(),
            np.asarray(enc.chosen_ids, np.int32).tobytes(), np.asarray(enc.rejected_ids, np.int32).tobytes(),
            float("nan") if example.margin is None else float(example.margin))


def nothing_to_train(kind: str, report: dict, cfg: Any) -> str:
    """Why no ``kind`` row is left to train on after encoding (``report``: the train split's mask
    report), naming the key to change: every row cut by ``data.max_length`` to no token the loss
    sees (a row's first token is never predicted), every row unrenderable."""
    dropped = int(report.get("dropped_no_trainable_token") or 0)
    unrenderable = int(report.get("dropped_template_error") or 0)
    shown = f" (e.g. {', '.join(report['dropped_examples'][:3])})" if report.get("dropped_examples") else ""
    if dropped:
        lengths = f"data.max_length={cfg.max_length}"
        if kind in ("pairs", "unpaired"):
            lengths += f" with data.max_prompt_length={cfg.max_prompt_length}"
        return (f"no {kind} example left to train on: all {dropped} had no token left to train on after truncation "
                f"to {lengths}{shown}: raise data.max_length (the recipes: 1024-4096)")
    if unrenderable:
        return (f"no {kind} example left to train on: the chat template could not render any of them "
                f"({unrenderable} dropped with data.on_error=skip: {report.get('template_errors', [])[:1]})")
    return f"no {kind} example left to train on after encoding: {json.dumps(report)}"


# ------------------------------------------------------------------------------------------- writing


class _ArrayFile:
    """An append-only raw array file with a running sha256."""

    def __init__(self, path: Path, dtype: str) -> None:
        self.path, self.dtype = path, dtype
        self.fh = path.open("wb")
        self.sha = hashlib.sha256()
        self.n = 0

    def append(self, data: bytes) -> None:
        self.fh.write(data)
        self.sha.update(data)
        self.n += len(data) // np.dtype(self.dtype).itemsize

    def close(self) -> dict[str, Any]:
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        return {"dtype": self.dtype, "length": self.n, "bytes": self.path.stat().st_size, "sha256": self.sha.hexdigest()}


def _write_array(folder: Path, name: str, array: np.ndarray, files: dict[str, Any]) -> None:
    f = _ArrayFile(folder / f"{name}.bin", str(array.dtype))
    f.append(np.ascontiguousarray(array).tobytes())
    files[name] = {**f.close(), "shape": list(array.shape)}


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------- build


BUILDS = {"count": 0}  # builds done by this process (tests read it)


class _Builder:
    """One build: stream every source through the encoder, then mix, drop, total and pack."""

    def __init__(self, spec: Spec, chat: ChatFormat, folder: Path, num_proc: int) -> None:
        self.spec, self.chat, self.folder, self.num_proc = spec, chat, folder, num_proc
        self.kind = spec.kind
        names = ("ids", "mask") if self.kind == "sft" else ("prompt", "chosen", "rejected")
        self.arrays = {n: _ArrayFile(folder / f"{n}.bin", "uint8" if n == "mask" else "int32") for n in names}
        self.offsets = {n: [0] for n in names if n != "mask"}
        # per unit: status, flags (truncation), trained tokens (SFT: after the shift), origin
        self.status: list[int] = []
        self.flags: list[int] = []
        self.trained: list[int] = []  # SFT: labels after the one-position shift (the step normaliser)
        self.labelled: list[int] = []  # SFT: labels (the report's trained_tokens)
        self.margins: list[float] = []  # pairs: each unit's margin (NaN: none)
        self.origin_file: list[int] = []
        self.origin_line: list[int] = []
        self.files: list[str] = []
        self._file_ids: dict[str, int] = {}
        self.template_errors: dict[int, str] = {}
        self.encoded = 0

    def origin(self, unit: int) -> str:
        return f"{self.files[self.origin_file[unit]]}:{self.origin_line[unit]}"

    def _add(self, result: tuple) -> None:
        tag, file, line = result[0], result[1], result[2]
        fid = self._file_ids.setdefault(file, len(self.files))
        if fid == len(self.files):
            self.files.append(file)
        unit = len(self.status)
        self.origin_file.append(fid)
        self.origin_line.append(line)
        self.encoded += 1
        if tag == "tpl":
            self.status.append(TEMPLATE_ERROR)
            self.flags.append(0)
            self.trained.append(0)
            self.labelled.append(0)
            self.template_errors[unit] = result[3]
            self.margins.append(float("nan"))
            for name, offs in self.offsets.items():
                offs.append(offs[-1])
            return
        _, _, _, empty, flags, *blobs = result
        self.status.append(EMPTY if empty else OK)
        self.flags.append(flags)
        if self.kind == "sft":
            ids, mask, trained, n_trained = blobs
            self.arrays["ids"].append(ids)
            self.arrays["mask"].append(mask)
            self.offsets["ids"].append(self.arrays["ids"].n)
            self.trained.append(trained)
            self.labelled.append(n_trained)
        else:
            for name, blob in zip(("prompt", "chosen", "rejected"), blobs):
                self.arrays[name].append(blob)
                self.offsets[name].append(self.arrays[name].n)
            self.margins.append(blobs[3])
            self.trained.append(0)
            self.labelled.append(0)

    def read(self, sources: list[SourceConfig], first_index: int, pool: Any, bar: Any) -> tuple[list[list[int]], readers.ReadReport, list[str]]:
        """Units of each source (validated records, in order), the read report, parse errors."""
        report = readers.ReadReport()
        per_source: list[list[int]] = []
        errors: list[str] = []
        for k, source in enumerate(sources):
            label = str(source.path)
            start, n_bad = len(self.status), 0

            def chunks() -> Iterator[tuple[int, list]]:
                items = iter_source(source)
                while buf := list(itertools.islice(items, CHUNK)):
                    yield first_index + k, buf

            for results in _run(pool, chunks(), self.num_proc):
                for r in results:
                    bar.update(1)
                    if r[0] == "bad":
                        n_bad += 1
                        if self.spec.on_error == "raise":
                            errors.append(r[1])
                        elif len(report.examples) < 5:
                            report.examples.append(r[1])
                        continue
                    self._add(r)
            report.kept[label] = len(self.status) - start
            report.skipped[label] = n_bad
            per_source.append(list(range(start, len(self.status))))
        return per_source, report, errors

    def stage(self, units: list[int]) -> tuple[np.ndarray, dict, list[str]]:
        """Rows (their units) of one stage, its mask report as :func:`encode_sft`/:func:`encode_pairs`
        give it, and the template problems (``file:line: message``) in the stage's order."""
        status = np.asarray(self.status, dtype=np.uint8)
        flags = np.asarray(self.flags, dtype=np.int64)
        u = np.asarray(units, dtype=np.int64)
        st = status[u] if len(u) else np.zeros(0, np.uint8)
        problems = [f"{self.origin(int(x))}: {self.template_errors[int(x)]}" for x in u[st == TEMPLATE_ERROR][:20]]
        n_problems = int((st == TEMPLATE_ERROR).sum())
        empty = [self.origin(int(x)) for x in u[st == EMPTY][:5]]
        rows = u[st == OK]
        encoded = u[st != TEMPLATE_ERROR]
        if self.kind == "sft":
            off = np.asarray(self.offsets["ids"], dtype=np.int64)
            lengths = (off[1:] - off[:-1])[rows]
            trained = np.asarray(self.trained, dtype=np.int64)
            mask_count = np.asarray(self.labelled, dtype=np.int64)[rows]
            report = {
                "examples": len(rows), "tokens": int(lengths.sum()), "trained_tokens": int(mask_count.sum()),
                "trained_fraction": round(int(mask_count.sum()) / max(int(lengths.sum()), 1), 4),
                "truncated": int((flags[encoded] & 1).sum()),
                "dropped_no_trainable_token": int((st == EMPTY).sum()), "dropped_examples": empty,
            }
            totals = trained[rows][:, None]
        else:
            lens = {n: np.diff(np.asarray(self.offsets[n], dtype=np.int64)) for n in ("prompt", "chosen", "rejected")}
            report = {
                "examples": len(rows), "prompt_tokens": int(lens["prompt"][rows].sum()),
                "response_tokens": int(lens["chosen"][rows].sum() + lens["rejected"][rows].sum()),
                "prompt_truncated": int((flags[encoded] & 1).sum()),
                "response_truncated": int(((flags[encoded] >> 1) & 1).sum()),
                "dropped_no_trainable_token": int((st == EMPTY).sum()), "dropped_examples": empty,
            }
            totals = np.stack([np.ones(len(rows), np.int64), lens["chosen"][rows] - (lens["prompt"][rows] == 0)], axis=1)
        report["dropped_template_error"] = n_problems
        report["template_errors"] = problems[:5]
        bad_records(n_problems, f"{self.kind} record(s) the chat template cannot encode", problems, self.spec.on_error,
                    log)
        return rows.astype(np.int32), report, totals.astype(np.int64)

    def lengths(self, rows: np.ndarray, share_prompt: bool) -> list[int]:
        if self.kind == "sft":
            return np.diff(np.asarray(self.offsets["ids"], dtype=np.int64))[rows].tolist()
        p, c, r = (np.diff(np.asarray(self.offsets[n], dtype=np.int64))[rows] for n in ("prompt", "chosen", "rejected"))
        return (p + c + 1 + r if share_prompt else 2 * p + c + r).tolist()


def _check_parsed(report: readers.ReadReport, errors: list[str], spec: Spec) -> None:
    """The records of ``report`` that did not parse (``errors``: all of them, with ``on_error=raise``)."""
    bad_records(sum(report.skipped.values()), f"invalid {spec.kind} record(s)", errors or report.examples,
                spec.on_error, log)


def _run(pool: Any, tasks: Iterator[tuple[int, list]], num_proc: int) -> Iterator[list[tuple]]:
    """Results of :func:`_encode_chunk` over ``tasks`` in order; at most ``2 * num_proc`` chunks in
    flight (``Pool.imap`` would read the whole input ahead)."""
    if pool is None:
        for task in tasks:
            yield _encode_chunk(task)
        return
    pending: deque = deque()
    for task in tasks:
        pending.append(pool.apply_async(_encode_chunk, (task,)))
        if len(pending) >= 2 * num_proc:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _parsers(kind: str, sources: list[SourceConfig]) -> list[Any]:
    return [readers.record_parser(kind, source) for source in sources]


def _input_bytes(sources: list[SourceConfig]) -> int | None:
    total = 0
    for s in sources:
        files = readers.local_files(s)
        if files is None:
            return None
        total += sum(f.stat().st_size for f in files)
    return total


@contextmanager
def _serial_tokenizer() -> Iterator[None]:
    """The fast tokenizer's batch calls on one thread (``TOKENIZERS_PARALLELISM=false``) while a
    build runs: a build's parallelism is its worker processes, and a process that never started
    the tokenizer's thread pool keeps it usable in processes it forks later (DataLoader workers)."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def build(spec: Spec, chat: ChatFormat, folder: Path, num_proc: int, parts: dict[str, Any]) -> None:
    """Write a complete store into ``folder`` (raises :class:`DataError` as reading and encoding
    do today: nothing is written that a later run could trust)."""
    if spec.on_error not in ("raise", "skip"):
        raise ValueError(f"data.on_error must be 'raise' or 'skip', got {spec.on_error!r}")
    if not spec.sources:
        raise DataError(f"no {spec.kind} sources configured (data.{spec.kind} is empty)")
    if spec.kind == "pairs":
        check_pair_lengths(spec.max_length, spec.max_prompt_length)
    started = time.perf_counter()
    all_sources = spec.sources + spec.val_sources
    size = _input_bytes(all_sources)
    procs = 1 if size is not None and size < SMALL_INPUT else num_proc
    _WORK.update(kind=spec.kind, chat=chat, parsers=_parsers(spec.kind, all_sources), max_length=spec.max_length,
                 max_prompt_length=spec.max_prompt_length)
    b = _Builder(spec, chat, folder, procs)
    pool = None
    bar = tqdm(desc=f"encode {spec.kind} ({procs} proc)", unit="rec", disable=size is not None and size < SMALL_INPUT)
    # the worker processes are the parallelism (they inherit the tokenizer's setting)
    with _serial_tokenizer():
        try:
            pool = mp.get_context("fork").Pool(procs) if procs > 1 else None
            per_source, read_report, errors = b.read(spec.sources, 0, pool, bar)
            _check_parsed(read_report, errors, spec)
            per_source, val_units = split_holdout(per_source, spec.holdout, spec.seed)
            train_units = mix(per_source, [float(s.weight) for s in spec.sources], spec.seed)
            if spec.val_sources:
                val_per_source, val_report, val_errors = b.read(spec.val_sources, len(spec.sources), pool, bar)
                _check_parsed(val_report, val_errors, spec)
                val_units = mix(val_per_source, [float(s.weight) for s in spec.val_sources], spec.seed)
        finally:
            bar.close()
            if pool is not None:
                pool.close()
                pool.join()
            _WORK.clear()
    files: dict[str, Any] = {name: {**f.close(), "shape": [f.n]} for name, f in b.arrays.items()}
    for name, offs in b.offsets.items():
        _write_array(folder, f"{name}_offsets", np.asarray(offs, dtype=np.int64), files)
    margins = np.asarray(b.margins, dtype=np.float64)
    if spec.kind == "pairs" and not np.isnan(margins).all():  # written only when a record gives one
        _write_array(folder, "margin", margins, files)
    train_rows, train_report, train_totals = b.stage(train_units)
    val_rows, val_report, val_totals = b.stage(val_units) if val_units else (np.zeros(0, np.int32), {}, None)
    if not len(train_rows):
        raise DataError(nothing_to_train(spec.kind, train_report, spec))
    report: dict[str, Any] = {"sources": read_report.kept, "skipped": read_report.skipped,
                              "skipped_examples": read_report.examples, "train": train_report, "val": val_report}
    packing: dict[str, Any] = {}
    for stage, rows, totals in (("train", train_rows, train_totals), ("val", val_rows, val_totals)):
        _write_array(folder, f"{stage}_rows", rows, files)
        if not len(rows):
            continue
        _write_array(folder, f"{stage}_totals", totals, files)
        for share in LAYOUTS[spec.kind]:
            bins, fill = plan_packs(b.lengths(rows, share), spec.max_length)
            flat = np.asarray([i for bin_ in bins for i in bin_], dtype=np.int32)
            offs = np.cumsum([0] + [len(bin_) for bin_ in bins], dtype=np.int64)
            _write_array(folder, f"{stage}_pack{int(share)}", flat, files)
            _write_array(folder, f"{stage}_pack{int(share)}_offsets", offs, files)
            packing[f"{stage}{int(share)}"] = fill
    fingerprints = {stage: _fingerprint(files, [n for n in files if not n.startswith(("train_", "val_"))
                                                or n == f"{stage}_rows"]) for stage in ("train", "val")}
    meta = {"format": FORMAT_VERSION, "kind": spec.kind, "key_parts": parts, "report": report, "packing": packing,
            "files": files, "fingerprints": fingerprints, "units": len(b.status),
            "build_seconds": round(time.perf_counter() - started, 2)}
    BUILDS["count"] += 1
    log.info("data store: encoded %d %s record(s) in %.1f s with %d process(es)", b.encoded, spec.kind,
             meta["build_seconds"], procs)
    _write_meta(folder, meta)


def _fingerprint(files: dict[str, Any], names: list[str]) -> str:
    """A stage's rows' identity: a sha256 of the checksums of the arrays ``names`` (what a
    precomputed reference table or a sampler place is matched against, with no pass over the rows)."""
    h = hashlib.sha256()
    for name in sorted(names):
        h.update(f"{name}:{files[name]['sha256']}".encode())
    return h.hexdigest()[:16]


def meta_checksum(meta: dict[str, Any]) -> str:
    """sha256 of ``meta`` without its ``meta_sha256`` entry, in a canonical form."""
    rest = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, ensure_ascii=True).encode()).hexdigest()


def _write_meta(folder: Path, meta: dict[str, Any]) -> None:
    """``meta.json``, the file that makes a store complete: written last with its own checksum,
    synced, renamed into place."""
    meta = {**meta, "meta_sha256": meta_checksum(meta)}
    tmp = folder / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    with tmp.open("rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, folder / "meta.json")


# ------------------------------------------------------------------------------------------- reading


class StoreError(Exception):
    """A store on disk does not match its meta.json (truncated, corrupt, half-written)."""


class Store:
    """A built store, its arrays memory-mapped read-only."""

    def __init__(self, folder: Path, verify: bool = True) -> None:
        self.folder = folder
        try:
            self.meta = json.loads((folder / "meta.json").read_text())
        except (OSError, ValueError) as err:
            raise StoreError(f"meta.json unreadable ({err})") from err
        if not isinstance(self.meta, dict) or self.meta.get("meta_sha256") != meta_checksum(self.meta):
            raise StoreError("meta.json's checksum differs from its content (damaged, or written by other code)")
        if self.meta.get("format") != FORMAT_VERSION:
            raise StoreError(f"format {self.meta.get('format')} (this code writes {FORMAT_VERSION})")
        try:
            key = f"{self.meta['kind']}-{store_key(self.meta['key_parts'])}"
            if key != folder.name:
                raise StoreError(f"meta.json's key {key} is not its folder's")
            self.kind = self.meta["kind"]
            self.arrays: dict[str, np.ndarray] = {}
            for name, info in self.meta["files"].items():
                self.arrays[name] = self._array(name, info, verify)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise StoreError(f"meta.json malformed ({type(err).__name__}: {err})") from err

    def _array(self, name: str, info: dict[str, Any], verify: bool) -> np.ndarray:
        path = self.folder / f"{name}.bin"
        try:
            size = path.stat().st_size
        except OSError as err:
            raise StoreError(f"{path.name} missing") from err
        if size != info["bytes"]:
            raise StoreError(f"{path.name} has {size} bytes, {info['bytes']} written")
        if verify and _file_sha256(path) != info["sha256"]:
            raise StoreError(f"{path.name} checksum differs from the one written")
        dtype = np.dtype(info["dtype"])
        arr = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
        return arr.reshape(info["shape"])

    @property
    def report(self) -> dict[str, Any]:
        return self.meta["report"]

    def rows(self, stage: str) -> StoredRows | StoredFieldRows:
        return StoredFieldRows(self, stage) if self.kind in ROW_FIELDS else StoredRows(self, stage)

    def packs(self, stage: str, share_prompt: bool) -> tuple[StoredPacks, dict]:
        name = f"{stage}_pack{int(share_prompt)}"
        return StoredPacks(self.rows(stage), self.arrays[name], self.arrays[f"{name}_offsets"]), \
            self.meta["packing"][f"{stage}{int(share_prompt)}"]

    def prompts(self) -> list[list[int]]:
        """A prompt store's prompt ids, one list per item."""
        ids, off = self.arrays["prompt"], self.arrays["prompt_offsets"]
        flat = np.asarray(ids, dtype=np.int64).tolist()
        bounds = np.asarray(off).tolist()
        return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    def totals(self, stage: str) -> np.ndarray:
        """``[R, K]`` int64: each row's share of its optimizer step's normalisers."""
        return np.asarray(self.arrays[f"{stage}_totals"])


class _StoredSequence(Sequence):
    """Rows read from a store's maps by position: slices and negative positions as a list has
    them; each subclass reads one row (``_row``)."""

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._row(i)

    def _row(self, i: int) -> Any:
        raise NotImplementedError


class StoredRows(_StoredSequence):
    """The rows of one stage as the encoders' dicts (``input_ids``/``labels`` or
    ``prompt_ids``/``chosen_ids``/``rejected_ids``, plus ``index``), read from the maps on access."""

    def __init__(self, store: Store, stage: str) -> None:
        self.store, self.stage = store, stage
        self.units = store.arrays[f"{stage}_rows"]
        self.fingerprint = store.meta["fingerprints"][stage]
        a = store.arrays
        if store.kind == "sft":
            self._ids, self._mask, self._off = a["ids"], a["mask"], a["ids_offsets"]
        else:
            self._parts = [(n, a[n], a[f"{n}_offsets"]) for n in ("prompt", "chosen", "rejected")]
            self._margin = a.get("margin")  # pairs' margins (NaN: none), when any record gave one

    def __len__(self) -> int:
        return len(self.units)

    def _row(self, i: int) -> dict[str, Any]:
        u = int(self.units[i])
        if self.store.kind == "sft":
            a, b = int(self._off[u]), int(self._off[u + 1])
            ids = np.asarray(self._ids[a:b], dtype=np.int64)
            labels = np.where(self._mask[a:b] != 0, ids, IGNORE_INDEX)
            return {"input_ids": ids.tolist(), "labels": labels.tolist(), "index": i}
        row: dict[str, Any] = {}
        for name, arr, off in self._parts:
            row[f"{name}_ids"] = np.asarray(arr[int(off[u]):int(off[u + 1])], dtype=np.int64).tolist()
        if self._margin is not None and not np.isnan(self._margin[u]):
            row["margin"] = float(self._margin[u])
        row["index"] = i
        return row


class StoredFieldRows(_StoredSequence):
    """The rows of one stage of a store of encoded rows (:data:`ROW_FIELDS`: GRPO's prompt rows,
    KTO's unpaired examples) as the datamodule's encoders make them (their fields, plus ``index``),
    read from the maps on access."""

    def __init__(self, store: Store, stage: str) -> None:
        a = store.arrays
        self._fields = [(name, how, a[f"{stage}_{name}"], a.get(f"{stage}_{name}_offsets"))
                        for name, how in ROW_FIELDS[store.kind].items()]
        self._n = len(a[f"{stage}_totals"])
        files = store.meta["files"]  # the stage's arrays (as StoredRows' fingerprint, stored at build)
        self.fingerprint = _fingerprint(files, [n for n in files if n.startswith(f"{stage}_")])

    def __len__(self) -> int:
        return self._n

    def _row(self, i: int) -> dict[str, Any]:
        row: dict[str, Any] = {}
        for name, how, data, off in self._fields:
            if how == "bool":
                row[name] = bool(data[i])
                continue
            piece = data[int(off[i]):int(off[i + 1])]
            row[name] = np.asarray(piece, dtype=np.int64).tolist() if how == "ids" else json.loads(bytes(piece))
        row["index"] = i
        return row


class StoredPacks(_StoredSequence):
    """Packs (lists of row dicts) from a stored packing plan."""

    def __init__(self, rows: StoredRows, flat: np.ndarray, offsets: np.ndarray) -> None:
        self.rows, self.flat, self.offsets = rows, flat, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def _row(self, k: int) -> list[dict[str, Any]]:
        return [self.rows[int(i)] for i in self.flat[int(self.offsets[k]):int(self.offsets[k + 1])]]


_ELSEWHERE = "set data.cache_dir to a writable folder with room (or data.cache=false to encode in memory)"


def _root(cache_dir: str | Path | None) -> Path:
    root = Path(cache_dir).expanduser() if cache_dir else cache_root() / "data"  # ~/.cache/rolemrc/data
    if root.exists() and not root.is_dir():
        raise StorageError(f"data.cache_dir {root}: is a file, not a folder; point data.cache_dir at a folder")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise StorageError(f"data.cache_dir {root}: a part of the path is a file, not a folder; "
                           "point data.cache_dir at a folder") from None
    except OSError as err:
        raise storage_error(err, root, "creating data.cache_dir", _ELSEWHERE)
    return root


def _read_only(err: OSError) -> bool:
    return err.errno in (errno.EROFS, errno.EACCES, errno.EPERM)


def _open_or_build(root: Path, key: str, build_into: Any) -> Store:
    """The store ``root/key``: reused when complete (verified against its recorded sizes and
    checksums), else built by ``build_into(folder)`` under the key's lock into a tmp folder renamed
    into place when complete. Where the lock cannot be taken because ``root`` is read-only, a
    complete store there is used as it is."""
    final = root / key
    try:
        lock = FileLock(str(root / f"{key}.lock"))
        lock.acquire()
    except OSError as err:
        if not _read_only(err):
            raise storage_error(err, root, "taking the data store's lock", _ELSEWHERE)
        return _open_read_only(root, final, err)
    try:
        if final.exists():
            try:
                store = Store(final)
                log.info("data store: reusing %s (no encoding)", final)
                return store
            except StoreError as err:
                log.warning("data store %s is damaged (%s): rebuilding it", final, err)
                shutil.rmtree(final, ignore_errors=True)
        for stale in root.glob(f"{key}.tmp-*"):  # a killed build's leftovers (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = root / f"{key}.tmp-{os.getpid()}"
        try:
            tmp.mkdir()
            log.info("data store: building %s", final)
            build_into(tmp)
            os.rename(tmp, final)
        except OSError as err:  # a full disk, a folder made read-only: one line naming it
            raise storage_error(err, root, "building the data store", _ELSEWHERE)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return Store(final, verify=False)
    finally:
        lock.release()


def _open_read_only(root: Path, final: Path, err: OSError) -> Store:
    """A complete store in a ``data.cache_dir`` this process cannot write: used as it is (verified;
    no lock needed, nothing is written); missing or damaged, a :class:`StorageError`."""
    why = f"not writable ({err.strerror or err})"
    if not final.exists():
        raise StorageError(f"data.cache_dir {root}: {why} and it holds no store for these inputs ({final.name}); "
                           f"{_ELSEWHERE}")
    try:
        store = Store(final)
    except StoreError as damaged:
        raise StorageError(f"data.cache_dir {root}: {why} and its store {final.name} is damaged ({damaged}); "
                           f"{_ELSEWHERE}") from None
    log.info("data store: reusing %s as it is (data.cache_dir is not writable: no lock taken)", final)
    return store


def open_or_build(spec: Spec, chat: ChatFormat, cache_dir: str | Path | None, num_proc: int | None) -> Store:
    """The store for ``spec``: reused when a complete one with its key exists (verified against its
    recorded sizes and checksums), else built under the key's lock and renamed into place."""
    if num_proc is not None and num_proc < 1:
        raise ConfigError(f"data.num_proc must be at least 1 (or null: this rank's CPUs), got {num_proc}")
    root = _root(cache_dir)
    parts = spec.key_parts(chat)
    return _open_or_build(root, f"{spec.kind}-{store_key(parts)}",
                          lambda folder: build(spec, chat, folder, num_proc or default_num_proc(), parts))


# ------------------------------------------------------------------- rows encoded in memory, stored as fields


ROW_FIELDS: dict[str, dict[str, str]] = {
    # a store kind -> its rows' fields: "ids" (int32 token ids), "json" (UTF-8 JSON), "bool" (uint8)
    "promptrows": {"prompt_ids": "ids", "messages": "json", "columns": "json"},  # GRPO's prompt rows
    "unpairedrows": {"prompt_ids": "ids", "completion_ids": "ids", "label": "bool"},  # KTO's unpaired examples
}
_ROW_KINDS = {"prompts": "promptrows", "unpaired": "unpairedrows"}  # data kind -> store kind


def encoded_rows_key_parts(data: DataConfig, kind: str, seed: int, chat: ChatFormat) -> dict[str, Any]:
    """What a run's rows of data kind ``kind`` (``prompts``, ``unpaired``: rows the sft/pairs store
    does not make) depend on: the ``data.<kind>`` and ``data.<kind>_val`` sources' settings and
    files' identity (as the sft and pairs stores key theirs), the holdout, seed, the lengths they
    are cut to, ``on_error``, the tokenizer and template, the encoder's code (with the datamodule's,
    where these rows' encoders live)."""
    parts = Spec.of(data, kind, seed).key_parts(chat)
    datamodule = Path(__file__).with_name("datamodule.py")
    parts.update(kind=_ROW_KINDS[kind], max_prompt_length=int(data.max_prompt_length),
                 datamodule=hashlib.sha256(datamodule.read_bytes()).hexdigest()[:16])
    if kind == "prompts":  # prompt rows are prompts only: max_length does not cut them
        del parts["max_length"]
    return parts


def _write_fields(folder: Path, stage: str, rows: Sequence[dict], fields: dict[str, str],
                  files: dict[str, Any]) -> None:
    """``<stage>_<field>`` of each field: flat ids or JSON bytes with their ``_offsets``, or one
    byte per row (``bool``)."""
    for name, how in fields.items():
        if how == "bool":
            _write_array(folder, f"{stage}_{name}", np.asarray([bool(r[name]) for r in rows], dtype=np.uint8), files)
            continue
        if how == "ids":
            pieces = [r[name] for r in rows]
            flat = np.asarray([t for p in pieces for t in p], dtype=np.int32)
        else:
            pieces = [json.dumps(r[name], ensure_ascii=False).encode() for r in rows]
            flat = np.frombuffer(b"".join(pieces), dtype=np.uint8)
        _write_array(folder, f"{stage}_{name}", flat, files)
        _write_array(folder, f"{stage}_{name}_offsets", np.cumsum([0] + [len(p) for p in pieces], dtype=np.int64),
                     files)


def open_or_build_encoded_rows(parts: dict[str, Any], cache_dir: str | Path | None, encode: Any,
                               totals: Any, n_totals: int) -> Store:
    """The store of a run's rows of the kind ``parts["kind"]`` (key :func:`encoded_rows_key_parts`;
    its fields :data:`ROW_FIELDS`): per stage each field's array (:func:`_write_fields`),
    ``<stage>_totals`` (``[R, n_totals]``: ``totals(row)``, each row's share of its step's
    normalisers), and the data report. Built once by ``encode()`` (-> train rows, val rows, report:
    what the datamodule makes in memory, a bad record's error with its file and line included),
    memory-mapped by every later start and rank (:class:`StoredFieldRows`); a build that fails
    stores nothing."""
    kind = parts["kind"]
    fields = ROW_FIELDS[kind]

    def build_into(folder: Path) -> None:
        started = time.perf_counter()
        train, val, report = encode()
        files: dict[str, Any] = {}
        for stage, rows in (("train", train), ("val", val)):
            _write_fields(folder, stage, rows, fields, files)
            _write_array(folder, f"{stage}_totals",
                         np.asarray([totals(r) for r in rows], dtype=np.int64).reshape(len(rows), n_totals), files)
        BUILDS["count"] += 1
        seconds = round(time.perf_counter() - started, 2)
        log.info("data store: encoded %d %s row(s) in %.1f s", len(train) + len(val), kind, seconds)
        _write_meta(folder, {"format": FORMAT_VERSION, "kind": kind, "key_parts": parts, "files": files, "report": report, "units": len(train) + len(val),
                             "build_seconds": seconds})

    return _open_or_build(_root(cache_dir), f"{kind}-{store_key(parts)}", build_into)


# ----------------------------------------------------------------------------- test items' prompts


def questions_sha256(questions: Sequence[Sequence[Any]]) -> str:
    """One digest of the conversations to prompt with, in order (roles and contents: all a
    prompt depends on besides the tokenizer and template)."""
    h = hashlib.sha256()
    for q in questions:
        h.update(json.dumps([[m["role"], m["content"]] for m in q], ensure_ascii=False).encode())
        h.update(b"\n")
    return h.hexdigest()


def open_or_build_prompts(questions: Sequence[list[Any]], chat: ChatFormat, cache_dir: str | Path | None,
                          sources: Any = None) -> Store:
    """The store of the generation prompts of ``questions`` (``chat.encode_prompt`` of each, in
    order: ``prompt`` int32 and ``prompt_offsets``), keyed by the questions' content, the
    tokenizer, chat template and the encoder's code; built once, reused by every later start.
    ``sources`` (the test sources read) is recorded in ``meta.json`` for whoever looks."""
    parts = {"kind": "prompts", "questions_sha256": questions_sha256(questions), "items": len(questions),
             "tokenizer": tokenizer_identity(chat), "encoder": encoder_version()}

    def build_into(folder: Path) -> None:
        started = time.perf_counter()
        with _serial_tokenizer():
            prompts = chat.encode_prompts(list(questions))
        files: dict[str, Any] = {}
        _write_array(folder, "prompt", np.asarray([t for p in prompts for t in p], dtype=np.int32), files)
        _write_array(folder, "prompt_offsets", np.cumsum([0] + [len(p) for p in prompts], dtype=np.int64), files)
        BUILDS["count"] += 1
        seconds = round(time.perf_counter() - started, 2)
        log.info("data store: encoded %d prompt(s) in %.1f s", len(prompts), seconds)
        _write_meta(folder, {"format": FORMAT_VERSION, "kind": "prompts", "key_parts": parts,
                             "sources": _plain(sources), "files": files, "units": len(prompts),
                             "build_seconds": seconds})

    return _open_or_build(_root(cache_dir), f"prompts-{store_key(parts)}", build_into)
