"""The sizing decision of a training run: ``model.gradient_checkpointing=auto`` -> on or off,
before anything loads.

``auto`` decides from the simulated per-rank peak of one optimizer step without checkpointing
(:mod:`rolemrc.sizing.simulate`, the simulator, run in a child process) where
``runtime.simulate_memory`` is on, else from the formula
(:func:`rolemrc.sizing.formula.choose_checkpointing`). The run hands :func:`resolve_checkpointing`
what the simulator needs of it: its module builder (``build_module``, named to the child process
by its import name) and its world size. The simulated peak is stored by a key of everything the
simulated step depends on (:func:`sizing_key`, under ``$ROLEMRC_CACHE_DIR/sizing``), so a second
start, a resume, a requeue or a sweep job of the same shape decides without simulating: the
simulator runs, in its child process, only on a miss; this module does not import it.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import fields
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf, open_dict

from rolemrc import __version__
from rolemrc.config import OBJECTIVES, TrainStep, checkpointing_setting
from rolemrc.fileio import atomic_write_json, cache_root
from rolemrc.sizing.formula import GB, choose_checkpointing
from rolemrc.sizing.result import HEADROOM, Simulation, SimulationUnavailable, step_peak

log = logging.getLogger(__name__)
PACKAGE = Path(__file__).resolve().parents[1]  # src/rolemrc
SIMULATOR = "rolemrc.sizing.simulate"  # the child process's module (python -m), and the file keyed


def resolve_checkpointing(step: TrainStep, *, build: Callable[..., Any], world: int) -> bool:
    """Replace ``model.gradient_checkpointing: auto`` in ``step.model`` by a bool (logged), so everything
    built after sees one. ``auto`` decides from the simulated per-rank peak without checkpointing
    (:func:`decide_by_simulation`: the run's module builder ``build`` on ``world`` ranks) where
    ``runtime.simulate_memory`` is on and the run can be simulated; otherwise (or when the
    simulation fails) from the formula (:func:`choose_checkpointing`), and says so."""
    choice, why = choose_checkpointing(step)
    if checkpointing_setting(step.model.gradient_checkpointing) == "auto" and step.runtime.get("simulate_memory", True):
        choice, why = decide_by_simulation(step, formula=(choice, why), build=build, world=world)
    log.info("activation checkpointing: %s, %s", "on" if choice else "off", why)
    with open_dict(step.model):
        step.model.gradient_checkpointing = choice
    return choice


# Keys of a run's groups that change no simulated step's memory: left out of the sizing key, so a
# sweep over them (objective.beta, optim.lr), a longer run or another data file reuses the decision.
NOT_SIZED: dict[str, tuple[str, ...]] = {
    "model": ("gradient_checkpointing",),  # decided here; the step is simulated without it
    "objective": ("beta", "label_smoothing", "reference_cache_dir"),
    "data": ("name", "dir", "sft", "pairs", "prompts", "test", "sft_val", "pairs_val", "prompts_val",
             "unpaired_val", "val_fraction",
             "on_error", "num_workers", "shuffle", "cache", "cache_dir", "num_proc", "roles", "rolebench", "characterllm"),
    "optim": ("lr", "scheduler", "warmup_ratio", "min_lr_ratio"),
    "trainer": ("max_epochs", "max_steps", "log_every_n_steps", "val_check_interval", "check_val_every_n_epoch",
                "limit_train_batches", "limit_val_batches", "num_sanity_val_steps", "enable_progress_bar",
                "matmul_precision", "checkpoint_every_n_steps", "device_memory_gb"),
}
SIZED_GROUPS = ("model", "objective", "data", "trainer", "strategy", "optim")


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def _package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def sizing_key(step: TrainStep) -> tuple[str, dict[str, Any]]:
    """(key, what it is made of): everything a simulated step without checkpointing depends on,
    that is the run's groups the simulation builds from (less :data:`NOT_SIZED`), the model's
    architecture files (``config.json`` of a local ``model.path`` / ``model.architecture``), and
    the code that simulates (rolemrc's version, ``sizing/simulate.py`` itself, the objective's step:
    :func:`step_sources`, torch, transformers, peft). ``runtime.device_memory_gb`` is not part of
    it: the stored peak is compared with it at every start."""
    parts: dict[str, Any] = {}
    for group in SIZED_GROUPS:
        node = OmegaConf.to_container(getattr(step, group), resolve=True, throw_on_missing=False)
        parts[group] = {k: v for k, v in node.items() if k not in NOT_SIZED.get(group, ())}
    files = {}
    for key in ("path", "architecture"):
        value = OmegaConf.select(step.model, key, throw_on_missing=False) if OmegaConf.is_config(step.model) else None
        if isinstance(value, str) and value != "???":
            files[f"model.{key}"] = _digest(Path(value) / "config.json")
    parts["files"] = files
    parts["code"] = {"rolemrc": __version__, "simulate": _digest(PACKAGE / "sizing" / "simulate.py"),
                     "step": step_sources(step.objective.name),
                     **{name: _package_version(name) for name in ("torch", "transformers", "peft")}}
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32], parts


def step_sources(objective: str) -> dict[str, str | None]:
    """``{file: digest}`` of the code the simulation runs as the objective's step: the file of
    the registered module and of each rolemrc class it derives from (``step_loss``,
    ``training_step``, their helpers), the reference's module where the entry takes a reference, and
    the pure loss functions (``rolemrc/objectives/*.py``). Editing one of them is another key (the
    objective's next start simulates again); another objective's module is not part of it."""
    entry = OBJECTIVES[objective]
    module, _, name = entry.module.partition(":")
    cls = getattr(importlib.import_module(module), name)
    ours = [c for c in cls.__mro__ if c.__module__ == module or c.__module__.startswith("rolemrc.")]
    files = {Path(f).resolve() for c in ours if (f := inspect.getsourcefile(c)) is not None}
    if entry.reference:
        files.add(PACKAGE / "modules" / "reference.py")
    files.update((PACKAGE / "objectives").glob("*.py"))
    return {(str(f.relative_to(PACKAGE)) if f.is_relative_to(PACKAGE) else str(f)): _digest(f) for f in sorted(files)}


def sizing_cache_dir() -> Path:
    """``$ROLEMRC_CACHE_DIR/sizing``, else ``$XDG_CACHE_HOME/rolemrc/sizing`` (``~/.cache/rolemrc/sizing``)."""
    return cache_root() / "sizing"


def builder_name(build: Callable[..., Any]) -> str:
    """``"package.module:function"``: how the module builder the run hands travels to the child
    process (:func:`rolemrc.sizing.simulate.resolve_builder` imports it there)."""
    name = f"{build.__module__}:{build.__qualname__}"
    module, _, attr = name.partition(":")
    if "." in attr or getattr(sys.modules.get(module), attr, None) is not build:
        raise SimulationUnavailable(f"the module builder {name} is not importable by that name: a child process "
                                    "cannot build the run's module with it (hand a module-level function)")
    return name


def run_spec(step: TrainStep, *, checkpointing: bool, build: Callable[..., Any], world: int,
             batch_size: int | None = None) -> dict[str, Any]:
    """What a child process needs to run the step: the config's parts the simulation reads,
    resolved to plain values (a missing ``model.path`` stays ``???``), the step's settings, and
    what the run handed: its module builder by import name, its world size."""
    parts = {f.name: OmegaConf.to_container(getattr(step, f.name), resolve=True, throw_on_missing=False)
             for f in fields(TrainStep) if getattr(step, f.name) is not None}
    return {"step": parts, "checkpointing": checkpointing, "batch_size": batch_size, "build": builder_name(build),
            "world": int(world)}


def simulate_in_subprocess(step: TrainStep, *, checkpointing: bool, build: Callable[..., Any], world: int,
                           batch_size: int | None = None, timeout: float = 1800) -> Simulation:
    """:func:`rolemrc.sizing.simulate.simulate` in a child process (``python -m
    rolemrc.sizing.simulate <spec.json>``), so the fake process group never meets this process's own."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "run.json"
        spec.write_text(json.dumps(run_spec(step, checkpointing=checkpointing, build=build, world=world,
                                            batch_size=batch_size)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-m", SIMULATOR, str(spec)], capture_output=True,
                              text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SimulationUnavailable(f"the simulation failed (exit {proc.returncode}): {last}")
    return Simulation(**json.loads(proc.stdout.strip().splitlines()[-1]))


def simulated_peak(step: TrainStep, *, build: Callable[..., Any], world: int) -> tuple[dict[str, Any] | None, str]:
    """(the stored simulation of the run's step without checkpointing: ``peak_bytes``, ``ranks``,
    ``headroom``; where it came from). Simulated (:func:`simulate_in_subprocess`, the run's module
    builder ``build`` on ``world`` ranks) only when no simulation of this :func:`sizing_key` is
    stored; a simulation that fails stores nothing and gives (None, why)."""
    key, parts = sizing_key(step)
    path = sizing_cache_dir() / f"{key}.json"
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        if {"peak_bytes", "ranks", "headroom"} <= set(stored):
            return stored, f"stored in {path}"
    except (OSError, ValueError):
        pass  # none stored (or unreadable: simulated again and rewritten)
    try:
        sim = simulate_in_subprocess(step, checkpointing=False, build=build, world=world)
    except (SimulationUnavailable, OSError, subprocess.TimeoutExpired) as err:
        return None, str(err)
    stored = {"peak_bytes": sim.peak_bytes, "ranks": sim.ranks, "headroom": HEADROOM,
              "by_category": sim.by_category, "phase": sim.phase, "step_peak_bytes": step_peak(sim), "key": parts}
    try:
        atomic_write_json(path, stored)
    except OSError as err:  # a read-only cache: the decision stands, the next start simulates again
        log.warning("memory: could not store the sizing decision in %s (%s)", path, err)
        return stored, "simulated"
    return stored, f"simulated, stored in {path}"


def decide_by_simulation(step: TrainStep, formula: tuple[bool, str], *, build: Callable[..., Any],
                         world: int) -> tuple[bool, str]:
    """``auto`` from the simulated step without checkpointing (:mod:`rolemrc.sizing.simulate`, in a
    child process, once per :func:`sizing_key`): off where its per-rank peak fits its headroom of
    ``runtime.device_memory_gb``, else on. A disagreement with the formula's choice is logged;
    where the run cannot be simulated the formula's choice stands (also logged)."""
    device_gb = step.runtime.device_memory_gb
    sim, where = simulated_peak(step, build=build, world=world)
    if sim is None:
        log.warning("memory simulation unavailable (%s): the formula decides activation checkpointing", where)
        return formula
    headroom = float(sim["headroom"])
    limit = headroom * device_gb * GB
    # the training step decides: an objective's rollout (GRPO's generate) keeps no activations to checkpoint
    peak = sim.get("step_peak_bytes", sim["peak_bytes"])
    fits = peak <= limit
    choice = not fits
    rollout = (f"; its rollout peaks at {sim['peak_bytes'] / GB:.1f} GiB, over {headroom:.0%} of the device either "
               "way: activation checkpointing does not lower it"
               if sim.get("phase") == "rollout" and sim["peak_bytes"] > limit else "")
    why = (f"auto: {'on' if choice else 'off'} (simulated per-rank peak of the step without it {peak / GB:.1f} GiB "
           f"on {sim['ranks']} rank(s) {'fits' if fits else 'exceeds'} {headroom:.0%} of {device_gb:g} GB devices; "
           f"{where}{rollout})")
    if rollout:
        log.warning("memory: %s", why)
    if choice != formula[0]:
        log.warning("memory: the simulation and the formula disagree on activation checkpointing; simulation: %s; "
                    "formula: %s. Following the simulation.", why, formula[1])
    return choice, why
