"""Both callbacks under FSDP2 on two CPU processes (gloo), training LoRA: every rank runs the
generation, judge and probe forwards (they all-gather sharded weights), no rank hangs, rank 0
alone writes and logs, and the maps of the sharded model equal those of the same weights
unsharded (LoRA's B starts at zero); the run's export is merged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import lightning as L
import numpy as np
import pytest
from transformers import AutoModelForCausalLM

from rolemrc import asset
from rolemrc.data.readers import read_examples
from rolemrc.data.templates import ChatFormat
from rolemrc.models.loading import load_model, load_tokenizer
from rolemrc.probing import balanced_subset, compute_frequency_maps, load_maps
from rolemrc.tasks import dimensions_of
from tests import recorder
from tests.conftest import ROOT, compose_train
from tests.train.helpers import metric_rows

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

N_ITEMS = 6


def test_fsdp_every_rank_forwards_rank0_writes(tmp_path: Path) -> None:
    run_dir = tmp_path / "fsdp"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "train.py", "trainer.accelerator=cpu", "trainer.devices=2", "strategy=fsdp",
         "strategy.param_dtype=null", "data.max_length=96", "trainer.enable_progress_bar=false",
         "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
         "model.peft.enabled=true", "+callbacks.record._target_=tests.recorder.Recorder",
         f"+callbacks.record.path={run_dir}/record",
         "callbacks=[judge_scores,activation_maps]", f"callbacks.judge_scores.n_items={N_ITEMS}",
         "callbacks.judge_scores.max_new_tokens=8", "callbacks.judge_scores.judge.backend=hf",
         "callbacks.judge_scores.judge.max_tokens=8", f"callbacks.activation_maps.n_items={N_ITEMS}",
         f"hydra.run.dir={run_dir}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # LoRA under FSDP2: the parameters sharded, and the export merged (no adapter weights left).
    starts = [r for r in recorder.read(run_dir / "record", 0) if r["event"] == "start"]
    assert starts[0]["local_params"] < starts[0]["full_params"]
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "export")
    assert not any("lora" in n for n, _ in merged.named_parameters())

    # Both ranks asked the live judge (its forwards are collective); rank 0 alone scored.
    # (rank 1 prints only errors on the console; its own log file keeps its lines)
    log = proc.stdout + proc.stderr
    (rank1_log,) = run_dir.glob("*_process_1.log")
    assert log.count("judge: 8 prompts") == 1, log[-3000:]  # rank 0: 1 round
    assert rank1_log.read_text().count("judge: 8 prompts") == 1  # rank 1 asked too
    assert log.count("judge_scores at step") == 1 and "judge_scores at step" not in rank1_log.read_text()

    judge_dir = run_dir / "callbacks" / "judge_scores"
    assert sorted(p.name for p in judge_dir.iterdir()) == ["step_2.json", "step_2.jsonl"]
    items, _ = read_examples([{"path": asset("sample/test.jsonl")}], "test")
    subset = balanced_subset(items, N_ITEMS)
    expected = Counter(d.short for it in subset for d in dimensions_of(it.task))
    for step in (2,):
        lines = (judge_dir / f"step_{step}.jsonl").read_text().splitlines()
        assert [json.loads(ln)["task"] for ln in lines] == [it.task for it in subset]
        dims = json.loads((judge_dir / f"step_{step}.json").read_text())["judge"]["dimensions"]
        assert {d: s["n_total"] for d, s in dims.items()} == dict(expected)
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows if "gen/bleu" in r] == [2]
    assert [r["step"] for r in rows if "activation_maps/ALL/mean_abs_change" in r] == [2]

    maps_dir = run_dir / "callbacks" / "activation_maps"
    assert {"start.npz", "step_2.npz", "step_2.png", "step_2_discrepancy.png"} <= {p.name for p in maps_dir.iterdir()}
    # Start maps from the sharded model == the same initial weights probed whole, in this process.
    cfg = compose_train(["data.max_length=96"], run_dir=tmp_path / "unused")
    L.seed_everything(cfg.seed, workers=True)  # as train.run does before building the model
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tokenizer)
    whole = compute_frequency_maps(model, ChatFormat(tokenizer, eot=cfg.model.eot_token), subset, site="mlp_out",
                                   top_fraction=0.2, batch_size=4)
    sharded = load_maps(maps_dir / "start.npz")
    assert sharded["n_cases"] == whole.n_cases
    for group, freq in whole.freq.items():
        np.testing.assert_allclose(sharded["freq_a"][group], freq, atol=1e-6)
