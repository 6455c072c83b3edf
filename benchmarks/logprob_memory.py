"""Peak memory of chunked log-probs (rolemrc.objectives) vs full logits, forward + backward.

Run:  .venv/bin/python benchmarks/logprob_memory.py                 # V=128256, H=4096, N=2048
      .venv/bin/python benchmarks/logprob_memory.py --hidden 512 --tokens 512   # quick look
      # a RoleMRC-shaped row: 8192 tokens of which the last 6% (the reply) carry labels
      .venv/bin/python benchmarks/logprob_memory.py --tokens 8192 --supervised 0.06 --dtypes fp32 \
          --heads trained --out benchmarks/results/logprob_memory_rolemrc_row.json

Every (dtype, lm_head trainable?, implementation) case runs in its own subprocess so each
measurement starts clean. On CUDA the peak is ``torch.cuda.max_memory_allocated`` above the
allocation after the inputs are built. On CPU it is the kernel's resident high-water mark
(``VmHWM``), reset with ``/proc/self/clear_refs`` once the inputs are built, minus the RSS at that
point; the child runs with ``MALLOC_MMAP_THRESHOLD_=65536`` (and without the Makefile's
keep-freed-memory settings) so large freed buffers leave RSS at once and the high-water mark
tracks live memory.

"full logits" is what a Hugging Face forward + trainer does: ``F.linear(hidden, weight)`` in the
model dtype, ``.float()``, ``log_softmax``, gather. Both implementations must also produce the
gradient buffers of hidden (and of the lm_head weight when it trains), so the JSON reports the
raw peak and the peak net of those unavoidable output gradients ("transient").
Results: printed, and written to ``benchmarks/results/logprob_memory.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "logprob_memory.json"
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(args: argparse.Namespace) -> dict:
    """One measurement: build inputs, reset the peak, run forward + backward, report."""
    import torch
    import torch.nn.functional as F

    from rolemrc.objectives import token_logprobs

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, DTYPES[args.dtype])
    gen = torch.Generator(device=device).manual_seed(0)
    n, h, v = args.tokens, args.hidden, args.vocab
    hidden = torch.randn(1, n, h, device=device, dtype=dtype, generator=gen).requires_grad_()
    weight = (torch.randn(v, h, device=device, dtype=dtype, generator=gen) * h**-0.5)
    weight.requires_grad_(args.train_weight)
    labels = torch.randint(0, v, (1, n), device=device, generator=gen)
    # RoleMRC-shaped rows: a long prompt, then the supervised reply (the last fraction of tokens).
    labels[:, : n - max(1, round(n * args.supervised))] = -100
    gc.collect()

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        base = _rss_bytes("VmRSS")

    start = time.perf_counter()
    if args.impl == "ours":
        logps, _ = token_logprobs(
            hidden, weight, labels, args.chunk_size, vocab_chunk_size=args.vocab_chunk_size
        )
    else:  # what a Hugging Face forward + trainer does: logits for every position, then the mask
        logits = F.linear(hidden, weight).float()
        mask = labels != -100
        logps = logits.log_softmax(-1).gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)[mask]
        del logits
    loss = -logps.mean()
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _rss_bytes("VmHWM") - base
    seconds = time.perf_counter() - start

    elem = hidden.element_size()
    grad_bytes = hidden.numel() * elem + (weight.numel() * elem if args.train_weight else 0)
    return {
        "impl": args.impl,
        "dtype": args.dtype,
        "train_weight": args.train_weight,
        "device": str(device),
        "peak_bytes": int(peak),
        "output_grad_bytes": int(grad_bytes),
        "transient_bytes": int(peak - grad_bytes),
        "seconds": round(seconds, 2),
        "loss": float(loss),
    }


def run_child(args: argparse.Namespace, impl: str, dtype: str, train_weight: bool) -> dict:
    env = {k: val for k, val in os.environ.items() if not k.startswith("MALLOC_")}
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    cmd = [
        sys.executable, __file__, "--child",
        "--impl", impl, "--dtype", dtype,
        "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--tokens", str(args.tokens),
        "--chunk-size", str(args.chunk_size), "--vocab-chunk-size", str(args.vocab_chunk_size),
        "--supervised", str(args.supervised),
    ] + (["--train-weight"] if train_weight else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--vocab-chunk-size", type=int, default=8192)
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--heads", default="frozen,trained", help="lm_head cases to run: frozen, trained or both")
    p.add_argument("--supervised", type=float, default=1.0,
                   help="fraction of the N tokens that carry a label (the rest is prompt); 1 = all")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=["ours", "full"], help=argparse.SUPPRESS)
    p.add_argument("--dtype", choices=list(DTYPES), help=argparse.SUPPRESS)
    p.add_argument("--train-weight", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.child:
        print(json.dumps(child(args)))
        return

    gib = 1024**3
    rows, ratios = [], {}
    print(
        f"V={args.vocab} H={args.hidden} N={args.tokens} supervised={args.supervised:g} "
        f"tiles={args.chunk_size}x{args.vocab_chunk_size}"
    )
    for dtype in args.dtypes.split(","):
        for train_weight in [h == "trained" for h in args.heads.split(",")]:
            case = f"{dtype}/{'lm_head trained' if train_weight else 'lm_head frozen'}"
            full = run_child(args, "full", dtype, train_weight)
            ours = run_child(args, "ours", dtype, train_weight)
            rows += [full, ours]
            ratios[case] = {
                "peak": round(ours["peak_bytes"] / full["peak_bytes"], 3),
                "transient": round(ours["transient_bytes"] / full["transient_bytes"], 3),
            }
            cols = [
                f"{name} {r['peak_bytes'] / gib:5.2f} GiB "
                f"({r['transient_bytes'] / gib:4.2f} transient, {r['seconds']:5.1f} s)"
                for name, r in (("full", full), ("ours", ours))
            ]
            print(
                f"{case:21s} {cols[0]} | {cols[1]} | ratio peak {ratios[case]['peak']:.3f}, "
                f"transient {ratios[case]['transient']:.3f}"
            )
            # Same numbers, or the memory comparison means nothing.
            assert abs(full["loss"] - ours["loss"]) < 1e-3 * max(1.0, abs(full["loss"])), (full, ours)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "command": "python " + " ".join([Path(__file__).name] + sys.argv[1:]),
        "vocab": args.vocab,
        "hidden": args.hidden,
        "tokens": args.tokens,
        "supervised_fraction": args.supervised,
        "chunk_size": args.chunk_size,
        "vocab_chunk_size": args.vocab_chunk_size,
        "machine": f"{platform.machine()} {os.cpu_count()} cpu",
        "measure": (
            "torch.cuda.max_memory_allocated - allocated after inputs"
            if rows[0]["device"] == "cuda"
            else "VmHWM - VmRSS after inputs (clear_refs reset), own subprocess per case"
        ),
        "ratios_ours_over_full": ratios,
        "runs": rows,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
