"""GPU benchmark (``make bench-gpu``): one CUDA device, a 1-3B Llama-shaped model built from its
config (random init, no hub access), bf16-mixed with fp32 master weights, FSDP2 on one device
(``strategy=fsdp``: Lightning's ModelParallelStrategy + ``fully_shard``), packed SFT rows and
shared-prompt DPO, on synthetic RoleMRC-shaped data (prompts 800-1,800 tokens, replies 40-80).

    python benchmarks/gpu.py                         # Llama-3.2-1B layer shapes (1.5B with the untied 128k head)
    python benchmarks/gpu.py --size llama_3b --sft-rows 1
    python benchmarks/gpu.py --device cpu --tiny     # smoke: tiny model on CPU, checks the pipeline only

Prints and writes (``benchmarks/results/gpu.json``; ``--tiny``: ``<work>/gpu.json``) per row:
non-padding tokens/s, pairs/s (DPO), MFU and peak memory (``torch.cuda.max_memory_allocated``;
peak RSS on CPU). MFU = model FLOPs on non-padding tokens / time / the device's dense bf16 peak
(rolemrc.callbacks.throughput.peak_flops): ``6 x`` the non-embedding parameters (lm_head included)
per policy input token plus ``12 x layers x attention width`` per causal (query, key) pair inside
each sequence (packed rows are credited with their per-conversation attention only). The DPO
reference forward is not counted, so DPO MFU understates the device's work. Beside it, "executed"
TFLOP/s: what FlopCounterMode counted the device doing (recomputation, the reference forward, the
attention kernels' formulas), over the same time; on CUDA counted on the warm-up steps only (per
token, so the timed steps run without the counter's per-op overhead). TRL rows (SFTTrainer
without checkpointing; DPOTrainer with precompute_ref_log_probs, without checkpointing; both bf16)
run when ``trl`` and ``datasets`` are installed and are skipped, saying so, when not.

Needs only torch, transformers, lightning, peft and rolemrc with hydra-core + omegaconf (pure
Python; on a machine without a package index, bring them as wheels: make gpu-wheels,
docs/benchmarks/gpu.md). Every row runs in its own process, one after the other.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import MODEL_LABELS, ROOT, Spec, prepare  # noqa: E402
from run_all import run_contender  # noqa: E402

if importlib.util.find_spec("rolemrc") is None:  # a checkout that was not pip-installed (GPU nodes)
    sys.path.insert(0, str(ROOT / "src"))

TINY = {"vocab": 4096, "hidden": 64, "layers": 2, "intermediate": 128, "heads": 4, "kv_heads": 2, "n_sft": 12,
        "n_pairs": 6, "prompt_tokens": (100, 200), "reply_tokens": (10, 20), "sft_max_length": 600,
        "dpo_max_length": 400, "dpo_max_prompt_length": 300}


def flop_parameters(spec: Spec) -> int:
    """Parameters every input token multiplies through: all but the input embedding (lm_head included)."""
    body = spec.layers * (2 * spec.hidden * spec.hidden  # q, o
                          + 2 * spec.hidden * (spec.hidden // spec.heads) * spec.kv_heads  # k, v
                          + 3 * spec.hidden * spec.intermediate  # gate, up, down
                          + 2 * spec.hidden)  # the two RMSNorm weights
    return body + spec.hidden + spec.vocab * spec.hidden  # final norm + lm_head


def model_flops(result: dict, spec: Spec) -> float:
    """Training FLOPs of the measured steps (see the module docstring)."""
    return (6.0 * flop_parameters(spec) * result["tokens"]
            + 12.0 * spec.layers * spec.hidden * result.get("attended_pairs", 0.0))


def peak_flops(device_name: str | None) -> float | None:
    if not device_name:
        return None
    from rolemrc.callbacks.throughput import peak_flops as peak

    return peak(device_name, "bf16-mixed")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny model and rows (CPU smoke test: figures mean nothing)")
    p.add_argument("--size", choices=["llama_1b", "llama_3b"], default="llama_1b")
    p.add_argument("--sft-rows", type=int, default=2, help="packed rows of 4,200 tokens per SFT step")
    p.add_argument("--dpo-pairs", type=int, default=4, help="preference pairs per DPO step")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--gradient-checkpointing", action="store_true", help="ours: model.gradient_checkpointing=true")
    p.add_argument("--no-trl", action="store_true", help="skip the TRL rows even where TRL is installed")
    p.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "rolemrc-bench-gpu")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py: --device cuda but torch sees no CUDA device "
                         "(use --device cpu --tiny for the CPU smoke run)")
    if args.device == "cpu" and not args.tiny:
        raise SystemExit("benchmarks/gpu.py: --device cpu runs only with --tiny (a 1-3B model on CPU would take hours)")
    accelerator = "gpu" if args.device == "cuda" else "cpu"
    overrides = ["strategy=fsdp", f"trainer.accelerator={accelerator}", "trainer.devices=1",
                 "model.dtype=bfloat16",  # frozen reference copy in bf16; trained weights stay fp32 masters
                 f"model.attn_implementation={'auto' if args.device == 'cuda' else 'sdpa'}",
                 f"model.gradient_checkpointing={str(args.gradient_checkpointing).lower()}"]
    spec = Spec.for_model(args.size, precision="bf16", steps=args.steps, warmup=args.warmup,
                          dpo_batch=args.dpo_pairs, ours_overrides=overrides)
    if args.tiny:
        spec.__dict__.update(TINY)
    # conversations per SFT step for TRL's padded batches: about what our packed rows hold (~2.9 each)
    spec.sft_batch = max(1, round(args.sft_rows * 2.9)) if not args.tiny else 2 * args.sft_rows
    work = args.work / ("tiny" if args.tiny else args.size)
    out = args.out or (work / "gpu.json" if args.tiny else HERE / "results" / "gpu.json")
    started = time.time()
    print(f"preparing {'a tiny Llama' if args.tiny else MODEL_LABELS[args.size]} and data in {work} ...", flush=True)
    data = prepare(work, spec)
    log_dir = work / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    has_trl = all(importlib.util.find_spec(m) is not None for m in ("trl", "datasets"))
    plan = [("sft", "ours"), ("dpo", "ours")]
    trl_note = None
    if args.no_trl:
        trl_note = "TRL rows skipped (--no-trl)"
    elif not has_trl:
        trl_note = "TRL rows skipped: trl and datasets are not installed here"
    else:
        plan += [("sft", "trl_no_gc"), ("dpo", "trl_pre_no_gc")]
    if args.device == "cuda":  # FlopCounterMode on the warm-up steps only: the timed steps run without it
        os.environ["ROLEMRC_BENCH_FLOP_STEPS"] = str(args.warmup)
    rows: dict[str, dict] = {}
    for kind, name in plan:
        r = run_contender(kind, name, work, log_dir, "gpu")
        if "error" not in r:
            flops = model_flops(r, spec)
            peak = peak_flops(r.get("device_name"))
            r["model_tflops_per_s"] = round(flops / r["seconds"] / 1e12, 3)
            r["mfu"] = round(flops / r["seconds"] / peak, 4) if peak else None
            # FLOP/s the device executed (FlopCounterMode: recomputation, the reference forward and
            # full-row attention count; skipped work does not), beside the model FLOPs' rate
            r["executed_tflops_per_s"] = round(r["flop_per_s"] / 1e12, 3) if "flop_per_s" in r else None
        rows[f"{kind}/{name}"] = r
        lines = write_results(out, rows, plan, args, spec, data, trl_note, started)  # after each row: a cut run keeps them
    print("\n" + "\n".join(lines) + f"\nwrote {out}")
    if any("error" in r for r in rows.values() if r):
        failed = [k for k, r in rows.items() if "error" in r]
        if any(k.endswith("/ours") for k in failed):
            raise SystemExit(f"benchmarks/gpu.py: rolemrc rows failed: {', '.join(failed)}")


def write_results(out: Path, rows: dict[str, dict], plan: list[tuple[str, str]], args: argparse.Namespace, spec: Spec,
                  data: dict, trl_note: str | None, started: float) -> list[str]:
    """The table and ``out`` (JSON) for the rows run so far."""
    label = "tiny Llama [--tiny: figures mean nothing]" if args.tiny else MODEL_LABELS[args.size]
    lines = [f"{label}; "
             f"{data['model']['parameters'] / 1e9:.2f}B parameters; bf16-mixed, fp32 masters, FSDP2 on 1 device; "
             f"{args.steps} timed steps after {args.warmup}",
             f"  {'row':18s} {'tokens/s':>9s} {'pairs/s':>8s} {'MFU':>6s} {'TFLOP/s':>8s} {'executed':>8s} {'peak mem':>10s}"]
    for key, r in rows.items():
        if "error" in r:
            lines.append(f"  {key:18s} FAILED ({r['error']}; log {r.get('log')})")
            continue
        mem = f"{r['peak_cuda_mib'] / 1024:.1f} GiB" if "peak_cuda_mib" in r else f"{r['peak_rss_mib'] / 1024:.1f} GiB RSS"
        pairs = f"{r['pairs_per_s']:8.3f}" if "pairs_per_s" in r else f"{'':8s}"
        mfu = f"{r['mfu']:6.1%}" if r.get("mfu") is not None else f"{'n/a':>6s}"
        executed = f"{r['executed_tflops_per_s']:8.2f}" if r.get("executed_tflops_per_s") is not None else f"{'n/a':>8s}"
        lines.append(f"  {key:18s} {r['tokens_per_s']:9.0f} {pairs} {mfu} {r['model_tflops_per_s']:8.2f} {executed} {mem:>10s}")
    if trl_note:
        lines.append(f"  {trl_note}")
    device = next((r.get("device_name") for r in rows.values() if r.get("device_name")), args.device)
    lines.append(f"device: {device}; command: python benchmarks/gpu.py {' '.join(sys.argv[1:])}")
    result = {"rows": rows, "planned": [f"{k}/{n}" for k, n in plan], "spec": dict(spec.__dict__), "data": data, "trl": trl_note or "run", "table": lines,
              "command": "python benchmarks/gpu.py " + " ".join(sys.argv[1:]), "device": device,
              "versions": {m: _version(m) for m in ("torch", "transformers", "lightning", "trl", "rolemrc")},
              "total_minutes": round((time.time() - started) / 60, 1)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return lines


def _version(name: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
