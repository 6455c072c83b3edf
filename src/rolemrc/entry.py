"""What every entry script (train.py, evaluate.py, probe.py, synthesize.py, export.py) wraps its
work in: bad input ends in one ``error: <message>`` line, and Lightning's log lines print once,
from rank 0 only in a multi-process run."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rolemrc.errors import exit_on_user_error
from rolemrc.sweep import job_outcome, summarised_job_dir
from rolemrc.warnings import console_on_rank_zero, filter_known_warnings


def one_copy_of_lightning_logs() -> None:
    """Lightning's package logger ``lightning`` has a console handler of its own ("INFO: ...") and
    also propagates to the root logger, which Hydra has configured (console + ``<job>.log``): every
    Lightning line printed twice. Where the root logger has handlers, they alone print; the
    ``lightning.pytorch``/``lightning.fabric`` loggers (which keep their own handler and stop
    propagating when imported before logging was configured) are routed there too. Call it after
    ``lightning`` is imported (it is not imported here: evaluate.py does not need it)."""
    if "lightning" not in sys.modules or not logging.getLogger().handlers:
        return
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:  # Lightning's own; Hydra's sit on the root
                logger.removeHandler(handler)
        logger.propagate = True


@contextmanager
def entry_point(cfg: Any = None) -> Iterator[None]:
    """A :class:`~rolemrc.errors.UserError` ends the process with ``error: <message>`` on stderr
    and exit status 1 (:func:`~rolemrc.errors.exit_on_user_error`); any other exception is a bug
    and keeps its traceback. In one job of a sweep (``-m``) the job's failure is printed the same
    way and recorded for the sweep's summary, and the sweep goes on (:mod:`rolemrc.sweep`).
    Known warnings that ask nothing of the user are filtered (:mod:`rolemrc.warnings`), and on
    ranks other than 0 the console prints errors only (:func:`~rolemrc.warnings.console_on_rank_zero`). Import
    the run function (and so Lightning) before entering. ``cfg``: the composed config, whose keys
    are checked against its schema first (:func:`rolemrc.config.check_known_keys`: a key added
    with ``+`` that the schema lacks is an error before anything loads)."""
    filter_known_warnings()
    one_copy_of_lightning_logs()
    console_on_rank_zero()
    job_dir = summarised_job_dir()
    if job_dir is not None:
        with job_outcome(job_dir):
            _check_keys(cfg)
            yield
        return
    with exit_on_user_error():
        _check_keys(cfg)
        yield


def _check_keys(cfg: Any) -> None:
    if cfg is not None:
        from rolemrc.config import check_known_keys  # config imports hydra: only where a config is given

        check_known_keys(cfg)
