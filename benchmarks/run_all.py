"""Side by side, in one run (``make bench``): rolemrc against TRL at its best configuration on this
machine, on the same model, data, tokenizer, precision, batch, max length, steps and warm-up.

    make bench                                          # = .venv/bin/python benchmarks/run_all.py
    .venv/bin/python benchmarks/run_all.py --models proxy --steps 6 --repeats 2   # longer, proxy only
    .venv/bin/python benchmarks/run_all.py --only sft/ours,sft/trl_no_gc          # a subset
    .venv/bin/python benchmarks/run_all.py --models proxy --more --steps 3 --prompt-tokens 300,600 --skip-memory \
        --only dpo/ours,dpo/ours_separate,dpo/trl_no_gc,simpo/ours,simpo/trl_no_gc,simpo/trl,orpo/ours,orpo/trl_no_gc,orpo/trl
        # the preference rows alone, shorter prompts (docs/benchmarks/speed.md)
    .venv/bin/python benchmarks/run_all.py --models proxy --only kto,reward,grpo,rloo --steps 2 --prompt-tokens 300,600 \
        --skip-memory   # KTO, the reward model, GRPO and RLOO alone (--completion-length: GRPO/RLOO's fixed length)

Models (benchmarks/common.py ``MODELS``):
- ``proxy`` (the headline): a random-init Llama with Llama-3.1-8B's FLOP shares at CPU size
  (vocab 4096, hidden 512, 8 layers, intermediate 1408, 8/2 heads): the output layer is ~8% of the
  weight FLOPs, as in the 8B model users train.
- ``head_heavy`` (second, labelled "output-layer-heavy"): vocab 128,256 and 4 layers, where the
  output layer is ~85% of the weight FLOPs; whoever computes it at every prompt position pays most.
  Only ours against the proxy's fastest TRL configurations runs on it.

Contenders, each in its own process with the same allocator settings (MALLOC_*, stack.md):
- SFT, non-padding tokens/s: ours (data.packing=true) vs TRL SFTTrainer defaults (gradient
  checkpointing on), without checkpointing, and with packing (padding-free BFD) without
  checkpointing (``--more`` adds TRL packing with checkpointing, padding-free without packing,
  and ours padded to 4200);
- DPO, pairs/s: ours (shared prompt; copy reference, and precomputed reference) vs TRL DPOTrainer
  without checkpointing, and with precompute_ref_log_probs and no checkpointing (``--more`` adds
  TRL's defaults, checkpointing on, and ours with separate chosen/rejected rows);
- SimPO and ORPO, pairs/s (proxy only): ours (``objective=simpo|orpo``) vs TRL's CPOTrainer
  (``loss_type=simpo``) / ORPOTrainer at their defaults (checkpointing on) and without
  checkpointing (their fastest setting), the loss settings equal to ours. Reference-free: the table
  sets their FLOPs per pair and peak RSS beside the DPO rows of the same run (the reference pass
  saved; against ``dpo/ours_separate`` where it ran, the same row layout as SimPO/ORPO);
- KTO and the reward model, pairs/s (proxy only): ours (``objective=kto|reward`` at its defaults) vs
  TRL's KTOTrainer / RewardTrainer at their defaults (checkpointing on) and without checkpointing
  (benchmarks/dpo_throughput.py);
- GRPO and RLOO, completions/s with the rollout in the step (proxy only): ours vs TRL's
  GRPOTrainer / RLOOTrainer at their defaults and without checkpointing, every completion exactly
  ``--completion-length`` tokens on both sides (benchmarks/rl_throughput.py);
- log-prob peak memory at a 128k vocabulary (benchmarks/logprob_memory.py);
- rollout throughput, single-turn against multi-turn with the scripted user, conversations/s and
  tokens/s on the tiny model (benchmarks/rollout_throughput.py; ``--only rollout`` alone).

Precision is fp32 by default: this CPU has no native bf16 matmul (2.2 vs 59.5 GFLOP/s), so bf16
timings would measure the emulation (``--precision bf16`` runs it anyway, both sides). Runs are
interleaved: each round runs every contender of a kind, alternating ours and TRL, and the next
round (``--repeats``) runs them in reverse order; each contender keeps its fastest round. Every
ratio is taken against the best TRL row of the same kind and model. The load average around each
run is recorded: on a shared machine compare ratios from one run, not across runs.

Writes ``benchmarks/results/bench.json`` (every figure, command, setting, version and load) and
prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import MALLOC_ENV, MODEL_LABELS, MODELS, ROOT, Spec, matmul_peak_gflops, prepare  # noqa: E402

TARGETS = {"sft_vs_best_trl": 1.3, "dpo_vs_best_trl": 2.5, "peak_rss_vs_best_trl": 1.0, "logprob_memory": 0.3}
# Interleaved: ours first, then TRL's rows (the reverse in the next round).
PLANS = {
    "proxy": {
        "sft": ["ours", "trl_no_gc", "trl_pack_no_gc", "trl"],
        "dpo": ["ours", "trl_no_gc", "ours_pre", "trl_pre_no_gc"],
        "simpo": ["ours", "trl_no_gc", "trl"],
        "orpo": ["ours", "trl_no_gc", "trl"],
        "kto": ["ours", "trl_no_gc", "trl"],
        "reward": ["ours", "trl_no_gc", "trl"],
        "grpo": ["ours", "trl_no_gc", "trl"],
        "rloo": ["ours", "trl_no_gc", "trl"],
    },
    "head_heavy": {"sft": ["ours", "trl_no_gc"], "dpo": ["ours", "trl_pre_no_gc"]},
}
# --more (proxy): slower TRL variants (checkpointing on, padding-free unpacked) and our ablations.
MORE = {"sft": ["pad_max", "trl_pack", "trl_padfree_no_gc"], "dpo": ["ours_separate", "trl"]}
SMOKE = {"hidden": 64, "layers": 1, "intermediate": 128, "heads": 4, "kv_heads": 2, "n_sft": 12, "n_pairs": 6,
         "prompt_tokens": (100, 200), "reply_tokens": (10, 20), "sft_max_length": 600, "dpo_max_length": 400,
         "dpo_max_prompt_length": 300, "completion_length": 4}
KINDS = ("sft", "dpo", "simpo", "orpo", "kto", "reward", "grpo", "rloo")
PAIR_KINDS = ("dpo", "simpo", "orpo", "kto", "reward")  # benchmarks/dpo_throughput.py --objective <kind>
RL_KINDS = ("grpo", "rloo")  # benchmarks/rl_throughput.py --objective <kind>
RATE = {"sft": ("tokens_per_s", "tokens/s"), **{k: ("pairs_per_s", "pairs/s") for k in PAIR_KINDS},
        **{k: ("completions_per_s", "completions/s") for k in RL_KINDS}}
WORK = {"sft": ("flops_per_token", "token"), **{k: ("flops_per_pair", "pair") for k in PAIR_KINDS},
        **{k: ("flops_per_completion", "completion") for k in RL_KINDS}}  # counted FLOPs per unit of RATE
TITLE = {"simpo": "SimPO (TRL: CPOTrainer loss_type=simpo)", "orpo": "ORPO (TRL: ORPOTrainer)",
         "kto": "KTO (TRL: KTOTrainer)", "reward": "Reward model (TRL: RewardTrainer)",
         "grpo": "GRPO (TRL: GRPOTrainer)", "rloo": "RLOO (TRL: RLOOTrainer)"}
# What a pair kind's step holds beyond the policy's rows (the table's header).
PAIR_NOTE = {"simpo": "reference-free: no reference pass", "orpo": "reference-free: no reference pass",
             "kto": "each pair a desirable and an undesirable example; KL rows and a reference copy on both sides",
             "reward": "one-logit sequence-classification head, no reference"}


def run_contender(kind: str, contender: str, work: Path, log_dir: Path, tag: str) -> dict:
    script = HERE / ("dpo_throughput.py" if kind in PAIR_KINDS else "rl_throughput.py" if kind in RL_KINDS
                     else f"{kind}_throughput.py")
    out = work / "results" / f"{kind}_{contender}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(script), "--work", str(work), "--contender", contender, "--out", str(out)]
    if kind in PAIR_KINDS or kind in RL_KINDS:
        cmd += ["--objective", kind]
    env = {**os.environ, **MALLOC_ENV, "PYTHONPATH": str(ROOT / "src")}
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    log_file = log_dir / f"{kind}_{contender}_{tag}.log"
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
    key, unit = RATE[kind]
    work, per = WORK[kind]
    print(f"  {kind}/{contender}: {result[key]:.4g} {unit}, {result[work] / 1e9:.4g} GFLOP/{per}, "
          f"{result['flop_per_s'] / 1e9:.1f} GFLOP/s, peak RSS {result['peak_rss_mib']:.0f} MiB "
          f"(steps {result['step_seconds']} s, wall {wall:.0f} s, load {result['load_avg_1min']})", flush=True)
    return result


def run_script(script: str, args: list[str], work: Path, log_dir: Path, what: str,
               env_extra: dict[str, str] | None = None) -> dict:
    """``benchmarks/<script>.py args --out <work>/results/<script>.json`` in its own process, its log in
    ``<log_dir>/<script>.log``: the JSON it writes with the command that made it and its wall time,
    or ``{"error": ...}`` when it fails."""
    out = work / "results" / f"{script}.json"
    cmd = [sys.executable, str(HERE / f"{script}.py"), *args, "--out", str(out)]
    env = {**os.environ, **(env_extra or {}), "PYTHONPATH": str(ROOT / "src")}
    log = log_dir / f"{script}.log"
    start = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
    if proc.returncode != 0:
        print(f"  {what} FAILED; log {log}", flush=True)
        return {"error": f"exit {proc.returncode}"}
    result = json.loads(out.read_text())
    result["command"] = "python " + " ".join([f"benchmarks/{script}.py", *cmd[2:]])
    result["wall_s"] = round(time.perf_counter() - start, 1)
    return result


def run_memory(work: Path, log_dir: Path, args: argparse.Namespace) -> dict:
    result = run_script("logprob_memory", ["--hidden", str(args.memory_hidden), "--tokens", str(args.memory_tokens),
                                           "--dtypes", args.memory_dtypes], work, log_dir, "logprob memory")
    if "error" not in result:
        print(f"  logprob memory: {result['ratios_ours_over_full']} ({result['wall_s']:.0f} s)", flush=True)
    return result


def run_rollout(work: Path, log_dir: Path, args: argparse.Namespace) -> dict:
    """benchmarks/rollout_throughput.py in its own process: single-turn against multi-turn rollouts."""
    extra = ["--generations", "1", "--reply-tokens", "4"] if args.smoke else []
    result = run_script("rollout_throughput", ["--repeats", str(args.rollout_repeats), *extra], work, log_dir,
                        "rollout throughput", MALLOC_ENV)
    if "error" not in result:
        print("  " + "\n  ".join(result["table"]), flush=True)
    return result


def interleave(names: list[str]) -> list[str]:
    """ours-rows and TRL-rows alternating, keeping each side's order."""
    ours = [n for n in names if not n.startswith("trl")]
    trl = [n for n in names if n.startswith("trl")]
    out: list[str] = []
    while ours or trl:
        if ours:
            out.append(ours.pop(0))
        if trl:
            out.append(trl.pop(0))
    return out


def keep_fastest(kind: str, runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    key = RATE[kind][0]
    best = dict(max(ok, key=lambda r: r[key]))
    best["rounds"] = [r[key] for r in ok]
    return best


def ratios(kind: str, table: dict[str, dict]) -> dict:
    """Every non-TRL row against the fastest TRL row (throughput) and that row's peak RSS."""
    key = RATE[kind][0]
    trl = {n: r for n, r in table.items() if n.startswith("trl") and "error" not in r}
    if not trl:
        return {}
    best_name = max(trl, key=lambda n: trl[n][key])
    best = trl[best_name]
    lowest_rss = min(trl, key=lambda n: trl[n]["peak_rss_mib"])
    out: dict = {"best_trl": best_name, "lowest_rss_trl": lowest_rss}
    for name, r in table.items():
        if name.startswith("trl") or "error" in r:
            continue
        work = WORK[kind][0]
        out[name] = {"speed": round(r[key] / best[key], 2),
                     # < 1: fewer model FLOPs per token/pair than the best TRL row (work avoided)
                     "flops": round(r[work] / best[work], 3),
                     # achieved FLOP/s against the best TRL row's (execution efficiency)
                     "flop_rate": round(r["flop_per_s"] / best["flop_per_s"], 2),
                     "peak_rss": round(r["peak_rss_mib"] / best["peak_rss_mib"], 2),
                     "peak_rss_vs_lowest_trl": round(r["peak_rss_mib"] / trl[lowest_rss]["peak_rss_mib"], 2)}
        if kind in PAIR_KINDS and best.get("pairs_per_s_steps_only"):
            out[name]["speed_steps_only"] = round(r["pairs_per_s_steps_only"] / best["pairs_per_s_steps_only"], 2)
    return out


def report(results: dict) -> str:
    lines: list[str] = []
    spec = results["spec"]
    peak = results["matmul_peak_gflops"]
    for model, part in results["models"].items():
        s = part["spec"]
        smoke = " [--smoke: tiny model, figures mean nothing]" if results.get("smoke") else ""
        lines.append(f"== {MODEL_LABELS[model]}{smoke}; {s['precision']}; data: prompts {s['prompt_tokens'][0]}-"
                     f"{s['prompt_tokens'][1]} tokens, replies {s['reply_tokens'][0]}-{s['reply_tokens'][1]}")
        for kind in KINDS:
            table = part.get(kind, {})
            if not table:
                continue
            r = part["ratios"].get(kind, {})
            best = r.get("best_trl")
            if kind == "sft":
                lines.append(f"SFT ({s['sft_batch']} conversations a step, max_length {s['sft_max_length']}):")
                lines.append(f"  {'contender':18s} {'tokens/s':>9s} {'conv/s':>7s} {'padding':>7s} {'peak RSS':>9s} "
                             f"{'MFLOP/tok':>9s} {'GFLOP/s':>7s} {'of peak':>7s}  vs best TRL (time, FLOPs per token)")
            elif kind == "dpo":
                lines.append(f"DPO ({s['dpo_batch']} pairs a step, max_length {s['dpo_max_length']}; pairs/s charges a "
                             f"precomputed reference pass per pair, 'steps' leaves it out):")
            elif kind in RL_KINDS:
                lines.append(f"{TITLE[kind]} ({s['rl_prompts']} prompt(s) x {s['num_generations']} completions a step, "
                             f"every completion {s['completion_length']} tokens; rollout included):")
                lines.append(f"  {'contender':18s} {'compl/s':>9s} {'tokens/s':>8s} {'peak RSS':>9s} "
                             f"{'GFLOP/compl':>11s} {'GFLOP/s':>7s} {'of peak':>7s}  vs best TRL (time, FLOPs per completion)")
            else:
                lines.append(f"{TITLE[kind]} ({s['dpo_batch']} pairs a step, max_length {s['dpo_max_length']}; "
                             f"{PAIR_NOTE[kind]}):")
            if kind in PAIR_KINDS:
                lines.append(f"  {'contender':18s} {'pairs/s':>9s} {'steps':>7s} {'tokens/s':>8s} {'peak RSS':>9s} "
                             f"{'GFLOP/pair':>10s} {'GFLOP/s':>7s} {'of peak':>7s}  vs best TRL (time, FLOPs per pair)")
            for name, row in table.items():
                if "error" in row:
                    lines.append(f"  {name:18s} FAILED ({row['error']}, log {row.get('log')})")
                    continue
                mark = "  <- best TRL" if name == best else ""
                versus = ""
                if name in r:
                    versus = (f"  {r[name]['speed']:.2f}x speed, {r[name]['flops']:.2f}x FLOPs, "
                              f"{r[name]['peak_rss']:.2f}x memory")
                rate = f"{row['flop_per_s'] / 1e9:7.1f} {row['flop_per_s'] / 1e9 / peak:7.1%}"
                if kind == "sft":
                    lines.append(f"  {name:18s} {row['tokens_per_s']:9.1f} {row['samples_per_s']:7.3f} "
                                 f"{row['padding_fraction']:7.0%} {row['peak_rss_mib']:6.0f} MiB "
                                 f"{row['flops_per_token'] / 1e6:9.1f} {rate}{versus}{mark}")
                elif kind in RL_KINDS:
                    lines.append(f"  {name:18s} {row['completions_per_s']:9.4f} {row['tokens_per_s']:8.1f} "
                                 f"{row['peak_rss_mib']:6.0f} MiB {row['flops_per_completion'] / 1e9:11.2f} "
                                 f"{rate}{versus}{mark}")
                else:
                    lines.append(f"  {name:18s} {row['pairs_per_s']:9.4f} {row['pairs_per_s_steps_only']:7.4f} "
                                 f"{row['tokens_per_s']:8.1f} {row['peak_rss_mib']:6.0f} MiB "
                                 f"{row['flops_per_pair'] / 1e9:10.2f} {rate}{versus}{mark}")
        lines.extend(reference_saved(part))
    tgt = results["targets"]
    proxy = results["models"].get("proxy", {}).get("ratios", {})
    if proxy.get("sft") or proxy.get("dpo"):
        lines.append(f"Targets on the proxy (issue 15): SFT >= {tgt['sft_vs_best_trl']}x and DPO >= {tgt['dpo_vs_best_trl']}x "
                     f"the best TRL row, peak RSS <= {tgt['peak_rss_vs_best_trl']}x its:")
    for kind, name in (("sft", "ours"), ("dpo", "ours"), ("dpo", "ours_pre")):
        r = proxy.get(kind, {}).get(name)
        if r:
            target = tgt[f"{kind}_vs_best_trl"]
            speed = "meets" if r["speed"] >= target else "MISSES"
            mem = "meets" if r["peak_rss"] <= tgt["peak_rss_vs_best_trl"] else "MISSES"
            lines.append(f"  {kind}/{name}: {r['speed']:.2f}x vs {proxy[kind]['best_trl']} ({speed}; its FLOPs "
                         f"{r['flops']:.2f}x, FLOP/s {r['flop_rate']:.2f}x), memory {r['peak_rss']:.2f}x ({mem})")
    mem = results.get("logprob_memory", {})
    if mem and "error" not in mem:
        lines.append(f"Log-prob peak memory, forward + backward (V={mem['vocab']}, H={mem['hidden']}, "
                     f"N={mem['tokens']}; ours / full logits):")
        for case, r in mem["ratios_ours_over_full"].items():
            lines.append(f"  {case:21s} peak {r['peak']:.3f}x, net of output gradients {r['transient']:.3f}x")
    rollout = results.get("rollout_throughput", {})
    if rollout and "error" not in rollout:
        lines.extend(rollout["table"])
    lines.append(f"FLOPs: torch.utils.flop_counter.FlopCounterMode over every step (forward, backward, a reference "
                 f"forward; a precomputed reference pass charged per pair like its time). 'of peak': achieved FLOP/s "
                 f"over this CPU's fp32 matmul rate measured in this run, {peak:.1f} GFLOP/s (2048^3 torch.mm, best of 10).")
    lines.append(f"Shared machine: {spec['cpus']} cores, load average {spec['load']} (1 min) at start. Command: "
                 f"{results['command']}")
    return "\n".join(lines)


def reference_saved(part: dict) -> list[str]:
    """The reference-free rows' FLOPs per pair and peak RSS against the DPO rows of the same run
    (copy reference, a reference forward per pair): what not having a reference saves. Ours against
    ``dpo/ours_separate`` where it ran (chosen and rejected as rows, as SimPO/ORPO), else ``dpo/ours``
    (shared prompt); TRL's against ``dpo/trl_no_gc`` (the same concatenated rows, reference model kept)."""
    dpo = {n: r for n, r in part.get("dpo", {}).items() if "error" not in r}
    against = {"ours": next((n for n in ("ours_separate", "ours") if n in dpo), None),
               "trl_no_gc": "trl_no_gc" if "trl_no_gc" in dpo else None,
               "trl": "trl" if "trl" in dpo else None}
    lines: list[str] = []
    for kind in ("simpo", "orpo"):
        for name, row in part.get(kind, {}).items():
            ref = against.get(name)
            if "error" in row or ref is None:
                continue
            d = dpo[ref]
            saved = d["flops_per_pair"] - row["flops_per_pair"]
            if not lines:
                lines.append("Reference pass saved (reference-free rows against the DPO rows of this run, copy reference):")
            lines.append(f"  {kind + '/' + name:16s} {row['flops_per_pair'] / 1e9:7.1f} vs {'dpo/' + ref:17s} "
                         f"{d['flops_per_pair'] / 1e9:7.1f} GFLOP/pair ({row['flops_per_pair'] / d['flops_per_pair']:.2f}x, "
                         f"{saved / 1e9:+.1f} saved), peak RSS {row['peak_rss_mib']:.0f} vs {d['peak_rss_mib']:.0f} MiB "
                         f"({row['peak_rss_mib'] / d['peak_rss_mib']:.2f}x), pairs/s "
                         f"{row['pairs_per_s'] / d['pairs_per_s']:.2f}x")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "rolemrc-bench")
    p.add_argument("--out", type=Path, default=HERE / "results" / "bench.json")
    p.add_argument("--models", default="proxy,head_heavy", help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--steps", type=int, default=4, help="timed steps per contender (per-step times vary with the rows drawn: prompts 800-1800 tokens, and each side shuffles its own way; fewer steps, noisier ratios)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--prompt-tokens", default="", metavar="LO,HI",
                   help="prompt lengths drawn (default 800,1800, RoleMRC's); shorter: a quicker, smaller run")
    p.add_argument("--completion-length", type=int, default=0, metavar="N",
                   help="GRPO/RLOO: every completion exactly N tokens (default: Spec's, 32)")
    p.add_argument("--num-generations", type=int, default=0, metavar="G",
                   help="GRPO/RLOO: completions per prompt (default: Spec's, 4)")
    p.add_argument("--rl-prompts", type=int, default=0, metavar="P", help="GRPO/RLOO: prompts a step (default: Spec's, 1)")
    p.add_argument("--repeats", type=int, default=1, help="interleaved rounds (the next in reverse order)")
    p.add_argument("--only", default="", help="comma list of kinds or kind/contender, like kto,grpo or sft/ours,dpo/trl "
                   f"(default: all; kinds {', '.join(KINDS)})")
    p.add_argument("--more", action="store_true", help="also: " + ", ".join(f"{k}/{n}" for k, v in MORE.items() for n in v))
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--skip-rollout", action="store_true", help="no rollout throughput row (single- vs multi-turn)")
    p.add_argument("--rollout-repeats", type=int, default=2)
    p.add_argument("--smoke", action="store_true",
                   help="tiny model and short rows: checks that every contender runs (figures mean nothing)")
    p.add_argument("--memory-hidden", type=int, default=4096)
    p.add_argument("--memory-tokens", type=int, default=2048)
    p.add_argument("--memory-dtypes", default="fp32")
    args = p.parse_args()

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"--models: unknown model {m!r} (expected {', '.join(MODELS)})")
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    started = time.time()
    peak = matmul_peak_gflops()
    print(f"fp32 matmul peak of this CPU: {peak:.1f} GFLOP/s", flush=True)
    results: dict = {"models": {}, "targets": TARGETS, "smoke": args.smoke, "matmul_peak_gflops": round(peak, 2),
                     "spec": {"cpus": os.cpu_count(), "load": round(os.getloadavg()[0], 2),
                              "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}}  # the contenders' torch threads
    for model in models:
        if only and not any(x.split("/")[0] in KINDS for x in only):  # e.g. --only rollout: no contender
            continue
        spec = Spec.for_model(model, steps=args.steps, warmup=args.warmup, precision=args.precision)
        if args.smoke:
            spec.__dict__.update(SMOKE)
        if args.prompt_tokens:
            lo, hi = (int(x) for x in args.prompt_tokens.split(","))
            spec.prompt_tokens = (lo, hi)
        for key in ("completion_length", "num_generations", "rl_prompts"):
            if getattr(args, key):
                setattr(spec, key, getattr(args, key))
        work = args.work / model
        print(f"[{model}] preparing model and data in {work} ...", flush=True)
        part: dict = {"label": MODEL_LABELS[model], "spec": dict(spec.__dict__), "data": prepare(work, spec),
                      "ratios": {}}
        log_dir = work / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        for kind in KINDS:
            names = PLANS[model].get(kind, []) + (MORE.get(kind, []) if args.more and model == "proxy" else [])
            names = [n for n in interleave(names) if not only or kind in only or f"{kind}/{n}" in only]
            runs: dict[str, list[dict]] = {n: [] for n in names}
            for round_ in range(args.repeats):
                for name in names if round_ % 2 == 0 else reversed(names):
                    runs[name].append(run_contender(kind, name, work, log_dir, f"r{round_}"))
            if names:
                part[kind] = {n: keep_fastest(kind, runs[n]) for n in names}
                part["ratios"][kind] = ratios(kind, part[kind])
        results["models"][model] = part
    if not args.skip_memory and (not only or "memory" in only):
        log_dir = args.work / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        results["logprob_memory"] = run_memory(args.work, log_dir, args)
    if not args.skip_rollout and (not only or "rollout" in only):
        log_dir = args.work / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        results["rollout_throughput"] = run_rollout(args.work, log_dir, args)
    results.update({
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "allocator_env": MALLOC_ENV,
                    "versions": versions()},
        "command": "python benchmarks/run_all.py " + " ".join(sys.argv[1:]),
        "total_minutes": round((time.time() - started) / 60, 1),
    })
    table = report(results)
    results["table"] = table.splitlines()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from rolemrc.fileio import atomic_write_json

    atomic_write_json(args.out, results)
    print()
    print(table)
    print(f"\nwrote {args.out} ({results['total_minutes']} min)")


def versions() -> dict[str, str]:
    import importlib.metadata as md

    return {p: md.version(p) for p in ("torch", "transformers", "trl", "lightning", "rolemrc")}


if __name__ == "__main__":
    main()
