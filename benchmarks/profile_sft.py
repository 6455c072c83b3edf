"""Where one packed SFT step's time goes, ours against a TRL SFT row (torch.profiler, CPU).

    .venv/bin/python benchmarks/profile_sft.py                          # ours vs trl_no_gc on the proxy
    .venv/bin/python benchmarks/profile_sft.py --trl trl_pack_no_gc --out /tmp/p.json

Same model, data, precision, allocator settings and thread count as ``make bench``
(benchmarks/common.py, sft_throughput.py): each side runs in its own process, trains one untimed
step, then profiles the next (from the end of one optimizer step to the end of the next, as the
bench times it; no FLOP counter on the profiled step). Every profiled op's self time goes into one
cell of phase x kind:

- phase, by the nearest enclosing scope: ``data`` (the DataLoader's ``__next__``: sampling and
  collation), ``decoder`` (the decoder's forward: embeddings, layers, final norm; packed rows
  flattened and attended per conversation for ours), ``head`` (the rest of the forward: the lm_head
  and loss, TRL's entropy/accuracy metrics, our flatten/scatter), ``backward`` (autograd engine),
  ``optimizer`` (AdamW step, zero_grad), ``other`` (everything else in the step: Lightning / Trainer
  hooks, logging, callbacks);
- kind: ``matmul`` (mm/addmm/bmm), ``attention`` (the sdpa kernels), ``ops`` (every other aten op),
  ``framework`` (time inside a scope but in no op: Python, autograd bookkeeping).
  Time in no scope and no op at all is ``other/framework``.

Prints the breakdown side by side and writes ``benchmarks/results/profile_sft.json`` (settings,
load average, thread count, versions, the cells, each side's top ops).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import MALLOC_ENV, ROOT, Spec, prepare, set_env  # noqa: E402

PHASES = ("data", "decoder", "head", "backward", "optimizer", "other")
KINDS = ("matmul", "attention", "ops", "framework")
MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::addmm_", "aten::baddbmm", "aten::addbmm", "aten::matmul"}
DECODER_SCOPE, FORWARD_SCOPE = "profile_sft.decoder", "profile_sft.forward"


def phase_of(event) -> str:  # noqa: ANN001
    """The nearest enclosing scope that names a phase (the event itself included)."""
    e = event
    while e is not None:
        name = e.name
        if name.startswith("autograd::engine::evaluate_function"):
            return "backward"
        if name == DECODER_SCOPE:
            return "decoder"
        if name == FORWARD_SCOPE:
            return "head"
        if name.startswith("enumerate(DataLoader)"):
            return "data"
        if name.startswith("Optimizer."):
            return "optimizer"
        e = e.cpu_parent
    return "other"


def kind_of(name: str) -> str:
    if name in MATMUL:
        return "matmul"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    if name.startswith("aten::"):
        return "ops"
    return "framework"


def breakdown(prof, wall: float) -> dict:  # noqa: ANN001
    """Phase x kind seconds of a profiled step (self times; they add up to the profiled time)."""
    cells = {p: {k: 0.0 for k in KINDS} for p in PHASES}
    by_op: dict[str, float] = {}
    total = 0.0
    for ev in prof.events():
        self_s = ev.self_cpu_time_total / 1e6
        total += self_s
        cells[phase_of(ev)][kind_of(ev.name)] += self_s
        by_op[ev.name] = by_op.get(ev.name, 0.0) + self_s
    cells["other"]["framework"] += max(wall - total, 0.0)  # in no op and no scope: Python between them
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:15]
    return {"cells": {p: {k: round(v, 4) for k, v in c.items()} for p, c in cells.items()},
            "top_ops": [[n, round(s, 4)] for n, s in top]}


def scope(module, name: str) -> None:  # noqa: ANN001
    """Wrap ``module``'s forward (hooks, so FSDP/compile see the same module) in a profiler scope."""
    import torch

    stack: list = []

    def pre(*_):  # noqa: ANN002
        rf = torch.profiler.record_function(name)
        rf.__enter__()
        stack.append(rf)

    def post(*_):  # noqa: ANN002
        stack.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


def wrapped(fn, name: str):  # noqa: ANN001, ANN201
    import torch

    def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)

    return call


class _Profile:
    """Starts the profiler at the end of optimizer step ``warmup`` and stops it at the next one."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.seen, self.prof, self.started, self.result = warmup, 0, None, 0.0, None

    def step_end(self) -> None:
        import torch

        self.seen += 1
        if self.seen == self.warmup:
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.__enter__()
            self.started = time.perf_counter()
        elif self.seen == self.warmup + 1 and self.prof is not None:
            self.prof.__exit__(None, None, None)
            wall = time.perf_counter() - self.started
            self.result = {"wall_s": round(wall, 3), **breakdown(self.prof, wall)}
            self.prof = None


def side(args: argparse.Namespace) -> None:
    """One contender in this process: ``ours`` or a TRL row of benchmarks/sft_throughput.py."""
    set_env()
    import torch

    import common

    common.FLOP_STEPS = 1  # FlopCounterMode (a dispatch mode, Python per op) on the warm-up step only

    import sft_throughput

    spec = Spec.load(args.work)
    spec.steps = 1
    probe = _Profile(spec.warmup)
    if args.side == "ours":
        import lightning as L

        class Hook(L.Callback):
            def on_fit_start(self, trainer, pl_module) -> None:  # noqa: ANN001
                from rolemrc.models.family import base_model

                scope(base_model(pl_module.model).model, DECODER_SCOPE)
                pl_module.training_step = wrapped(pl_module.training_step, FORWARD_SCOPE)

            def on_train_batch_end(self, *_) -> None:  # noqa: ANN002
                probe.step_end()

        result = sft_throughput.run_ours(args.work, spec, pad_max=False, extra_callbacks=(Hook(),))
    else:
        import trl
        from transformers import TrainerCallback

        compute_loss = trl.SFTTrainer.compute_loss
        trl.SFTTrainer.compute_loss = lambda self, *a, **k: wrapped(compute_loss, FORWARD_SCOPE)(self, *a, **k)

        class HFHook(TrainerCallback):
            def on_train_begin(self, args_, state, control, model=None, **kwargs) -> None:  # noqa: ANN001
                scope(model.model, DECODER_SCOPE)

            def on_step_end(self, *_, **__) -> None:  # noqa: ANN002, ANN003
                probe.step_end()

        result = sft_throughput.run_trl(args.work, spec, args.side, extra_callbacks=(HFHook(),))
    if probe.result is None:
        raise SystemExit(f"error: {args.side}: the profiled step never ended ({probe.seen} steps seen)")
    out = {"side": args.side, "threads": torch.get_num_threads(), "tokens": result["tokens"],
           "step_seconds_unprofiled_warmup": result.get("step_seconds"), **probe.result}
    args.side_out.write_text(json.dumps(out, indent=2))


def table(sides: list[dict]) -> str:
    names = [s["side"] for s in sides]
    lines = [f"{'phase / kind (s)':28}" + "".join(f"{n:>16}" for n in names)]
    for p in PHASES:
        for k in KINDS:
            vals = [s["cells"][p][k] for s in sides]
            if max(vals) >= 0.005:
                lines.append(f"{p + ' / ' + k:28}" + "".join(f"{v:16.3f}" for v in vals))
    for k in KINDS:
        lines.append(f"{'all / ' + k:28}" + "".join(f"{sum(s['cells'][p][k] for p in PHASES):16.3f}" for s in sides))
    lines.append(f"{'step (profiled wall)':28}" + "".join(f"{s['wall_s']:16.3f}" for s in sides))
    lines.append(f"{'tokens in the step':28}" + "".join(f"{s['tokens']:16.0f}" for s in sides))
    lines.append(f"{'ms per 1k tokens':28}" + "".join(f"{1e6 * s['wall_s'] / s['tokens']:16.1f}" for s in sides))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "rolemrc-profile-sft")
    p.add_argument("--trl", default="trl_no_gc", help="the TRL row of sft_throughput.py to profile against")
    p.add_argument("--out", type=Path, default=HERE / "results" / "profile_sft.json")
    p.add_argument("--side", default=None, help=argparse.SUPPRESS)  # internal: one contender in this process
    p.add_argument("--side-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        side(args)
        return
    import torch

    spec = Spec.for_model("proxy", steps=1, warmup=1)
    data = prepare(args.work, spec)
    env = {**os.environ, **MALLOC_ENV, "PYTHONPATH": str(ROOT / "src")}
    sides, loads = [], {}
    for name in ("ours", args.trl):
        out = args.work / f"profile_{name}.json"
        out.unlink(missing_ok=True)
        before = os.getloadavg()[0]
        log = args.work / f"profile_{name}.log"
        with log.open("w") as fh:
            proc = subprocess.run([sys.executable, __file__, "--work", str(args.work), "--side", name,
                                   "--side-out", str(out)], env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(f"error: {name} failed (exit {proc.returncode}); log {log}:\n{log.read_text()[-2000:]}")
        result = json.loads(out.read_text())
        result["load_avg_1min"] = [round(before, 2), round(os.getloadavg()[0], 2)]
        sides.append(result)
        print(f"  {name}: step {result['wall_s']:.2f} s, {result['tokens']:.0f} tokens "
              f"(load {result['load_avg_1min']})", flush=True)
    import importlib.metadata as md

    text = table(sides)
    report = {"command": "python benchmarks/profile_sft.py " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "threads": sides[0]["threads"], "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "spec": dict(spec.__dict__), "data": data, "allocator_env": MALLOC_ENV,
              "versions": {k: md.version(k) for k in ("torch", "transformers", "trl", "lightning")},
              "cpus": os.cpu_count(), "torch_default_threads": torch.get_num_threads(),
              "sides": sides, "table": text.splitlines()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
