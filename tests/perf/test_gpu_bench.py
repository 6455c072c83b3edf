"""benchmarks/gpu.py on CPU (``--device cpu --tiny``): the GPU benchmark's pipeline end to end
(FSDP2 on one device, bf16-mixed, packed SFT and shared-prompt DPO rows, the FLOP count behind
MFU). No timing is asserted: only that the rows ran the promised configuration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_flop_parameters_count_the_model() -> None:
    """The MFU numerator's parameter count equals the real model's parameters less the input embedding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from common import Spec
    from gpu import flop_parameters

    spec = Spec(vocab=300, hidden=64, layers=3, intermediate=96, heads=4, kv_heads=2)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, num_hidden_layers=3, intermediate_size=96,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    real = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    assert flop_parameters(spec) == real


def test_gpu_refuses_cpu_without_tiny(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "benchmarks/gpu.py", "--device", "cpu", "--work", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "--device cpu runs only with --tiny" in proc.stderr


@pytest.mark.slow
def test_gpu_bench_tiny_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "benchmarks/gpu.py", "--device", "cpu", "--tiny", "--no-trl", "--steps", "1",
                           "--warmup", "1", "--work", str(tmp_path / "work"), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["rows"]) == {"sft/ours", "dpo/ours"}
    assert result["trl"] == "TRL rows skipped (--no-trl)"
    for key, row in result["rows"].items():
        assert "error" not in row, row
        assert "strategy=fsdp" in row["overrides"] and "trainer.precision=bf16-mixed" in row["overrides"]
        assert row["steps"] == 1 and row["tokens"] > 0 and row["attended_pairs"] > 0
        assert row["mfu"] is None  # no device peak on CPU: never a made-up MFU
        assert row["model_tflops_per_s"] >= 0
    sft, dpo = result["rows"]["sft/ours"], result["rows"]["dpo/ours"]
    assert "data.packing=true" in sft["overrides"] and sft["padding_fraction"] == 0.0
    assert "objective.share_prompt=true" in dpo["overrides"] and dpo["samples"] == result["spec"]["dpo_batch"]
    assert "FSDP2 on 1 device" in result["table"][0] and "figures mean nothing" in result["table"][0]
