"""Reading what a training run wrote."""

from __future__ import annotations

import csv
import re
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

    from rolemrc.run.train import run
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


# What an ordinary run (train.py, evaluate.py, export.py) may print on the console (issue 34,
# item 5): rolemrc's own lines, progress, the lines of a library that report what the user asked
# for, and errors and warnings of rolemrc's that ask something of the user. Anything else is noise
# to filter in rolemrc/warnings.py or fix at its source.
_LOG_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\]\[(?P<logger>[\w.]+)\]\[(?P<level>\w+)\] - (?P<message>.*)$")
_LIBRARY_LOGS = {  # logger -> the messages of it that tell the user something about their run
    "lightning.fabric.utilities.seed": ("Seed set to ",),
    "lightning.pytorch.utilities.rank_zero": ("GPU available: ", "TPU available: ", "HPU available: ",
                                              "Loading `train_dataloader` to estimate", "`Trainer.fit` stopped: "),
}
_PLAIN = re.compile(
    r"^(run summary: |  run folder: |  export: |exported model: |evaluation summary: |Reference metrics |"
    r"\||error: |warning: "  # rolemrc's prints (results as a Markdown table)
    r"|Epoch \d+/\d+ |\s+[\w/]+: [-\d.]+|generate: "  # progress bars (Rich, tqdm) and the metrics beside them
    r"|[┏┃┡│└]|(Non-)?[Tt]rainable params: |Total params: |Total estimated model params size|Modules in (train|eval) "
    r"mode: "  # the model summary (rolemrc.callbacks.model_summary: no FLOPs, Lightning counts none)
    r"|(\x1b\[[\d;]*m)*wandb(\x1b\[0m)?: )")  # W&B's own report of where the run is (logger=wandb)


def lines_outside_the_allow_list(printed: str) -> list[str]:
    """The lines of ``printed`` (stdout + stderr of an entry script) outside the allowed set, and
    the messages printed twice (a log line and a print of the same text, or once per rank)."""
    out = []
    said: set[str] = set()
    for line in printed.replace("\r", "\n").splitlines():
        if not line.strip():
            continue
        m = _LOG_LINE.match(line)
        message = m["message"] if m else line
        if m and not (m["logger"] == "rolemrc" or m["logger"].startswith("rolemrc.")
                      or message.startswith(_LIBRARY_LOGS.get(m["logger"], ("\0",)))):
            out.append(line)
        elif not m and not _PLAIN.match(line):
            out.append(line)
        elif message.startswith(("exported model: ", "run summary: ", "evaluation summary: ", "GPU available: ")):
            if message in said:
                out.append(f"{line}  <- printed twice")
            said.add(message)
    return out
