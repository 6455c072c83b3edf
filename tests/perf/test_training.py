"""Packed SFT and shared-prompt DPO through the real pipeline: every reference mode trains, the
precomputed reference is the same whichever layout computed it, packed runs resume exactly, and
the throughput callback logs what it promises."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from rolemrc.callbacks.throughput import ThroughputMonitor, batch_counts, model_flop_coefficients, peak_flops
from rolemrc.data.collate import PackedCollator, SFTCollator
from rolemrc.run.train import run
from tests import recorder
from tests.conftest import FAST, compose_train
from tests.train.helpers import metric_rows, series

DPO = ["objective=dpo", "objective.share_prompt=true", "data.packing=true", "data.max_length=160",
       "data.max_prompt_length=96", "data.batch_size=4", "data.val_fraction=0", "export.enabled=false",
       "optim.warmup_ratio=0", "optim.lr=3e-3"]
LORA = ["model.peft.enabled=true", "model.peft.r=8", "model.peft.alpha=16"]


@pytest.mark.parametrize("mode", ["copy", "adapter"])
def test_shared_prompt_dpo_trains_with_reference_mode(train_cfg, mode: str) -> None:
    extra = LORA if mode == "adapter" else []
    out = run(train_cfg(*DPO, f"objective.reference={mode}", "trainer.max_steps=3", *extra))
    run_dir = Path(out["run_dir"])
    losses = series(run_dir, "train/loss")
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    # Step 0: policy == reference, so the implicit rewards start at 0 exactly as unshared DPO.
    assert series(run_dir, "train/rewards/chosen")[0] == pytest.approx(0.0, abs=1e-5)
    assert losses[0] == pytest.approx(math.log(2), abs=1e-5)


def test_precomputed_reference_same_from_shared_and_separate(train_cfg, tmp_path: Path) -> None:
    tables, losses, names = {}, {}, {}
    for share in ("true", "false"):
        cache = tmp_path / f"cache_{share}"
        out = run(train_cfg(*DPO, f"objective.share_prompt={share}", "objective.reference=precomputed",
                            f"objective.reference_cache_dir={cache}", "trainer.max_steps=2"))
        (file,) = cache.glob("*.safetensors")
        tables[share], names[share] = load_file(file)["logps"], file.name
        losses[share] = series(Path(out["run_dir"]), "train/loss")
    assert torch.allclose(tables["true"], tables["false"], rtol=1e-6, atol=1e-4)
    assert names["true"] == names["false"]  # one cache key: a cache written by either serves both
    assert losses["true"] == pytest.approx(losses["false"], abs=1e-4)


def test_packed_sft_resumes_exactly_and_logs_throughput(tmp_path: Path) -> None:
    common = [*FAST, "data.packing=true", "data.batch_size=2", "data.val_fraction=0", "export.enabled=false",
              "callbacks=default", "runtime.checkpoint_every_n_steps=1", "trainer.deterministic=true",
              "+callbacks.record._target_=tests.recorder.Recorder"]

    def train(name: str, *extra: str) -> dict[int, dict]:
        run_dir = tmp_path / name
        run(compose_train([*common, f"+callbacks.record.path={run_dir}/record", *extra], run_dir=run_dir))
        return {r["step"]: r for r in recorder.read(run_dir / "record") if r["event"] == "step"}

    throughput = ["+callbacks.throughput._target_=rolemrc.callbacks.throughput.ThroughputMonitor",
                  "+callbacks.throughput.log_every_n_steps=2"]
    expected = train("reference", "trainer.max_steps=5", *throughput)
    train("interrupted", "trainer.max_steps=5", "+callbacks.stop._target_=tests.perf.helpers.StopAt",
          "+callbacks.stop.step=3")
    got = train("interrupted", "trainer.max_steps=5", "ckpt_path=last")
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4, 5]
    for step in expected:  # same packs in the same order, same weights: same loss
        assert got[step]["index"] == expected[step]["index"]
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], abs=1e-6)
    assert all(len(r["index"]) > 2 for r in expected.values())  # several conversations per row

    # The throughput monitor (conf/callbacks/throughput.yaml) on the reference run.
    logged = metric_rows(tmp_path / "reference")
    rows = [r for r in logged if "perf/tokens_per_s" in r]
    assert len(rows) == 2  # batches 2-3 and 4-5 (the first is warm-up)
    for r in rows:
        assert r["perf/tokens_per_s"] > r["perf/trained_tokens_per_s"] > 0
        assert r["perf/padding_fraction"] == 0 and r["perf/samples_per_s"] > 0 and r["perf/step_time_s"] > 0
    assert not any("perf/mfu" in r for r in logged)  # CPU: no MFU


def test_throughput_counts_and_mfu() -> None:
    rows = [{"input_ids": [1] * n, "labels": [-100] * (n - 2) + [5, 6], "index": i} for i, n in enumerate((3, 4))]
    packed = batch_counts(PackedCollator(0)([rows]))
    padded = batch_counts(SFTCollator(0)(rows))
    # real tokens, trained tokens, samples, tensor slots, causal (query, key) pairs
    assert packed.tolist() == [7, 4, 2, 7, 6 + 10]  # packed: flattened, no padding computed
    assert padded.tolist() == [7, 4, 2, 8, 6 + 10]
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16-mixed") == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA H100 PCIe", "32-true") == pytest.approx(378e12)
    assert peak_flops("Some CPU", "bf16-mixed") is None

    class FakeTrainer:
        world_size, is_global_zero, loggers, global_step, log_every_n_steps, precision = 1, True, [], 0, 1, "32-true"

    torch.manual_seed(0)
    net = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=1))
    module = SimpleNamespace(model=net, device=torch.device("cpu"))
    monitor = ThroughputMonitor(log_every_n_steps=1, skip_first=1, peak_tflops=1e-9)  # 1e3 FLOP/s, on any device
    monitor.on_train_start(FakeTrainer(), module)
    batch = PackedCollator(0)([rows])
    monitor.on_train_batch_end(FakeTrainer(), module, None, batch, 0)  # warm-up: starts the clock
    assert monitor.last == {}
    monitor.on_train_batch_end(FakeTrainer(), module, None, batch, 1)
    per_token, per_trained, per_pair = model_flop_coefficients(net)
    flops = per_token * 7 + per_trained * 4 + per_pair * 16
    last = monitor.last
    assert last["perf/mfu"] == pytest.approx(flops / last["perf/step_time_s"] / 1e3, rel=1e-6)
