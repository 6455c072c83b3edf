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


def train_in_process(run_dir: Path, *overrides: str) -> Path:
    """What ``python train.py <overrides> hydra.run.dir=<run_dir>`` leaves, made in this process
    (no interpreter start-up: ~9 s of imports per process on this 2-core machine): the same run,
    and the files of ``.hydra/`` that readers of a run folder use (``config.yaml``, the job's
    config as composed, ``run_dir`` still the interpolation Hydra leaves there, and
    ``overrides.yaml``), written before it trains, as Hydra does. For fixtures that need a
    finished run; what train.py itself prints and writes is tested through the script
    (tests/train/test_console.py, test_resume_folder.py)."""
    from omegaconf import OmegaConf

    from rolemrc.train import run
    from tests.conftest import CONF, compose_train

    cfg = compose_train(list(overrides), run_dir=run_dir)
    saved = Path(run_dir) / ".hydra"
    saved.mkdir(parents=True, exist_ok=True)
    job = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
    job.run_dir = OmegaConf.to_container(OmegaConf.load(CONF / "train.yaml"), resolve=False)["run_dir"]
    OmegaConf.save(job, saved / "config.yaml")
    OmegaConf.save(OmegaConf.create(list(overrides)), saved / "overrides.yaml")
    run(cfg)
    return Path(run_dir)
