"""benchmarks/gpu.py on CPU (``--device cpu --tiny``): the GPU benchmark's pipeline end to end
(FSDP2 on one device, bf16-mixed, packed SFT and shared-prompt DPO rows, the FLOP count behind
MFU). No timing is asserted: only that the rows ran the promised configuration."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


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

# The pipeline end to end on CPU (benchmarks/gpu.py --device cpu --tiny): its `speed` part in
# tests/perf/test_gpu_check.py, the GPU check's dry run, which runs it once for both.


def test_flops_counted_on_warmup_steps_scale_by_tokens(monkeypatch) -> None:
    """On CUDA (ROLEMRC_BENCH_FLOP_STEPS=<warm-up>) FlopCounterMode runs on the warm-up steps only:
    the timed steps' FLOPs are their tokens x the counted FLOPs per token; unset, each step's own."""
    import common

    def steps(flops: list[float]) -> "common._Steps":
        s = common._Steps()
        for tokens, f in zip([100.0, 300.0, 200.0, 400.0], flops):
            s.add(tokens, 1.0, tokens, flops=f)
        return s

    every = steps([1e6, 3e6, 2.2e6, 4.4e6]).summary(warmup=2)
    assert every["flops"] == 6.6e6 and every["flops_counted_on"] == "every timed step"
    monkeypatch.setattr(common, "FLOP_STEPS", 2)
    warm = steps([1e6, 3e6, 0.0, 0.0]).summary(warmup=2)  # 4e6 FLOPs over 400 tokens counted
    assert warm["step_flops"] == [2e6, 4e6] and warm["flops"] == 6e6
    assert warm["flops_counted_on"] == "the first 2 (warm-up) steps, per token"
