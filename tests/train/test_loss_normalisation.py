"""The loss of one optimizer step is the mean over every label token (SFT) or pair (DPO) of the
global batch, however it is cut: (12 x 1), (4 x 3), (1 x 12) on one process and 2 ranks (DDP
and FSDP2) give the same weights after a whole epoch, the short last step included, and log
the same train/loss. val/loss is the token mean over the whole validation set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from rolemrc.run.train import run
from tests.conftest import ROOT
from tests.train.helpers import series

# The one-process (12 x 1) epoch is the reference of the SFT cuts and of both 2-rank runs: made
# once (module fixture), on one xdist worker.
pytestmark = pytest.mark.xdist_group("loss_normalisation")

# 122 sample conversations, no validation: steps of 12 leave a short last step of 2.
COMMON = ["data.max_length=96", "data.val_fraction=0", "trainer.max_epochs=1", "optim.lr=1e-3",
          "optim.warmup_ratio=0", "trainer.log_every_n_steps=1"]
SFT_CUTS = [(12, 1), (4, 3), (1, 12)]


def cut(batch: int, accumulate: int) -> list[str]:
    return [f"data.batch_size={batch}", f"trainer.accumulate_grad_batches={accumulate}"]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(Path(run_dir) / "export" / "model.safetensors")


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], start: dict[str, torch.Tensor],
                        what: str) -> None:
    """Each tensor's difference is float noise next to its training update (relative L2 norms;
    AdamW turns tiny gradient noise into sign-sized steps on rarely seen embedding rows, so
    max-abs is too strict, while a differently normalised loss moves weights by percents)."""
    for k in a:
        moved = (a[k] - start[k]).norm().item()
        assert moved > 0, f"{k} did not train"
        diff = (a[k] - b[k]).norm().item()
        assert diff <= 1e-3 * moved, f"{what}: {k} differs by {diff / moved:.2%} of its update"


@pytest.fixture(scope="module")
def start(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The tiny model's initial weights (same seed as every run below): a 0-step export."""
    from tests.conftest import FAST, compose_train

    out = run(compose_train([*FAST, *COMMON, "trainer.max_steps=0"],
                            run_dir=tmp_path_factory.mktemp("start") / "run"))
    return weights(Path(out["run_dir"]))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The run folder of the whole epoch in steps of (12 x 1) on one process."""
    from tests.conftest import FAST, compose_train

    out = run(compose_train([*FAST, *COMMON, *cut(*SFT_CUTS[0])], run_dir=tmp_path_factory.mktemp("12x1") / "run"))
    return Path(out["run_dir"])


def test_sft_same_update_however_the_global_batch_is_cut(train_cfg, tmp_path: Path, start, one_process) -> None:
    results = {}
    for b, a in SFT_CUTS:
        if (b, a) == SFT_CUTS[0]:
            run_dir = one_process
        else:
            cfg = train_cfg(*COMMON, *cut(b, a))
            cfg.run_dir = str(tmp_path / f"{b}x{a}")
            run_dir = Path(run(cfg)["run_dir"])
        results[(b, a)] = (weights(run_dir), series(run_dir, "train/loss"), series(run_dir, "train/tokens"))
    (w0, loss0, tokens0) = results[SFT_CUTS[0]]
    assert len(loss0) == 11 and tokens0[-1] < tokens0[0]  # the short last step is there
    for key, (w, loss, tokens) in results.items():
        assert tokens == tokens0, key
        assert loss == pytest.approx(loss0, rel=1e-5), key
        assert_same_weights(w, w0, start, f"{key} vs {SFT_CUTS[0]}")


def train_2proc(run_dir: Path, *overrides: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "train.py", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.enable_progress_bar=false",
         "callbacks=none", f"hydra.run.dir={run_dir}", *COMMON, *overrides],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_make_the_same_update_as_one(tmp_path: Path, start, one_process: Path, strategy: str) -> None:
    extra = [f"strategy={strategy}"] + (["strategy.param_dtype=null"] if strategy == "fsdp" else [])
    train_2proc(tmp_path / strategy, *extra, *cut(2, 3))  # 2 ranks x 2 x 3 = 12 a step
    assert series(tmp_path / strategy, "train/loss") == pytest.approx(series(one_process, "train/loss"), rel=1e-5)
    assert_same_weights(weights(tmp_path / strategy), weights(one_process), start, strategy)


DPO_ARGS = ["objective=dpo", "data.max_prompt_length=64", "objective.sft_weight=0.5", "trainer.max_steps=3"]


def test_dpo_with_sft_term_same_update_however_cut(train_cfg, tmp_path: Path) -> None:
    """The pair mean and the chosen-token NLL term are both global-batch means."""
    results = {}
    for b, a in [(4, 1), (2, 2), (1, 4)]:
        cfg = train_cfg(*COMMON, *DPO_ARGS, *cut(b, a))
        cfg.run_dir = str(tmp_path / f"{b}x{a}")
        out = run(cfg)
        run_dir = Path(out["run_dir"])
        results[(b, a)] = (weights(run_dir), series(run_dir, "train/loss"), series(run_dir, "train/nll_chosen"))
    w0, loss0, nll0 = results[(4, 1)]
    start = weights_of_init(tmp_path)
    for key, (w, loss, nll) in results.items():
        assert loss == pytest.approx(loss0, rel=1e-5) and nll == pytest.approx(nll0, rel=1e-5), key
        assert_same_weights(w, w0, start, f"dpo {key}")


def weights_of_init(tmp_path: Path) -> dict[str, torch.Tensor]:
    from tests.conftest import FAST, compose_train

    out = run(compose_train([*FAST, *COMMON, *DPO_ARGS, "trainer.max_steps=0"], run_dir=tmp_path / "init"))
    return weights(Path(out["run_dir"]))


def test_val_loss_is_the_token_mean_of_the_whole_set(train_cfg, tmp_path: Path) -> None:
    """Not a mean of batch means: the same for any validation batch size (lr 0: same weights)."""
    values = []
    for b in (1, 5):
        cfg = train_cfg("data.max_length=96", "data.val_fraction=0.1", "optim.lr=0", "trainer.max_steps=1", "trainer.val_check_interval=1",
                        f"data.batch_size={b}", "export.enabled=false")
        cfg.run_dir = str(tmp_path / f"b{b}")
        values.append(series(Path(run(cfg)["run_dir"]), "val/loss"))
    assert len(values[0]) == 1 and values[0] == pytest.approx(values[1], rel=1e-6)


class StopAt(L.Callback):
    """Dies (like a crash) before training step ``step + 1``, after step ``step``'s checkpoint."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"stopped at step {self.step}")


def test_limit_train_batches_then_resume_continues_where_it_stopped(train_cfg, tmp_path: Path) -> None:
    """Epochs cut by limit_train_batches (5 steps): killed after step 7 (mid epoch 2), the resumed
    run trains step 8 on the batch the uninterrupted run did, not on a replayed one."""
    from tests import recorder

    args = ["data.max_length=96", "data.val_fraction=0", "trainer.limit_train_batches=5", "trainer.max_epochs=3",
            "trainer.max_steps=9", "callbacks=default", "runtime.checkpoint_every_n_steps=1", "export.enabled=false",
            "+callbacks.record._target_=tests.recorder.Recorder"]
    whole = train_cfg(*args, f"+callbacks.record.path={tmp_path}/whole")
    whole.run_dir = str(tmp_path / "whole")
    run(whole)
    crash = train_cfg(*args, f"+callbacks.record.path={tmp_path}/parts",
                      "+callbacks.stop._target_=tests.train.test_loss_normalisation.StopAt", "+callbacks.stop.step=7")
    crash.run_dir = str(tmp_path / "parts")
    with pytest.raises(RuntimeError, match="stopped at step 7"):
        run(crash)
    resume = train_cfg(*args, f"+callbacks.record.path={tmp_path}/parts", "ckpt_path=last")
    resume.run_dir = str(tmp_path / "parts")
    run(resume)
    expected = {r["step"]: r for r in recorder.read(tmp_path / "whole") if r["event"] == "step"}
    got = [r for r in recorder.read(tmp_path / "parts") if r["event"] == "step"]
    assert [r["step"] for r in got] == list(range(1, 10))
    for r in got:
        assert r["index"] == expected[r["step"]]["index"], r["step"]
        assert r["loss"] == pytest.approx(expected[r["step"]]["loss"], abs=1e-5), r["step"]
