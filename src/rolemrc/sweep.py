"""Sweeps (``python train.py -m ...``): every job runs, and the sweep ends with one row per job.

A job of a sweep that fails (bad input: its one ``error:`` line; a bug: its traceback) does not
end the sweep: :func:`job_outcome` (inside :func:`rolemrc.entry.entry_point`) records it in
``<job folder>/sweep_job.json`` and the launcher goes on with the other jobs (Hydra's basic
launcher would stop at the first ``SystemExit``; the submitit launchers, ``hydra/launcher=local``
and ``slurm``, would end in an ``UncompletedJobError`` traceback). When all jobs are done,
:class:`SweepSummary` (a Hydra callback, ``conf/hydra/default.yaml``) prints a table, one row per
job (its overrides, status, steps, final train and validation loss, run folder; the figures come
from the job's ``run_summary.json``, which training writes), each failed job's one-line reason,
and writes the same to ``<sweep dir>/sweep_summary.md``. Any failed job: exit status 1.

A job killed from outside (out of memory, a node lost) leaves no record: its row says so, and
the submitit launchers still report it their own way.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from rolemrc.errors import UserError
from rolemrc.fileio import atomic_write_json, atomic_write_text

JOB_FILE = "sweep_job.json"  # in each job's folder: {"status": "completed"|"failed", "error": ...}
RUN_SUMMARY = "run_summary.json"  # written by training (rolemrc.run.train.fit)
SUMMARY_FILE = "sweep_summary.md"
TARGET = f"{__name__}.SweepSummary"


def summarised_job_dir() -> Path | None:
    """The job's folder when this process runs one job of a sweep that :class:`SweepSummary`
    reports on, else None (a single run, or a sweep without the callback)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None
    targets = [str(c.get("_target_", "")) for c in (hc.callbacks or {}).values() if c is not None]
    return Path(hc.runtime.output_dir) if TARGET in targets else None


@contextmanager
def job_outcome(job_dir: Path) -> Iterator[None]:
    """One job of a sweep: its outcome goes to ``<job_dir>/sweep_job.json`` for the summary and
    the sweep goes on. A :class:`~rolemrc.errors.UserError` prints its ``error:`` line, any other
    exception its traceback (then both are in the job's log and the summary)."""
    record: dict[str, Any] = {"status": "failed", "error": "stopped before its end"}
    try:
        yield
        record = {"status": "completed"}
    except UserError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        record = {"status": "failed", "error": f"error: {err}"}
    except Exception as err:
        traceback.print_exc()
        text = str(err).strip().splitlines()
        record = {"status": "failed", "error": f"{type(err).__name__}: {text[0]}" if text else type(err).__name__}
    finally:
        atomic_write_json(job_dir / JOB_FILE, record)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def job_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job folder (``<sweep_dir>/<n>`` with ``.hydra``), in job order."""
    rows = []
    jobs = [p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit() and (p / ".hydra").is_dir()]
    for job in sorted(jobs, key=lambda p: int(p.name)):
        overrides_file = job / ".hydra" / "overrides.yaml"
        overrides = [str(o) for o in OmegaConf.load(overrides_file)] if overrides_file.is_file() else []
        record = _read_json(job / JOB_FILE) or {"status": "no result",
                                                "error": "no record of its end (killed, or still running?)"}
        figures = _read_json(job / RUN_SUMMARY) or {}
        rows.append({"job": int(job.name), "overrides": overrides, **record,
                     **{k: figures.get(k) for k in ("steps", "train_loss", "val_loss")},
                     "run_dir": figures.get("run_dir") or str(job.resolve())})
    return rows


def _number(value: Any, digits: int = 4) -> str:
    return "" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def summary_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per job; the overrides shown are those not common to every job."""
    common = set.intersection(*(set(r["overrides"]) for r in rows)) if len(rows) > 1 else set()
    lines = ["| job | overrides | status | steps | train/loss | val/loss | run folder |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        shown = " ".join(o for o in r["overrides"] if o not in common) or "(none)"
        lines.append(f"| {r['job']} | `{shown}` | {r['status']} | {_number(r['steps'])} | {_number(r['train_loss'])} "
                     f"| {_number(r['val_loss'])} | {r['run_dir']} |")
    failed = [r for r in rows if r["status"] != "completed"]
    if failed:
        lines.append("")
        lines.extend(f"- job {r['job']} {r['status']}: {r.get('error', '')}" for r in failed)
    if common:
        lines.append("")
        lines.append(f"Every job: `{' '.join(sorted(common))}`")
    return "\n".join(lines) + "\n"


class SweepSummary(Callback):
    """Hydra callback: at the end of a sweep, the table of :func:`summary_table` printed and
    written to ``<sweep dir>/sweep_summary.md``; exit status 1 when a job failed."""

    def __init__(self) -> None:
        self.sweep_dir: Path | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.sweep_dir = Path(str(config.hydra.sweep.dir))  # resolved once: ${now:...} as the launcher saw it

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = self.sweep_dir or Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            return
        rows = job_rows(sweep_dir)
        if not rows:
            return

        failed = sum(r["status"] != "completed" for r in rows)
        title = f"sweep {sweep_dir}: {len(rows)} jobs, {len(rows) - failed} completed, {failed} failed"
        table = summary_table(rows)
        atomic_write_text(sweep_dir / SUMMARY_FILE, f"# {title}\n\n{table}")
        print(f"\n{title}\n{table}summary: {sweep_dir / SUMMARY_FILE}", flush=True)
        if failed:
            raise SystemExit(1)  # passes Hydra's callback guard (it catches Exception only)
