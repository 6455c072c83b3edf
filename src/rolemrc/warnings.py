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
- bitsandbytes' "Failed to load CPU gemm_4bit_forward ... pip install kernels", logged when peft
  imports bitsandbytes on a CPU with AVX512-BF16 (every LoRA run, 4-bit or not): an optional
  faster CPU kernel; the 4-bit CPU path works without it.
- httpx's INFO line per HTTP request (the judge, the synthesis client): rolemrc counts and reports
  its requests itself.
- absl's "Using default tokenizer." from rouge-score, once per ROUGE scorer.
- transformers' "Loading weights" / "Writing model shards" progress bars when progress bars are
  off (``trainer.enable_progress_bar=false``) or the output is not a terminal (a log file).

And one copy of each line: a process that a launcher started as a rank other than 0 prints only
errors on the console (:func:`console_on_rank_zero`); its own log file keeps every line.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

# (message regex, category, module regex) for warnings.filterwarnings
WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, r"lightning\.pytorch\.utilities\._pytree"),
    (r"Total length of `list` across ranks is zero", UserWarning, r"lightning\.pytorch\.utilities\.data"),
    (r"`is_gradient_checkpointing` is deprecated", FutureWarning, r"transformers\.modeling_utils"),
    (r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to (load|save) in a "
     r"single process", UserWarning, r"torch\.distributed\.checkpoint\.utils"),
    (r"It is recommended to use `self\.log\('val/[^']*', \.\.\., sync_dist=True\)`", UserWarning,
     r"lightning\.pytorch\."),
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
