"""GPU memory per device for a run: the estimate, and the simulated per-rank peak.

    python -m rolemrc.memory                    # the table of docs/memory.md (8B models, 80 GB GPUs)
    python -m rolemrc.memory experiment=rolemrc_llama_sft trainer.devices=8   # one config's estimate
    python -m rolemrc.memory experiment=rolemrc_llama_sft --simulate [--json]  # its simulated per-rank peak

The command line of :mod:`rolemrc.sizing`: the formula (:mod:`rolemrc.sizing.formula`) prints the
table and a config's estimate; ``--simulate`` runs one optimizer step of the configured run under
fake tensors on fake ranks (:mod:`rolemrc.sizing.simulate`, handed the run's module builder and
world size from here) and reports the per-rank peak by category, and whether it fits;
``model.gradient_checkpointing=auto`` decides from that simulation, the formula being the
fallback (:mod:`rolemrc.sizing.decide`, where a training run stores the simulated peak). Without
``--simulate`` nothing of the training code (Lightning) is imported.
"""

from __future__ import annotations

import sys


def _usage() -> str:
    """The command lines of the module docstring, and what the flags do."""
    lines = [line.strip() for line in (__doc__ or "").splitlines() if line.strip().startswith("python -m")]
    return "\n".join(["usage:", *(f"  {line}" for line in lines), "",
                      "Hydra overrides (key=value) pick the training config, as for train.py.",
                      "  --simulate  one optimizer step under fake tensors on fake ranks: the per-rank peak",
                      "              (seconds for the tiny model; an 8B recipe takes minutes, ~5 on 2 busy cores)",
                      "  --json      with --simulate: the report also as one JSON object on the last line",
                      "  -h, --help  this message"])


if __name__ == "__main__" and ("-h" in sys.argv[1:] or "--help" in sys.argv[1:]):
    print(_usage())  # at once: what follows imports torch (seconds)
    sys.exit(0)

import json
from pathlib import Path
from typing import Any

from rolemrc.config import TrainStep, check_train_config, register
from rolemrc.entry import entry_point
from rolemrc.sizing.formula import log_estimate, table
from rolemrc.sizing.result import SimulationUnavailable


def compose_train_config(overrides: list[str]) -> Any:
    """``conf/train.yaml`` composed with ``overrides``, as ``python train.py`` would (no run)."""
    from hydra import compose, initialize_config_dir

    register()
    conf = Path(__file__).resolve().parents[2] / "conf"
    if not (conf / "train.yaml").is_file():
        raise FileNotFoundError(f"no conf/train.yaml at {conf}: run from a rolemrc checkout")
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose("train", overrides=overrides)


def simulated_report(step: TrainStep) -> dict[str, Any]:
    """The simulated per-rank peak of the run's step (:func:`rolemrc.sizing.simulate.report`),
    with the run's module builder and world size: the training code, imported only here."""
    from rolemrc.run.build import build_module
    from rolemrc.run.strategies import world_size
    from rolemrc.sizing.simulate import report

    return report(step, build=build_module, world=world_size(step.trainer))


def _print_report(r: dict[str, Any]) -> None:
    mb = r["micro_batch"]
    verdict = "fits" if r["fits"] else "does NOT fit"
    print(f"simulated per-rank peak: {r['peak_gib']:.2f} GiB ({r['ranks']} rank(s), strategy={r['strategy']}, "
          f"micro-batch {mb['rows']} rows / {mb['tokens']} tokens, activation checkpointing {r['checkpointing']}); "
          f"{verdict} {r['device_memory_gb']:g} GB devices ({r['headroom']:.0%} usable: "
          f"{r['headroom'] * r['device_memory_gb']:.1f} GiB)")
    if r.get("phases"):
        ro = r["rollout"]
        print(f"  set by the {r['phase']} phase; phases: " + ", ".join(
            f"{name} {p['peak_gib']:.2f} GiB" for name, p in r["phases"].items())
              + f" (rollout: {ro['sequences']} sequences of {ro['prompt_tokens']} + {ro['completion_tokens']} tokens "
              f"at once, KV cache {ro['kv_cache_gib']:.2f} GiB {ro['kv_dtype'].removeprefix('torch.')})")
    for name, gib in sorted(r["by_category"].items(), key=lambda kv: -kv[1]):
        print(f"  {name:16s} {gib:9.3f} GiB")
    if r.get("note"):
        print(f"note: {r['note']}")
    gc = r["gradient_checkpointing"]
    if r["setting"] == "auto":
        print(f"model.gradient_checkpointing=auto: on {gc['on']:.2f} GiB, off {gc['off']:.2f} GiB -> "
              f"{r['checkpointing']}")
    if r.get("phase") == "rollout" and not r["fits"]:
        print("the rollout sets the peak: activation checkpointing does not lower it (generate keeps no "
              "activations); fewer sequences at once (data.batch_size, trainer.accumulate_grad_batches, "
              "objective.num_generations) or shorter ones do")


def main(argv: list[str]) -> int:
    """No arguments: the table of docs/memory.md. Hydra overrides: that training config's estimate; with
    ``--simulate`` after them, its simulated per-rank peak (``--json``: also as one JSON object on
    the last line)."""
    if not argv:
        print(table())
        return 0
    if "-h" in argv or "--help" in argv:
        print(_usage())
        return 0
    flags = [a for a in argv if a in ("--simulate", "--json")]
    overrides = [a for a in argv if a not in flags]
    if "--json" in flags and "--simulate" not in flags:
        print("error: --json goes with --simulate (python -m rolemrc.memory <overrides> --simulate --json)",
              file=sys.stderr)
        return 1
    unknown = [a for a in overrides if a.startswith("--")]
    if unknown:
        print(f"error: unknown flag {unknown[0]} (expected --simulate, --json after the Hydra overrides)",
              file=sys.stderr)
        return 1
    from hydra.errors import HydraException

    with entry_point():
        try:
            cfg = compose_train_config(overrides)
        except HydraException as err:  # a bad override: Hydra's message, one line, no traceback
            cause = f" ({err.__cause__})" if err.__cause__ is not None else ""
            print(f"error: {err}{cause}".replace("\n", " "), file=sys.stderr)
            return 1
        check_train_config(cfg)  # what setup() refuses before loading anything, refused here too
        step = TrainStep.of(cfg)
        if "--simulate" not in flags:
            print(log_estimate(step))  # checked just above: the checks run once
            return 0
        print("simulating one optimizer step under fake tensors: seconds for the tiny model, minutes for an 8B "
              "recipe (~5 on 2 busy CPU cores)", file=sys.stderr, flush=True)
        try:
            report = simulated_report(step)
        except SimulationUnavailable as err:
            print(f"error: cannot simulate this run: {err}", file=sys.stderr)
            return 1
        _print_report(report)
        if "--json" in flags:
            print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
