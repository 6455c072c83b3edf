"""Online RL demonstration (issue 33): GRPO on the shipped rule-bearing prompts, verifier reward,
from the demo's SFT export, on CPU; TRL 1.16's ``GRPOTrainer`` and rolemrc's ``objective=grpo``
side by side on the same model, prompts, reward and settings.

    .venv/bin/python benchmarks/grpo_demo.py                      # trains the demo SFT model first
    .venv/bin/python benchmarks/grpo_demo.py --sft outputs/demo/<run>/sft/export --steps 40
    make demo-rl

- SFT: ``--sft`` names an export (an HF folder); without it the demo's SFT command
  (``scripts/demo.sh`` step 1: the tiny model, 6 epochs on ``sample/sft.jsonl``) trains one into
  ``<work>/sft``.
- Prompts: ``assets/sample/rl.jsonl`` (``data=sample_rl``), all of them (no held-out part), each
  with its nested ``rule``; reward: the ``verifier`` (1 when the reply obeys every rule, else 0).
- The same GRPO settings for both: ``--prompts`` prompts x ``--generations`` completions per
  optimizer step (one micro-batch, no accumulation), loss ``dapo``, ``beta=0`` (no reference),
  ``epsilon=0.2``, one update per batch, group-scaled advantages, temperature 1, no top-p/top-k,
  ``--max-new`` completion tokens, AdamW at a constant ``--lr``, gradient clipping at 1, fp32.
- TRL runs in this process; rolemrc runs ``train.py objective=grpo ...`` as a subprocess and its
  figures are read from the run's CSV metrics. Throughput, first step left out (warm-up):
  ``generate_tokens_per_s``, completion tokens per second inside ``generate`` (TRL: timed around
  its model's ``generate``; ours: its logged ``completion_tokens_per_s``), comparable;
  ``completions_per_s``: TRL over its timed steps (sampling, rewards, backward, optimizer), ours
  over the whole ``train.py`` process (start, model load, export included: a lower bound).
- Output: ``<json>`` (default ``<work>/grpo_demo.json``; ``--json benchmarks/results/grpo_demo.json``
  refreshes the published figures: settings, per-step verifier
  reward and mean completion length of each, first/last-10-step means, completions/s, the
  machine's load average at the start and end of each part) and a PNG
  of the curves next to it.
  Exit 1 when a part that was asked for did not produce its figures (the JSON says why).

Not a timed test: minutes on a laptop CPU, seeded (the figures still vary with the machine's
thread scheduling only through timing).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # run from a checkout without an install, as the other benchmarks


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("WANDB_MODE", "offline")
    env["PYTHONPATH"] = str(ROOT / "src") + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def sft_export(args: argparse.Namespace, work: Path) -> Path:
    """``--sft``, or the demo's SFT model trained into ``<work>/sft`` (scripts/demo.sh step 1)."""
    if args.sft:
        path = Path(args.sft)
        if not (path / "config.json").is_file():
            raise SystemExit(f"error: --sft {path}: not an exported model folder (no config.json)")
        return path
    cmd = [sys.executable, "train.py", "trainer.enable_progress_bar=false", "task_name=demo_sft",
           "trainer.max_epochs=6", f"hydra.run.dir={work / 'sft'}"]
    print("== SFT (the demo's command):", shlex.join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=_env(), check=True, stdout=subprocess.DEVNULL)
    return work / "sft" / "export"


def prompts() -> list[dict[str, Any]]:
    """The sample RL prompts as TRL's conversational rows: ``prompt`` messages + ``rule``."""
    from rolemrc import asset
    from rolemrc.data.readers import read_examples

    items, _ = read_examples([{"path": asset("sample/rl.jsonl")}], "prompts")
    return [{"prompt": it.prompt, "rule": json.dumps(it.rule)} for it in items]


def verifier(*, prompts: list[Any], completions: list[Any], rule: list[str], **kw: Any) -> list[float | None]:
    """rolemrc's verifier reward (mode all); rules travel as JSON text (Arrow would merge the rule
    objects' fields into one struct type)."""
    from rolemrc.rewards import VerifierReward

    return VerifierReward("all")(prompts=prompts, completions=completions, rule=[json.loads(r) for r in rule])


def run_trl(args: argparse.Namespace, sft: Path, work: Path) -> dict[str, Any]:
    from rolemrc.warnings import filter_known_warnings

    filter_known_warnings()  # before peft imports bitsandbytes: the lines train.py's runs do not print either
    # transformers prints "Running in WANDB offline mode" when it is imported with WANDB_MODE=offline
    # (make sets it); TRL reports to nothing here (report_to=[]). The train.py run gets it back (_env).
    wandb_mode = os.environ.pop("WANDB_MODE", None)
    try:
        import torch
        import trl
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    finally:
        if wandb_mode is not None:
            os.environ["WANDB_MODE"] = wandb_mode

    torch.set_num_threads(args.threads)
    step_s: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            step_s.append(time.perf_counter() - self.t0)

    config = GRPOConfig(
        output_dir=str(work / "trl"), max_steps=args.steps, learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, seed=args.seed, use_cpu=True, bf16=False, fp16=False,
        per_device_train_batch_size=args.prompts * args.generations, gradient_accumulation_steps=1,
        steps_per_generation=1, num_generations=args.generations, max_completion_length=args.max_new,
        temperature=1.0, top_p=1.0, top_k=0, loss_type="dapo", beta=0.0, epsilon=0.2, num_iterations=1,
        scale_rewards="group", activation_checkpointing=False, logging_steps=1, save_strategy="no", report_to=[],
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=str(sft), reward_funcs=[verifier], args=config,
                          train_dataset=Dataset.from_list(prompts()), callbacks=[Timer()])
    gen_s: list[float] = []  # seconds in generate() per step (TRL samples through the model's own generate)
    generate = trainer.model.generate

    def timed_generate(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            gen_s.append(time.perf_counter() - t)

    trainer.model.generate = timed_generate
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    rows = [r for r in trainer.state.log_history if "rewards/verifier/mean" in r]
    curve = [float(r["rewards/verifier/mean"]) for r in rows]
    timed = step_s[1:] or step_s
    lengths = [float(r["completions/mean_length"]) for r in rows]
    if len(gen_s) != len(lengths):
        raise RuntimeError(f"{len(gen_s)} generate() calls for {len(lengths)} logged steps: cannot time them")
    n = args.prompts * args.generations
    return {"version": trl.__version__, "reward_per_step": curve, "completion_tokens_per_step": lengths,
            "completions_per_s": len(timed) * n / sum(timed),
            "completions_per_s_source": "timed optimizer steps (sampling, rewards, backward, optimizer), first left out",
            "generate_tokens_per_s": sum(x * n for x in lengths[1:]) / sum(gen_s[1:]) if len(gen_s) > 1 else math.nan,
            "mean_completion_tokens": statistics.fmean(float(r["completions/mean_length"]) for r in rows),
            "train_wall_s": wall}


def _csv_rows(run_dir: Path) -> list[dict[str, str]]:
    files = sorted(run_dir.glob("csv/**/metrics.csv"))
    if not files:
        raise RuntimeError(f"no csv/metrics.csv under {run_dir}")
    with open(files[-1], newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def run_ours(args: argparse.Namespace, sft: Path, work: Path) -> dict[str, Any]:
    run_dir = work / "ours"
    cmd = [sys.executable, "train.py", "objective=grpo", "data=sample_rl", f"model.path={sft}",
           "data.val_fraction=0.0", "trainer.limit_val_batches=0", f"data.batch_size={args.prompts}",
           "trainer.accumulate_grad_batches=1", f"trainer.max_steps={args.steps}", "trainer.max_epochs=-1",
           "trainer.precision=32-true", "trainer.gradient_clip_val=1.0", f"optim.lr={args.lr}",
           "optim.scheduler=constant", "optim.warmup_ratio=0.0", "optim.weight_decay=0.0",
           "objective.loss_type=dapo", "objective.beta=0.0", "objective.epsilon=0.2", "objective.num_iterations=1",
           "objective.scale_rewards=group", f"objective.num_generations={args.generations}",
           "objective.temperature=1.0", "objective.top_p=1.0", "objective.top_k=0",
           f"objective.max_completion_length={args.max_new}", "objective.rollout=hf",
           "++objective.rewards.verifier.mode=all", f"seed={args.seed}",
           "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1", "task_name=grpo_demo",
           f"hydra.run.dir={run_dir}"]
    print("== rolemrc:", shlex.join(cmd), flush=True)
    env = {**_env(), "OMP_NUM_THREADS": str(args.threads)}
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (work / "ours.log").write_text(done.stdout + done.stderr, encoding="utf-8")
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"train.py objective=grpo exited {done.returncode}: {' | '.join(tail)} "
                           f"(log: {work / 'ours.log'})")
    rows = _csv_rows(run_dir)
    key = next((k for k in rows[0] if k.endswith("rewards/verifier/mean") and k.startswith("train")), None)
    if key is None:
        raise RuntimeError(f"no train .../rewards/verifier/mean column in the run's CSV; columns: {list(rows[0])}")
    by_step: dict[int, float] = {}
    for r in rows:
        if r.get(key) not in (None, ""):
            by_step[int(float(r["step"]))] = float(r[key])
    out: dict[str, Any] = {"reward_per_step": [by_step[s] for s in sorted(by_step)], "process_wall_s": wall,
                           "command": shlex.join(cmd[1:])}
    length = next((k for k in rows[0] if k.endswith("completions/mean_length") and k.startswith("train")), None)
    if length is not None:
        out["completion_tokens_per_step"] = [float(r[length]) for r in rows if r.get(length) not in (None, "")]
    # the run logs generate()'s completion tokens/s per step; it logs no step time, so completions/s
    # is over the whole process (start, model load, final export included): a lower bound
    rate = next((k for k in rows[0] if k.endswith("completion_tokens_per_s") and k.startswith("train")), None)
    if rate is not None:
        vals = [float(r[rate]) for r in rows if r.get(rate) not in (None, "")]
        out["generate_tokens_per_s"] = statistics.fmean(vals[1:] or vals) if vals else math.nan
    out["completions_per_s"] = args.steps * args.prompts * args.generations / wall
    out["completions_per_s_source"] = "whole process wall time (start, model load, export included): a lower bound"
    return out


def _mean(xs: list[float], n: int, last: bool) -> float | None:
    part = xs[-n:] if last else xs[:n]
    return statistics.fmean(part) if part else None


def plot(results: dict[str, Any], png: Path, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    lx = ax.twinx()  # how the reward is earned: the replies' length
    lx.set_ylabel("mean completion tokens (dashed)")
    names, rates, gen_rates = [], [], []
    for name, color in (("trl", "tab:orange"), ("ours", "tab:blue")):
        r = results.get(name) or {}
        curve = r.get("reward_per_step")
        if not curve:
            continue
        steps = list(range(1, len(curve) + 1))
        ax.plot(steps, curve, color=color, alpha=0.3, lw=1)
        smooth = [statistics.fmean(curve[max(0, i - window + 1):i + 1]) for i in range(len(curve))]
        label = "TRL GRPOTrainer" if name == "trl" else "rolemrc objective=grpo"
        ax.plot(steps, smooth, color=color, lw=2, label=f"{label} ({window}-step mean)")
        if r.get("completion_tokens_per_step"):
            lx.plot(range(1, len(r["completion_tokens_per_step"]) + 1), r["completion_tokens_per_step"], color=color,
                    ls="--", lw=1)
        names.append(label.split()[0])
        rates.append(r["completions_per_s"])
        gen_rates.append(r.get("generate_tokens_per_s", math.nan) / 10)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("verifier reward (share of replies obeying the rule)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    ax.set_title("GRPO from the demo SFT model, sample_rl prompts")
    x = range(len(names))
    bx.bar([i - 0.2 for i in x], rates, width=0.4, color="tab:gray", label="completions/s")
    bx.bar([i + 0.2 for i in x], gen_rates, width=0.4, color="tab:green", label="generate tokens/s / 10")
    bx.set_xticks(list(x), names)
    bx.legend(fontsize=8)
    bx.set_title("throughput (CPU)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sft", help="an SFT export folder (default: train the demo's SFT model)")
    ap.add_argument("--work", type=Path, help="run folder (default outputs/grpo_demo/<time>)")
    ap.add_argument("--only", choices=["both", "trl", "ours"], default="both")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per optimizer step")
    ap.add_argument("--generations", type=int, default=8, help="completions per prompt")
    ap.add_argument("--max-new", type=int, default=48, help="max completion tokens")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads of each run")
    ap.add_argument("--window", type=int, default=10, help="steps in the smoothed curve and the first/last means")
    ap.add_argument("--json", type=Path, default=None,
                    help="results file, the PNG beside it (default <work>/grpo_demo.json; the published figures: "
                         "benchmarks/results/grpo_demo.json)")
    args = ap.parse_args()
    work = args.work or ROOT / "outputs" / "grpo_demo" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    work.mkdir(parents=True, exist_ok=True)
    args.json = args.json or work / "grpo_demo.json"  # the checkout's files only when asked for
    sft = sft_export(args, work)
    results: dict[str, Any] = {
        "command": shlex.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "sft_export": str(sft),
        "settings": {"steps": args.steps, "prompts_per_step": args.prompts, "generations": args.generations,
                     "max_completion_tokens": args.max_new, "lr": args.lr, "seed": args.seed,
                     "threads": args.threads, "loss_type": "dapo", "beta": 0.0, "epsilon": 0.2,
                     "temperature": 1.0, "reward": "verifier (mode all) on sample/rl.jsonl rules"},
        "machine": {"cpus": os.cpu_count()}}
    failed = []
    for name, fn in (("trl", run_trl), ("ours", run_ours)):
        if args.only not in ("both", name):
            continue
        print(f"== {name}", flush=True)
        load_start = os.getloadavg()  # the machine's 1/5/15-min load: throughput is only comparable in one run
        try:
            r = fn(args, sft, work)
        except Exception as err:  # recorded and reported; the exit status says so
            results[name] = {"error": f"{type(err).__name__}: {err}"}
            failed.append(name)
            print(f"{name} failed: {err}", file=sys.stderr)
            continue
        r["load_average"] = {"start": [round(x, 2) for x in load_start],
                             "end": [round(x, 2) for x in os.getloadavg()]}
        curve = r["reward_per_step"]
        r[f"first_{args.window}_mean"] = _mean(curve, args.window, last=False)
        r[f"last_{args.window}_mean"] = _mean(curve, args.window, last=True)
        results[name] = r
        print(f"{name}: verifier reward first {args.window} steps {r[f'first_{args.window}_mean']:.3f}, last "
              f"{args.window} {r[f'last_{args.window}_mean']:.3f}; {r['completions_per_s']:.1f} completions/s",
              flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    png = args.json.with_suffix(".png")
    plot(results, png, args.window)
    print(f"wrote {args.json} and {png}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
