"""Side by side, in one run (``make bench``): rolemrc against TRL and against the paper's
pad-to-max-length recipe, on the same machine, model and synthetic RoleMRC-shaped data.

    make bench                                   # = .venv/bin/python benchmarks/run_all.py
    .venv/bin/python benchmarks/run_all.py --skip-memory --steps 3   # longer timing, no memory part

(a) SFT non-padding tokens/s: ours (data.packing=true) vs TRL SFTTrainer (defaults) vs rolemrc with
    every row padded to max_length 4200 (paper);
(b) DPO pairs/s at equal batch composition: ours (objective.share_prompt=true) vs TRL DPOTrainer
    (defaults), plus ours with separate chosen/rejected rows;
(c) peak memory of sequence log-probs at a 128k vocabulary: chunked (ours) vs full logits
    (benchmarks/logprob_memory.py, fp32, H=4096, 2048 tokens).

The model is a random-init Llama (vocab 128256, hidden 512, 4 layers, GQA 8/2 heads: ~11M
non-embedding parameters, so on 2 CPU cores a run fits in ~15 minutes while the decoder, not the
head, dominates compute). Prompts are 1,000-2,000 tokens, replies 50-80. Each contender runs in
its own process, one after the other, with the same allocator settings (MALLOC_*, stack.md) and
bf16 mixed precision; steps after ``--warmup`` are timed. The machine's load average is recorded
around every contender: other processes on a shared machine slow everyone down unevenly, so
compare ratios from one run, not across runs.

Writes ``benchmarks/results/bench.json`` (every figure, the exact commands, versions, loads) and
prints the table with the ratios against the issue's targets.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import MALLOC_ENV, ROOT, Spec, prepare  # noqa: E402

TARGETS = {"sft_vs_trl": 1.5, "sft_vs_pad_max": 3.0, "dpo_vs_trl": 1.5, "logprob_memory": 0.3}
PLAN = [("sft", "ours"), ("sft", "pad_max"), ("sft", "trl"), ("dpo", "ours"), ("dpo", "ours_separate"), ("dpo", "trl")]
# --with-trl-no-gc: TRL without its gradient-checkpointing default (+~7 minutes here).
EXTRA = [("sft", "trl_no_gc"), ("dpo", "trl_no_gc")]


def run_contender(kind: str, contender: str, work: Path, log_dir: Path) -> dict:
    script = HERE / f"{kind}_throughput.py"
    out = work / "results" / f"{kind}_{contender}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(script), "--work", str(work), "--contender", contender, "--out", str(out)]
    env = {**os.environ, **MALLOC_ENV, "PYTHONPATH": str(ROOT / "src")}
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    log_file = log_dir / f"{kind}_{contender}.log"
    with log_file.open("w") as fh:
        proc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not out.exists():
        tail = log_file.read_text()[-2000:]
        print(f"  {kind}/{contender} FAILED (exit {proc.returncode}); log {log_file}\n{tail}", flush=True)
        return {"contender": contender, "error": f"exit {proc.returncode}", "log": str(log_file)}
    result = json.loads(out.read_text())
    result["wall_s"] = round(wall, 1)
    result["load_avg_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    rate = result.get("tokens_per_s") if kind == "sft" else result.get("pairs_per_s")
    print(f"  {kind}/{contender}: {rate:.4g} {'tokens/s' if kind == 'sft' else 'pairs/s'} "
          f"(steps {result['step_seconds']} s, wall {wall:.0f} s, load {result['load_avg_1min']})", flush=True)
    return result


def run_memory(work: Path, log_dir: Path, args: argparse.Namespace) -> dict:
    out = work / "results" / "logprob_memory.json"
    cmd = [sys.executable, str(HERE / "logprob_memory.py"), "--hidden", str(args.memory_hidden),
           "--tokens", str(args.memory_tokens), "--dtypes", args.memory_dtypes, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    start = time.perf_counter()
    with (log_dir / "logprob_memory.log").open("w") as fh:
        proc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
    if proc.returncode != 0:
        print(f"  logprob memory FAILED; log {log_dir / 'logprob_memory.log'}", flush=True)
        return {"error": f"exit {proc.returncode}"}
    result = json.loads(out.read_text())
    result["command"] = "python " + " ".join(["benchmarks/logprob_memory.py", *cmd[2:]])
    result["wall_s"] = round(time.perf_counter() - start, 1)
    print(f"  logprob memory: {result['ratios_ours_over_full']} ({result['wall_s']:.0f} s)", flush=True)
    return result


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def versions() -> dict[str, str]:
    import importlib.metadata as md

    return {p: md.version(p) for p in ("torch", "transformers", "trl", "lightning", "rolemrc")}


def report(results: dict, spec: Spec) -> str:
    sft, dpo, mem = results["sft"], results["dpo"], results.get("logprob_memory", {})
    lines = []

    def verdict(value: float | None, target: float, higher: bool = True) -> str:
        if value is None:
            return "n/a"
        ok = value >= target if higher else value <= target
        return f"{value:.2f}x ({'meets' if ok else 'BELOW'} target {'>=' if higher else '<='} {target}x)"

    def contender_lines(table: dict, names: tuple[str, ...], describe: Callable[[dict], str]) -> None:
        for name in names:
            r = table.get(name, {})
            if not r and name == "trl_no_gc":
                continue  # an optional peer (--with-trl-no-gc)
            lines.append(f"  {name:14s} {describe(r) if r and 'error' not in r else 'FAILED' if r else 'not run'}")

    lines.append(f"SFT, non-padding tokens/s ({spec.sft_batch} conversations a step, bf16-mixed, max_length "
                 f"{spec.sft_max_length}):")
    contender_lines(sft, ("ours", "pad_max", "trl", "trl_no_gc"),
                    lambda r: f"{r['tokens_per_s']:9.1f} tokens/s  {r['samples_per_s']:.3f} conv/s  "
                              f"padding {r['padding_fraction']:.0%}  steps {r['step_seconds']} s")
    lines.append(f"  ours / trl     = {verdict(results['ratios']['sft_vs_trl'], TARGETS['sft_vs_trl'])}")
    lines.append(f"  ours / pad_max = {verdict(results['ratios']['sft_vs_pad_max'], TARGETS['sft_vs_pad_max'])}")
    if results["ratios"].get("sft_vs_trl_no_gc"):
        lines.append(f"  ours / trl_no_gc = {results['ratios']['sft_vs_trl_no_gc']:.2f}x (TRL without gradient checkpointing)")
    lines.append(f"DPO, pairs/s ({spec.dpo_batch} pairs a step, copy reference, bf16-mixed, max_length "
                 f"{spec.dpo_max_length}):")
    contender_lines(dpo, ("ours", "ours_separate", "trl", "trl_no_gc"),
                    lambda r: f"{r['pairs_per_s']:9.4f} pairs/s   {r['tokens_per_s']:.1f} tokens/s  "
                              f"steps {r['step_seconds']} s")
    lines.append(f"  ours / trl     = {verdict(results['ratios']['dpo_vs_trl'], TARGETS['dpo_vs_trl'])}")
    if results["ratios"].get("dpo_vs_trl_no_gc"):
        lines.append(f"  ours / trl_no_gc = {results['ratios']['dpo_vs_trl_no_gc']:.2f}x (TRL without gradient checkpointing)")
    if results["ratios"].get("dpo_shared_vs_separate"):
        lines.append(f"  ours / ours_separate = {results['ratios']['dpo_shared_vs_separate']:.2f}x (prompt sharing alone)")
    if mem and "error" not in mem:
        lines.append(f"Log-prob peak memory, forward + backward (V={mem['vocab']}, H={mem['hidden']}, "
                     f"N={mem['tokens']}; ours / full logits):")
        for case, r in mem["ratios_ours_over_full"].items():
            note = " (both must hold the [V, H] weight gradient)" if "trained" in case else ""
            lines.append(f"  {case:21s} peak {verdict(r['peak'], TARGETS['logprob_memory'], higher=False)}, "
                         f"net of output gradients {r['transient']:.3f}x{note}")
    lines.append("Commands (work dir prepared by run_all.py):")
    for part in (sft, dpo):
        for r in part.values():
            if "command" in r:
                lines.append(f"  {r['command']}")
    if mem.get("command"):
        lines.append(f"  {mem['command']}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "rolemrc-bench")
    p.add_argument("--out", type=Path, default=HERE / "results" / "bench.json")
    p.add_argument("--steps", type=int, default=2, help="timed steps per contender")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--only", default="", help="comma list like sft/ours,dpo/trl (default: all)")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--with-trl-no-gc", action="store_true", help="also TRL with gradient_checkpointing=False")
    p.add_argument("--memory-hidden", type=int, default=4096)
    p.add_argument("--memory-tokens", type=int, default=2048)
    p.add_argument("--memory-dtypes", default="fp32")
    args = p.parse_args()

    spec = Spec(steps=args.steps, warmup=args.warmup)
    started = time.time()
    print(f"preparing model and data in {args.work} ...", flush=True)
    data_stats = prepare(args.work, spec)
    log_dir = args.work / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    results: dict = {"sft": {}, "dpo": {}}
    for kind, contender in PLAN + (EXTRA if args.with_trl_no_gc else []):
        if only and f"{kind}/{contender}" not in only:
            continue
        results[kind][contender] = run_contender(kind, contender, args.work, log_dir)
    if not args.skip_memory and (not only or "memory" in only):
        results["logprob_memory"] = run_memory(args.work, log_dir, args)

    sft, dpo = results["sft"], results["dpo"]
    tok = {k: v.get("tokens_per_s") for k, v in sft.items()}
    pairs = {k: v.get("pairs_per_s") for k, v in dpo.items()}
    results["ratios"] = {
        "sft_vs_trl": ratio(tok.get("ours"), tok.get("trl")),
        "sft_vs_pad_max": ratio(tok.get("ours"), tok.get("pad_max")),
        "dpo_vs_trl": ratio(pairs.get("ours"), pairs.get("trl")),
        "dpo_shared_vs_separate": ratio(pairs.get("ours"), pairs.get("ours_separate")),
        "sft_vs_trl_no_gc": ratio(tok.get("ours"), tok.get("trl_no_gc")),
        "dpo_vs_trl_no_gc": ratio(pairs.get("ours"), pairs.get("trl_no_gc")),
    }
    mem = results.get("logprob_memory", {})
    if mem and "error" not in mem:
        results["ratios"]["logprob_memory_peak"] = {k: v["peak"] for k, v in mem["ratios_ours_over_full"].items()}
    results.update({
        "targets": TARGETS,
        "spec": {k: v for k, v in spec.__dict__.items()},
        "data": data_stats,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "allocator_env": MALLOC_ENV,
                    "versions": versions()},
        "command": "python benchmarks/run_all.py " + " ".join(sys.argv[1:]),
        "total_minutes": round((time.time() - started) / 60, 1),
    })
    table = report(results, spec)
    results["table"] = table.splitlines()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print()
    print(table)
    print(f"\nwrote {args.out} ({results['total_minutes']} min)")


if __name__ == "__main__":
    main()
