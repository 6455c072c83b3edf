"""Reading what a training run wrote."""

from __future__ import annotations

import csv
from pathlib import Path


def metric_rows(run_dir: Path) -> list[dict[str, float]]:
    """Rows of the CSV logger's metrics.csv with the empty cells dropped."""
    path = Path(run_dir) / "csv" / "metrics.csv"
    with path.open() as fh:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(fh)]


def series(run_dir: Path, key: str) -> list[float]:
    return [row[key] for row in metric_rows(run_dir) if key in row]
