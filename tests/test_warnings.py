"""rolemrc.warnings drops exactly the listed library lines (issue 34, item 5) and nothing else
from the same loggers; the console allow-list runs (tests/train/test_console.py) cover what this
machine's runs print, this covers the lines only some machines or settings print (bitsandbytes on
an AVX512-BF16 CPU, httpx with an API judge, DDP validation)."""

from __future__ import annotations

import logging
import warnings

import pytest

from rolemrc.warnings import filter_known_warnings

DROPPED = [
    ("lm_eval.models.huggingface", "Passed an already-initialized model through `pretrained`, assuming single-process "
                                   "call to evaluate() or custom distributed integration"),
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community: boom. Please make "
                                      "sure you already `pip install kernels` and the kernels >= 0.11.1"),
    ("httpx", 'HTTP Request: POST http://127.0.0.1:8000/v1/chat/completions "HTTP/1.1 200 OK"'),
    ("absl", "Using default tokenizer."),
]


@pytest.mark.parametrize(("logger", "message"), DROPPED)
def test_listed_log_lines_are_dropped_and_others_kept(logger: str, message: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    filter_known_warnings()
    with caplog.at_level(logging.INFO, logger=logger):
        logging.getLogger(logger).warning(message)
        logging.getLogger(logger).warning("something else the user should read")
    assert [r.getMessage() for r in caplog.records if r.name == logger] == ["something else the user should read"]


def test_lightnings_sync_dist_advice_on_val_metrics_is_dropped() -> None:
    filter_known_warnings()
    module = "lightning.pytorch.trainer.connectors.logger_connector.result"
    advice = ("It is recommended to use `self.log('{}', ..., sync_dist=True)` when logging on epoch level in "
              "distributed setting to accumulate the metric across devices.")
    with warnings.catch_warnings(record=True) as caught:
        filter_known_warnings()
        for name in ("val/loss", "train/loss"):
            warnings.warn_explicit(advice.format(name), UserWarning, "result.py", 434, module=module)
    assert [str(w.message) for w in caught] == [advice.format("train/loss")]  # only rolemrc's val/* gathered
