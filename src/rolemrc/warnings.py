"""The one place that silences what libraries print on every run but asks nothing of our users.

Each entry names the message and the module it comes from, so a new or different warning from
the same library still shows. :func:`filter_known_warnings` runs at the start of every entry
script (:func:`rolemrc.entry.entry_point`); add an entry here, never a blanket ``ignore``.
(wandb's "anonymous setting has no effect" is not filtered: :class:`rolemrc.loggers.WandbLogger`
no longer passes the setting that causes it.)

What is filtered, and why it asks nothing of a rolemrc user:

- Lightning's ``isinstance(treespec, LeafSpec)`` FutureWarning: Lightning's own code calling a
  torch API torch has deprecated; nothing in our configs reaches it.
- Lightning's "Tip: ... try installing litlogger" line: an advertisement printed by every Trainer.
- Lightning's "Total length of `list` across ranks is zero": a run without validation data
  (``data.val_fraction=0``) hands Lightning an empty list on purpose.
- transformers' ``is_gradient_checkpointing`` FutureWarning: peft (LoRA) calls the old name.
- torch.distributed.checkpoint's "torch.distributed is disabled ... assuming the intent is to
  load/save in a single process": rolemrc reads sharded checkpoints on one process on purpose
  (export, ``model.path=<checkpoint>``).
- lm-eval's "`pretrained` model kwarg is not of type `str`" and "Passed an already-initialized
  model through `pretrained`": rolemrc hands lm-eval the model it already loaded (its advice about
  accelerate/parallelize does not apply).
- Lightning's advice to log validation metrics with ``sync_dist=True`` under DDP/FSDP: rolemrc
  gathers the validation items across ranks itself before it logs ``val/*``.
- Lightning's "You have overridden `on_before_batch_transfer` in both `LightningModule` and
  `LightningDataModule`. It will use the implementation from `LightningDataModule`": rolemrc's
  DataModule hands every batch on to the module's own hook after its own (KTO builds its KL rows
  there), so the module's hook does run, as the note would have one believe it does not.
- bitsandbytes' "Failed to load CPU gemm_4bit_forward ... pip install kernels", logged when peft
  imports bitsandbytes on a CPU with AVX512-BF16 (every LoRA run, 4-bit or not): an optional
  faster CPU kernel; the 4-bit CPU path works without it.
- httpx's INFO line per HTTP request (the judge, the synthesis client): rolemrc counts and reports
  its requests itself.
- absl's "Using default tokenizer." from rouge-score, once per ROUGE scorer.
- transformers' "Loading weights" / "Writing model shards" progress bars when progress bars are
  off (``trainer.enable_progress_bar=false``) or the output is not a terminal (a log file).
- lm-eval's "Passed argument batch_size = auto... Detecting largest batch size" and "Determined
  largest batch size: N", print()ed each time ``benchmarks.batch_size=auto`` measures (once per
  task kind): the size found is logged once by rolemrc instead (:func:`lm_eval_prints`).

And one copy of each line: a process that a launcher started as a rank other than 0 prints only
errors on the console (:func:`console_on_rank_zero`); its own log file keeps every line.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator

# (message regex, category, module regex) for warnings.filterwarnings
WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, r"lightning\.pytorch\.utilities\._pytree"),
    (r"Total length of `list` across ranks is zero", UserWarning, r"lightning\.pytorch\.utilities\.data"),
    (r"`is_gradient_checkpointing` is deprecated", FutureWarning, r"transformers\.modeling_utils"),
    (r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to (load|save) in a "
     r"single process", UserWarning, r"torch\.distributed\.checkpoint\.utils"),
    (r"It is recommended to use `self\.log\('val/[^']*', \.\.\., sync_dist=True\)`", UserWarning,
     r"lightning\.pytorch\."),
    (r"You have overridden `on_before_batch_transfer` in both `LightningModule` and `LightningDataModule`",
     UserWarning, r"lightning\.pytorch\.trainer\.connectors\.data_connector"),
)
# logger name -> the start of the messages dropped from it
LOG_LINES: dict[str, tuple[str, ...]] = {
    "lightning.pytorch.utilities.rank_zero": ("💡 Tip: For seamless cloud logging and experiment tracking, try "
                                              "installing [litlogger]",),
    "lm_eval.models.huggingface": ("`pretrained` model kwarg is not of type `str`",
                                   "Passed an already-initialized model through `pretrained`"),
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
    "httpx": ("HTTP Request: ",),
    "absl": ("Using default tokenizer.",),
}


# lm-eval's print()s about benchmarks.batch_size=auto (case-insensitive starts: lm-eval spells
# "Largest" both ways); the second carries the size found.
LM_EVAL_BATCH_SIZE_PRINTS = ("passed argument batch_size = auto", "determined largest batch size: ")


class _PrintedLines:
    """A text stream in front of ``out`` that drops the lines starting with ``starts`` (casefolded)
    and hands each dropped line to ``seen``; every other line passes through as it was written."""

    def __init__(self, out: Any, starts: tuple[str, ...], seen: Callable[[str], None]) -> None:
        self.out, self.starts, self.seen, self.pending = out, starts, seen, ""

    def write(self, text: str) -> int:
        self.pending += text
        while "\n" in self.pending:
            line, self.pending = self.pending.split("\n", 1)
            if line.casefold().startswith(self.starts):
                self.seen(line)
            else:
                self.out.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.out.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding: the real stream's
        return getattr(self.out, name)


@contextmanager
def lm_eval_prints() -> Iterator[None]:
    """While lm-eval runs: its batch-size print()s (:data:`LM_EVAL_BATCH_SIZE_PRINTS`) dropped,
    each size it determined logged once as ``lm-eval batch size: N (benchmarks.batch_size=auto)``."""
    found: list[str] = []

    def seen(line: str) -> None:
        size = line.rsplit(":", 1)[-1].strip()
        if line.casefold().startswith(LM_EVAL_BATCH_SIZE_PRINTS[1]) and size not in found:
            found.append(size)
            logging.getLogger("rolemrc.eval.general").info("lm-eval batch size: %s (benchmarks.batch_size=auto)", size)

    out = sys.stdout
    sys.stdout = _PrintedLines(out, LM_EVAL_BATCH_SIZE_PRINTS, seen)  # type: ignore[assignment]
    try:
        yield
    finally:
        rest = sys.stdout.pending if isinstance(sys.stdout, _PrintedLines) else ""
        sys.stdout = out
        if rest:
            out.write(rest)


class _DropKnownLines(logging.Filter):
    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.starts)


def filter_known_warnings() -> None:
    """Install the filters above (idempotent); HF progress bars off when stderr is no terminal."""
    for message, category, module in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, starts in LOG_LINES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnownLines) for f in logger.filters):
            logger.addFilter(_DropKnownLines(starts))
    if not sys.stderr.isatty():
        hf_progress_bars(False)


def hf_progress_bars(enabled: bool) -> None:
    """transformers' loading/saving progress bars ("Loading weights", "Writing model shards")."""
    if "transformers" not in sys.modules:  # read when transformers is imported (a slow import to make here)
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "0" if enabled else "1"
        return
    from transformers.utils import logging as hf_logging

    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()


def launched_rank() -> int:
    """This process's global rank from its launcher's environment, read as Lightning reads it
    (0 where no launcher set one: the process a user started, which Lightning makes rank 0)."""
    for var in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


class _ErrorsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


def console_on_rank_zero() -> None:
    """On ranks other than 0, the console handlers (Hydra's on the root logger, Lightning's own
    where they remain) print errors only, so that every info and warning line of a multi-process
    run prints once, from rank 0, as Lightning's own rank-zero lines do; the rank's log file
    (Hydra: ``<job>_ddp_process_<rank>.log`` or the job's own) keeps everything. Python warnings
    go through logging there (``py.warnings``) so that they follow the same rule. Idempotent."""
    if launched_rank() == 0:
        return
    for name in ("", "lightning", "lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(name).handlers:
            console = isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
            if console and not any(isinstance(f, _ErrorsOnly) for f in handler.filters):
                handler.addFilter(_ErrorsOnly())
    if not logging.getLogger().handlers:  # nothing configured logging: warnings would go nowhere
        return
    logging.captureWarnings(True)
