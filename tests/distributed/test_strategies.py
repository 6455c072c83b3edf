"""Two processes on CPU (gloo): FSDP2 and DDP runs of the tiny model train, checkpoint,
resume and export; under FSDP the parameters are really sharded; each console line prints once; under DDP the
two ranks share one build of the data store (one rank encodes, the other maps it). (DPO with a sharded reference
copy under FSDP2: tests/train/test_precision.py; with a precomputed one: test_tied.py; LoRA under
FSDP2, exported merged: tests/callbacks/test_callbacks_fsdp.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests import recorder
from tests.conftest import ROOT

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

BASE = ["trainer.accelerator=cpu", "trainer.devices=2", "data.max_length=96", "data.val_fraction=0",
        "trainer.enable_progress_bar=false", "runtime.checkpoint_every_n_steps=2",
        "+callbacks.record._target_=tests.recorder.Recorder"]


def train(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "train.py", *BASE, f"hydra.run.dir={run_dir}", f"+callbacks.record.path={run_dir}/record",
         *overrides],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def assert_console_once(proc: subprocess.CompletedProcess, run_dir: Path) -> None:
    """Every console line of the 2-rank run printed once (rank 1 prints errors only: issue 34);
    rank 1's lines are kept in its own log file."""
    lines = [re.sub(r"^\[\d{4}-\d\d-\d\d [\d:,]+\]", "", line).strip()  # Hydra's timestamp
             for line in (proc.stdout + proc.stderr).splitlines()]
    counts = Counter(line for line in lines if re.search(r"\w", line))  # not blank or a rule of dashes
    assert not [line for line, n in counts.items() if n > 1], [line for line, n in counts.items() if n > 1]
    assert not [line for line in lines if "[rank: 1]" in line or "GLOBAL_RANK: 1" in line]
    assert any("[rolemrc." in line and "records kept" in line for line in lines)  # rank 0's still print
    (rank1_log,) = run_dir.glob("*_process_1.log")
    assert "records kept" in rank1_log.read_text()


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_train_checkpoint_resume_export(tmp_path: Path, strategy: str) -> None:
    run_dir = tmp_path / strategy
    extra = [f"strategy={strategy}"] + (["strategy.param_dtype=null"] if strategy == "fsdp" else [])
    store = tmp_path / "store"  # a store of this run's own, built here (not one an earlier test left)
    first = train(run_dir, *extra, "trainer.max_steps=4", f"data.cache_dir={store}")
    assert_console_once(first, run_dir)
    if strategy == "ddp":  # the two ranks share one build (was tests/data/test_store.py's own 2-rank run)
        (rank1_log,) = run_dir.glob("*_process_1.log")  # rank 1 prints only errors on the console
        printed = first.stdout + first.stderr + rank1_log.read_text()
        assert printed.count("data store: encoded") == 1, printed[-4000:]  # one build ...
        assert printed.count("data store: reusing") >= 1, printed[-4000:]  # ... that the other rank maps
        assert len(list(store.glob("sft-*/meta.json"))) == 1

    starts = [next(r for r in recorder.read(run_dir / "record", rank) if r["event"] == "start") for rank in (0, 1)]
    assert all(s["world_size"] == 2 for s in starts)
    if strategy == "fsdp":  # each rank holds about half of every parameter
        for s in starts:
            assert s["local_params"] <= s["full_params"] // 2 + 1024, s
        ckpt = run_dir / "checkpoints" / "last.ckpt"
        assert ckpt.is_dir() and (ckpt / ".metadata").exists()
        assert len(list(ckpt.glob("*.distcp"))) == 2
    else:
        assert all(s["local_params"] == s["full_params"] for s in starts)
        assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    # Both ranks trained on different samples at every step.
    for r0, r1 in zip(*(
        [r for r in recorder.read(run_dir / "record", rank) if r["event"] == "step"] for rank in (0, 1)
    )):
        assert r0["step"] == r1["step"] and not set(r0["index"]) & set(r1["index"])

    export = run_dir / "export"
    model = AutoModelForCausalLM.from_pretrained(export)
    assert model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False).shape[1] == 7

    # (export.py rebuilds the same weights from a sharded checkpoint: tests/train/test_precision.py;
    # from a single-file one: tests/train/test_checkpoint_as_model.py, test_adapter_export.py.)

    # Resume: continues from step 4 on both ranks.
    train(run_dir, *extra, "trainer.max_steps=6", "ckpt_path=last", f"data.cache_dir={store}")
    for rank in (0, 1):
        records = recorder.read(run_dir / "record", rank)
        restart = [r for r in records if r["event"] == "start"][-1]
        assert restart["global_step"] == 4
        assert [r["step"] for r in records if r["event"] == "step"][-2:] == [5, 6]
