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


def test_lightnings_note_on_the_shared_batch_hook_is_dropped_for_that_hook_only() -> None:
    """KTO's on_before_batch_transfer runs (rolemrc's DataModule hands each batch on to it):
    Lightning's note that only the DataModule's hook is used is dropped; the same note about
    another hook is kept."""
    module = "lightning.pytorch.trainer.connectors.data_connector"
    note = ("You have overridden `{}` in both `LightningModule` and `LightningDataModule`. It will use the "
            "implementation from `LightningDataModule` instance.")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filter_known_warnings()
        for hook in ("on_before_batch_transfer", "transfer_batch_to_device"):
            warnings.warn_explicit(note.format(hook), UserWarning, "data_connector.py", 371, module=module)
    assert [str(w.message) for w in caught] == [note.format("transfer_batch_to_device")]


def test_the_datamodule_hands_batches_on_to_the_modules_own_hook() -> None:
    """What makes dropping that note true: ChatDataModule's hook calls the module's (KTO's)."""
    from types import SimpleNamespace

    from rolemrc.data.datamodule import ChatDataModule
    from rolemrc.modules.kto import KTOModule

    seen = []

    class Module(KTOModule):
        def __init__(self) -> None:  # only the hook is exercised
            pass

        def on_before_batch_transfer(self, batch, dataloader_idx):  # type: ignore[no-untyped-def]
            seen.append(batch)
            return {**batch, "kl": 1}

    dm = ChatDataModule.__new__(ChatDataModule)
    dm.trainer = SimpleNamespace(training=False, lightning_module=Module())
    assert dm.on_before_batch_transfer({"x": 0}, 0) == {"x": 0, "kl": 1} and seen == [{"x": 0}]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_other_ranks_print_only_errors_on_the_console_and_keep_the_rest_in_their_file(
        rank: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What tests/distributed/test_strategies.py checks on a real 2-rank run, for each handler kind
    and for Python warnings (rank 1 routes them through logging)."""
    import io

    from rolemrc.warnings import console_on_rank_zero

    for var in ("RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LOCAL_RANK", rank)  # what Lightning's launcher sets in the processes it starts
    root = logging.getLogger()
    console, log_file = io.StringIO(), tmp_path / "job.log"
    handlers = [logging.StreamHandler(console), logging.FileHandler(log_file)]
    saved = root.handlers[:], root.level
    root.handlers[:] = handlers
    root.setLevel(logging.INFO)
    try:
        console_on_rank_zero()
        console_on_rank_zero()  # idempotent
        log = logging.getLogger("rolemrc.something")
        log.info("an info line")
        log.warning("a warning line")
        log.error("an error line")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("a python warning", UserWarning, stacklevel=1)
    finally:
        logging.captureWarnings(False)
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        for h in handlers:
            h.close()
    printed, kept = console.getvalue(), log_file.read_text()
    assert "an error line" in printed
    for line in ("an info line", "a warning line", "an error line"):
        assert line in kept
    if rank == "1":
        assert "an info line" not in printed and "a warning line" not in printed
        assert "a python warning" in kept and "a python warning" not in printed
    else:
        assert "an info line" in printed and "a warning line" in printed


def test_lm_evals_batch_size_prints_become_one_rolemrc_line(capsys: pytest.CaptureFixture[str],
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """lm-eval print()s two lines each time benchmarks.batch_size=auto measures (no logger to
    filter): dropped while it runs, the size found logged once; other prints pass through."""
    from rolemrc.warnings import lm_eval_prints

    with caplog.at_level(logging.INFO, logger="rolemrc"), lm_eval_prints():
        for _ in range(2):  # once per request kind: the same size is said once
            print("Passed argument batch_size = auto:1. Detecting largest batch size")
            print("Determined largest batch size: 8")
        print("Passed argument batch_size = auto. Detecting largest batch size")
        print("Determined Largest batch size: 4")
        print("a table lm-eval prints", end="")
        print(" in two writes")
    print("Determined largest batch size: 2")  # outside: untouched
    assert capsys.readouterr().out == "a table lm-eval prints in two writes\nDetermined largest batch size: 2\n"
    said = [r.getMessage() for r in caplog.records if r.name.startswith("rolemrc")]
    assert said == ["lm-eval batch size: 8 (benchmarks.batch_size=auto)", "lm-eval batch size: 4 (benchmarks.batch_size=auto)"]
