"""Loggers that survive a kill and a resume (``conf/logger/{csv,wandb}.yaml`` point here).

Lightning's own loggers start every process afresh: its CSV logger deletes ``metrics.csv``
when the folder exists and writes rows every 100 steps, so a resumed run loses the rows from
before the crash and a killed one the last 99; its W&B logger starts a new W&B run each time.

* :class:`CSVLogger` writes each row as it is logged (``flush_logs_every_n_steps=1``), keeps
  the file it finds, and on the first row of a new process drops the rows at or after that
  row's step (logged after the checkpoint the run resumed from, so logged again now): killed
  and resumed, ``metrics.csv`` holds the rows of an uninterrupted run. A run started afresh in
  the folder (step 0) replaces them all, as before. Header changes rewrite the file atomically.
* :class:`WandbLogger` keeps the W&B run id in ``<save_dir>/wandb_run_id`` and passes
  ``resume="allow"``, so a resumed run (same folder) continues the same W&B run.
"""

from __future__ import annotations

import csv
import io
import uuid
from pathlib import Path
from typing import Any, Optional

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger as _LightningCSVLogger
from lightning.pytorch.loggers import WandbLogger as _LightningWandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from rolemrc.fileio import atomic_open, atomic_write_text


def _step(row: dict[str, Any]) -> float | None:
    value = row.get("step")
    return float(value) if value not in (None, "") else None


class AppendingExperimentWriter(ExperimentWriter):
    """Lightning's CSV writer without the deletion of an existing ``metrics.csv``; see the module."""

    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir=log_dir)
        self._resumed = False  # becomes True once this process has reconciled the existing file
        path = Path(self.metrics_file_path)
        if path.is_file():
            with path.open(newline="") as fh:
                header = next(csv.reader(fh), [])
            self.metrics_keys = sorted(k for k in header if k)

    def _check_log_dir_exists(self) -> None:  # Lightning deletes metrics.csv here; keep it
        pass

    def _read_rows(self) -> list[dict[str, Any]]:
        path = Path(self.metrics_file_path)
        if not path.is_file():
            return []
        text = path.read_text(encoding="utf-8")
        if text and not text.endswith("\n"):  # a row torn by a kill mid-write: not a row
            text = text[: text.rfind("\n") + 1]
        return list(csv.DictReader(io.StringIO(text, newline="")))

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        with atomic_open(self.metrics_file_path, "w") as fh:  # a kill mid-rewrite keeps the old file
            writer = csv.DictWriter(fh, fieldnames=self.metrics_keys, lineterminator="\r\n")
            writer.writeheader()
            writer.writerows(rows)

    def save(self) -> None:
        if not self.metrics:
            return
        new_keys = self._record_new_keys()
        path = Path(self.metrics_file_path)
        if not self._resumed:
            self._resumed = True
            first = min(s for s in (_step(m) for m in self.metrics) if s is not None)
            old = self._read_rows()
            kept = [r for r in old if (s := _step(r)) is None or s < first]
            if path.is_file() and (len(kept) != len(old) or new_keys):
                self._rewrite(kept)
        elif new_keys and path.is_file():
            self._rewrite(self._read_rows())
        exists = path.is_file()
        with path.open("a" if exists else "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=self.metrics_keys, lineterminator="\r\n")
            if not exists:
                writer.writeheader()
            writer.writerows(self.metrics)
            fh.flush()  # in the OS's hands now: a SIGKILL right after loses nothing
        self.metrics = []


class CSVLogger(_LightningCSVLogger):
    """``lightning.pytorch.loggers.CSVLogger`` that appends across resumes and writes every row
    as it is logged; same arguments (``flush_logs_every_n_steps`` defaults to 1)."""

    def __init__(self, save_dir: str | Path, name: Optional[str] = "lightning_logs", version: Optional[int | str] = None,
                 prefix: str = "", flush_logs_every_n_steps: int = 1) -> None:
        super().__init__(save_dir=save_dir, name=name, version=version, prefix=prefix,
                         flush_logs_every_n_steps=flush_logs_every_n_steps)

    @property
    @rank_zero_experiment  # other ranks get a dummy that writes nothing, as in Lightning
    def experiment(self) -> AppendingExperimentWriter:  # type: ignore[override]
        if self._experiment is not None:
            return self._experiment
        self._fs.makedirs(self.root_dir, exist_ok=True)
        self._experiment = AppendingExperimentWriter(log_dir=self.log_dir)
        return self._experiment


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

