"""Loggers that survive a kill and a resume (``conf/logger/{csv,wandb}.yaml`` point here).

Lightning's own loggers start every process afresh: its CSV logger deletes ``metrics.csv``
when the folder exists and writes rows every 100 steps, so a resumed run loses the rows from
before the crash and a killed one the last 99; its W&B logger starts a new W&B run each time.

* :class:`CSVLogger` writes each row as it is logged (``flush_logs_every_n_steps=1``), keeps
  the file it finds, and on the first row of a new process drops the rows at or after that
  row's step (logged after the checkpoint the run resumed from, so logged again now): killed
  and resumed, ``metrics.csv`` holds the rows of an uninterrupted run. A run started afresh in
  the folder (step 0) replaces them all, as before. Header changes rewrite the file atomically.
  It implements Lightning's public ``Logger`` interface itself (Lightning's CSV writer deletes the
  file in a private method) and keeps Lightning's layout and columns.
* :class:`WandbLogger` keeps the W&B run id in ``<save_dir>/wandb_run_id`` and passes
  ``resume="allow"``, so a resumed run (same folder) continues the same W&B run.
"""

from __future__ import annotations

import csv
import io
import os
import uuid
from argparse import Namespace
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.loggers import Logger
from lightning.pytorch.loggers import WandbLogger as _LightningWandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from rolemrc.fileio import atomic_open, atomic_write_text


def _step(row: dict[str, Any]) -> float | None:
    value = row.get("step")
    return float(value) if value not in (None, "") else None


class CSVLogger(Logger):
    """A CSV logger on Lightning's public ``Logger`` interface, with the arguments of
    ``lightning.pytorch.loggers.CSVLogger`` and its layout (``<save_dir>/<name>/<version>/metrics.csv``,
    one column per key, sorted, plus ``step``; ``hparams.yaml`` beside it), that appends across
    resumes and writes every row as it is logged (``flush_logs_every_n_steps`` defaults to 1);
    see the module docstring. Only rank 0 writes."""

    def __init__(self, save_dir: str | Path, name: Optional[str] = "lightning_logs",
                 version: Optional[int | str] = None, prefix: str = "", flush_logs_every_n_steps: int = 1) -> None:
        super().__init__()
        self._save_dir = str(save_dir)
        self._name = name or ""
        self._version = version
        self._prefix = prefix
        self._flush_every = max(1, int(flush_logs_every_n_steps))
        self._rows: list[dict[str, Any]] = []  # logged, not yet in the file
        self._keys: list[str] | None = None  # the file's columns (read from it on first use)
        self._reconciled = False  # this process has dropped the rows it logs again
        self._hparams: dict[str, Any] = {}

    # ---- where -----------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> int | str:
        if self._version is None:
            self._version = self._next_version()
        return self._version

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def root_dir(self) -> str:
        return os.path.join(self._save_dir, self._name)

    @property
    def log_dir(self) -> str:
        version = self.version if isinstance(self.version, str) else f"version_{self.version}"
        return os.path.join(self.root_dir, version)

    @property
    def metrics_file(self) -> Path:
        return Path(self.log_dir) / METRICS_FILE

    def _next_version(self) -> int:
        root = Path(self.root_dir)
        found = [int(d.name.split("_", 1)[1]) for d in root.glob("version_*")
                 if d.is_dir() and d.name.split("_", 1)[1].isdigit()] if root.is_dir() else []
        return max(found) + 1 if found else 0

    # ---- what ------------------------------------------------------------------------------------
    @rank_zero_only
    def log_hyperparams(self, params: Any = None, *args: Any, **kwargs: Any) -> None:
        if params is None:
            return
        self._hparams.update(vars(params) if isinstance(params, Namespace) else dict(params))
        os.makedirs(self.log_dir, exist_ok=True)
        save_hparams_to_yaml(os.path.join(self.log_dir, HPARAMS_FILE), self._hparams)

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        if step is None:
            step = len(self._rows)
        row = {f"{self._prefix}-{k}" if self._prefix else k: v.item() if isinstance(v, torch.Tensor) else v
               for k, v in metrics.items()}
        row["step"] = step
        self._rows.append(row)
        if (step + 1) % self._flush_every == 0:
            self.save()

    @rank_zero_only
    def save(self) -> None:
        if not self._rows:
            return
        path = self.metrics_file
        path.parent.mkdir(parents=True, exist_ok=True)
        if self._keys is None:
            self._keys = _header(path)
        new_keys = set().union(*self._rows) - set(self._keys)
        self._keys = sorted({*self._keys, *new_keys})
        if not self._reconciled:
            self._reconciled = True
            first = min(s for s in (_step(r) for r in self._rows) if s is not None)
            old = _read_rows(path)
            kept = [r for r in old if (s := _step(r)) is None or s < first or (s == first and _kept_beside(r, self._rows))]
            if path.is_file() and (len(kept) != len(old) or new_keys):
                self._rewrite(path, kept)
        elif new_keys and path.is_file():
            self._rewrite(path, _read_rows(path))
        exists = path.is_file()
        with path.open("a" if exists else "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=self._keys, lineterminator="\r\n")
            if not exists:
                writer.writeheader()
            writer.writerows(self._rows)
            fh.flush()  # in the OS's hands now: a SIGKILL right after loses nothing
        self._rows = []

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.save()

    def _rewrite(self, path: Path, rows: list[dict[str, Any]]) -> None:
        with atomic_open(path, "w") as fh:  # a kill mid-rewrite keeps the old file
            writer = csv.DictWriter(fh, fieldnames=self._keys, lineterminator="\r\n")
            writer.writeheader()
            writer.writerows(rows)


METRICS_FILE = "metrics.csv"
HPARAMS_FILE = "hparams.yaml"


def _is_validation(row: dict[str, Any]) -> bool:
    keys = [k for k, v in row.items() if k not in ("step", "epoch") and v not in (None, "")]
    return bool(keys) and all(k.startswith("val/") for k in keys)


def _kept_beside(old: dict[str, Any], new: list[dict[str, Any]]) -> bool:
    """A row of the step a resumed process logs first that stays: one of that step's training
    rows when the process begins by redoing the step's validation (a resume from a checkpoint
    written before it; only the validation's row is logged again)."""
    return _is_validation(new[0]) and not _is_validation(old)


def _header(path: Path) -> list[str]:
    if not path.is_file():
        return []
    with path.open(newline="") as fh:
        return sorted(k for k in next(csv.reader(fh), []) if k)


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):  # a row torn by a kill mid-write: not a row
        text = text[: text.rfind("\n") + 1]
    return list(csv.DictReader(io.StringIO(text, newline="")))


RUN_ID_FILE = "wandb_run_id"


class WandbLogger(_LightningWandbLogger):
    """``lightning.pytorch.loggers.WandbLogger`` whose run id is kept in ``<save_dir>/wandb_run_id``:
    a run resumed in its folder logs to the same W&B run (``resume="allow"``). An explicit ``id``
    wins; other arguments as Lightning's."""

    def __init__(self, *args: Any, save_dir: str | Path = ".", id: Optional[str] = None, resume: Any = "allow",
                 **kwargs: Any) -> None:
        if id is None and kwargs.get("version") is None:
            id = self._run_id(Path(save_dir))
        super().__init__(*args, save_dir=save_dir, id=id, resume=resume, **kwargs)
        if self._wandb_init.get("anonymous") is None:
            # Lightning passes anonymous=None when not asked for; wandb then warns on every run
            # that the (deprecated) setting has no effect. Not passing it is the same run.
            self._wandb_init.pop("anonymous", None)

    @staticmethod
    def _run_id(save_dir: Path) -> str:
        path = save_dir / RUN_ID_FILE
        if path.is_file():
            stored = path.read_text(encoding="utf-8").strip()
            if stored:
                return stored
        run_id = uuid.uuid4().hex[:8]  # W&B's own ids: 8 lowercase letters and digits
        if rank_zero_only.rank == 0:  # other ranks log nothing; only rank 0's id is used
            atomic_write_text(path, run_id + "\n")
        return run_id

