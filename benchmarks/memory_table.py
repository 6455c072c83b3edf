"""The README's memory table: the four paper recipes on 4 and 8 x 80 GB devices, simulated
(``python -m rolemrc.memory <recipe> trainer.devices=N --simulate --json``, see rolemrc.sizing.simulate).

    .venv/bin/python benchmarks/memory_table.py                       # all 8 rows (~1-2 CPU-minutes per simulation)
    .venv/bin/python benchmarks/memory_table.py --recipes rolemrc_llama_sft --devices 4

Per row: the per-rank peak at the recipe's micro-batch with and without activation checkpointing
(one ``--simulate`` command each), and the largest micro-batch (``data.batch_size``) whose peak
with checkpointing fits 90% of the device, on the line through two simulated peaks: the recipe's
micro-batch and its double (simulated once per recipe, on the first device count: what a row
adds, activations, is the same on any number of ranks). The line can be optimistic: where the
recipe's micro-batch peaks late in the step (gradients, optimizer; DPO on 4 ranks) and larger ones
peak early (activations), the two points straddle the phases and the slope comes out too low.
``--verify`` therefore simulates the predicted size and walks from it, one row (DPO: pair) at a
time, to the largest size that fits with the next one not fitting, and reports that size
(``largest_batch_size_on``, the line's in ``predicted_batch_size_on``). ``--reuse`` takes a row's
peaks with and without checkpointing (and its simulations) from ``--out`` instead of simulating
them again (the simulation is deterministic). Every simulation is one command, printed with its
result; results go to ``benchmarks/results/memory_table.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("rolemrc_llama_sft", "rolemrc_llama_dpo", "rolemrc_qwen_sft", "rolemrc_qwen_dpo")
GIB = 1024**3


def simulate(recipe: str, devices: int, checkpointing: bool, batch_size: int | None, log: list[dict]) -> dict:
    args = [f"experiment={recipe}", f"trainer.devices={devices}", f"model.gradient_checkpointing={str(checkpointing).lower()}"]
    if batch_size is not None:
        args.append(f"data.batch_size={batch_size}")
    cmd = [sys.executable, "-m", "rolemrc.memory", *args, "--simulate", "--json"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    entry = {"command": "python -m rolemrc.memory " + " ".join(args) + " --simulate --json",
             "peak_gib": result["peak_gib"], "fits": result["fits"], "seconds": round(time.perf_counter() - start, 1),
             "micro_batch": result["micro_batch"], "by_category": result["by_category"]}
    log.append(entry)
    print(f"  {entry['command']}: {entry['peak_gib']:.1f} GiB, fits {entry['fits']} ({entry['seconds']:.0f} s)", flush=True)
    return result


def largest_batch(limit_gib: float, base: int, peak: float, per_row: float) -> int:
    """The largest ``data.batch_size`` whose peak fits ``limit_gib``, on the line through the
    simulated peaks (``peak`` at ``base``, ``per_row`` more per row of the micro-batch)."""
    return base + int((limit_gib - peak) // per_row)


def verified_largest(recipe: str, devices: int, start: int, log: list[dict]) -> int:
    """The largest ``data.batch_size`` whose simulated peak (checkpointing on) fits, with the next
    size not fitting, walking one at a time from ``start`` (0: not even one fits)."""
    size = start
    if simulate(recipe, devices, True, size, log)["fits"]:
        while simulate(recipe, devices, True, size + 1, log)["fits"]:
            size += 1
        return size
    while size > 1:
        size -= 1
        if simulate(recipe, devices, True, size, log)["fits"]:
            return size
    return 0


def _known_per_row(recipe: str, paths: list[Path]) -> float | None:
    """What a row adds for ``recipe``, from a results file that has it (read now: another process
    may have written it meanwhile)."""
    for path in paths:
        if path.exists():
            for r in json.loads(path.read_text()).values():
                if r["recipe"] == recipe:
                    return r["per_row_gib"]
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--devices", default="4,8")
    p.add_argument("--verify", action="store_true",
                   help="also simulate the predicted largest micro-batch and walk to the largest that fits "
                        "(2 or more simulations a row)")
    p.add_argument("--reuse", action="store_true",
                   help="take the peaks with and without checkpointing of rows already in --out")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "memory_table.json")
    p.add_argument("--table", nargs="*", type=Path, help="only print the table of these result files")
    p.add_argument("--per-row-from", nargs="*", type=Path, default=[],
                   help="result files whose rows (same recipe) already give what a row adds")
    args = p.parse_args()
    if args.table is not None:
        merged: dict = {}
        for path in args.table or [args.out]:
            merged.update(json.loads(path.read_text()))
        print(table(merged))
        return
    rows = json.loads(args.out.read_text()) if args.out.exists() else {}
    for recipe in args.recipes.split(","):
        # What a row adds, from an earlier run of this recipe in the results file, if there is one.
        per_row = None
        for devices in (int(d) for d in args.devices.split(",")):
            key = f"{recipe}/{devices}"
            print(f"[{key}]", flush=True)
            old = rows.get(key) if args.reuse else None
            if old is not None:
                log = list(old.get("simulations", []))
                rows_per = 2 if "dpo" in recipe else 1  # a DPO pair is two rows
                on = {"peak_gib": old["on_gib"], "micro_batch": {"rows": old["batch_size"] * rows_per, "tokens": old["tokens"]}}
                off = {"peak_gib": old["off_gib"]}
                limit = old["limit_gib"]
                print(f"  reused from {args.out}: ckpt on {on['peak_gib']:.1f} GiB, off {off['peak_gib']:.1f} GiB", flush=True)
            else:
                log = []
                on = simulate(recipe, devices, True, None, log)
                off = simulate(recipe, devices, False, None, log)
                limit = on["headroom"] * on["device_memory_gb"]
            base = on["micro_batch"]["rows"] // (2 if "dpo" in recipe else 1)
            per_row = per_row or _known_per_row(recipe, [args.out, *args.per_row_from])
            if per_row is None:  # what one more row of the micro-batch adds (the same on any number of ranks)
                double = simulate(recipe, devices, True, 2 * base, log)
                per_row = (double["peak_gib"] - on["peak_gib"]) / base
            best = largest_batch(limit, base, on["peak_gib"], per_row)
            row = {"recipe": recipe, "devices": devices, "batch_size": base, "rows": on["micro_batch"]["rows"],
                   "tokens": on["micro_batch"]["tokens"], "on_gib": on["peak_gib"], "off_gib": off["peak_gib"],
                   "per_row_gib": round(per_row, 4), "predicted_batch_size_on": best, "largest_batch_size_on": best,
                   "verified": False, "limit_gib": limit, "simulations": log}
            if args.verify:
                row["largest_batch_size_on"] = verified_largest(recipe, devices, max(best, 1), log)
                row["verified"] = True
            if old is not None and "note" in old:
                row["note"] = old["note"]
            rows[key] = row
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print(table(rows))


def table(rows: dict) -> str:
    order = {f"{r}/{d}": i for i, (r, d) in enumerate((r, d) for r in RECIPES for d in (4, 8))}
    rows = dict(sorted(rows.items(), key=lambda kv: order.get(kv[0], len(order))))
    lines = ["| recipe | GPUs | micro-batch | peak GiB/rank, ckpt on | ckpt off | largest micro-batch (ckpt on) |",
             "|---|---|---|---|---|---|"]  # largest: on the line through two simulated peaks (* also simulated)
    for r in rows.values():
        unit = "pairs" if "dpo" in r["recipe"] else "rows"
        lines.append(f"| {r['recipe']} | {r['devices']} x 80 GB | {r['batch_size']} {unit} ({r['tokens']} tokens) | "
                     f"{r['on_gib']:.1f} | {r['off_gib']:.1f} | {r['largest_batch_size_on']}{'*' if r['verified'] else ''} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
