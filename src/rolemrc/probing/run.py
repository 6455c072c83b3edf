"""The probing pipeline behind ``python probe.py``: test prompts -> activations of model A (and B)
-> frequency maps -> discrepancy -> figures, summary and a restraint file.

Writes into ``out_dir``: ``maps.npz``, ``freq_a.png`` (``freq_b.png``, ``discrepancy.png``,
``layer_change.png``), ``probe_summary.md`` and, with a compare model, ``restraint.json``.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from rolemrc.parts import build_chat, build_model
from rolemrc.data.readers import read_examples
from rolemrc.data.templates import ChatFormat
from rolemrc.models.paths import check_source
from rolemrc.models.source import resolve_model_sources
from rolemrc.probing.capture import check_site
from rolemrc.tasks import balanced_subset
from rolemrc.probing.maps import (
    ALL,
    DIRECTIONS,
    GROUPS,
    RANK_BY,
    SCOPES,
    SELECT,
    FrequencyMaps,
    compute_frequency_maps,
    discrepancy,
    layer_change,
    save_maps,
    select_neurons,
)
from rolemrc.probing.plots import plot_layer_change, plot_maps
from rolemrc.probing.restraint import Restraint

log = logging.getLogger(__name__)


def resolve_device(name: str | None) -> torch.device:
    """None/"auto": cuda when available, else cpu."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def probing_model_cfg(model_cfg: DictConfig, path: str | None) -> DictConfig:
    """The model config to load for probing: weights from ``path``, no fresh LoRA adapters
    (probing reads exported, merged weights) and no gradient checkpointing (no backward)."""
    check_source(path, "model.path" if path == model_cfg.path else "compare.path")
    overrides: dict[str, Any] = {"peft": {"enabled": False}, "gradient_checkpointing": False}
    if path != model_cfg.path:
        overrides["path"] = path
    return OmegaConf.merge(model_cfg, overrides)


@dataclass(frozen=True)
class Capture:
    """How activations are captured and counted: the keyword arguments of
    :func:`~rolemrc.probing.maps.compute_frequency_maps`, read once from probe.py's config."""

    site: str
    top_fraction: float
    rank_by: str
    batch_size: int
    max_prompt_length: int | None
    progress: bool


def probe_one(capture: Capture, model_cfg: DictConfig, chat: ChatFormat, items: list[Any],
              device: torch.device) -> FrequencyMaps:
    """Load one model, compute its frequency maps on ``items``, free it."""
    start = time.perf_counter()
    model = build_model(model_cfg, chat.tokenizer).to(device)
    try:
        maps = compute_frequency_maps(model, chat, items, **dataclasses.asdict(capture))
    finally:
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    log.info("probed %s (%s): %d cases, %d layers x %d neurons in %.1fs", model_cfg.name,
             model_cfg.path or "random init", len(items), *maps.shape, time.perf_counter() - start)
    return maps


def check_settings(capture: Capture, r: DictConfig, limit: int | None) -> None:
    """Reject bad choices (``r``: the restraint group) before any model is loaded (probing an 8B
    model twice takes a while)."""
    check_site(capture.site)
    for key, value, allowed in (("rank_by", capture.rank_by, RANK_BY), ("restraint.dimension", r.dimension, GROUPS),
                                ("restraint.select", r.select, SELECT), ("restraint.scope", r.scope, SCOPES),
                                ("restraint.direction", r.direction, DIRECTIONS)):
        if value not in allowed:
            raise ValueError(f"{key} must be one of {', '.join(allowed)}; got {value!r}")
    if not 0.0 < capture.top_fraction <= 1.0:
        raise ValueError(f"top_fraction must be in (0, 1], got {capture.top_fraction}")
    if r.layers is not None and (len(r.layers) != 2 or r.layers[0] > r.layers[1]):
        raise ValueError(f"restraint.layers must be [first, last], got {list(r.layers)}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or null, got {limit}")


def run(cfg: DictConfig) -> dict[str, Any]:
    """Probe as configured; return the paths written."""
    capture = Capture(cfg.site, cfg.top_fraction, cfg.rank_by, cfg.batch_size, cfg.max_prompt_length, cfg.progress)
    check_settings(capture, cfg.restraint, cfg.limit)
    cfg, _ = resolve_model_sources(cfg, "compare.path")
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)  # path-less (random-init) models are reproducible

    chat = build_chat(cfg.model)
    items, _ = read_examples(list(cfg.data.test), "test", cfg.data.on_error, cfg.seed)
    if cfg.limit is not None:
        items = balanced_subset(items, cfg.limit)
    device = resolve_device(cfg.device)
    names = (cfg.names.a, cfg.names.b)

    model_a = probing_model_cfg(cfg.model, cfg.model.path)
    model_b = None if cfg.compare.path is None else probing_model_cfg(cfg.model, cfg.compare.path)  # fail early
    maps_a = probe_one(capture, model_a, chat, items, device)
    maps_b = None
    if model_b is not None:
        torch.manual_seed(cfg.seed)
        maps_b = probe_one(capture, model_b, chat, items, device)

    written: dict[str, Any] = {"out_dir": str(out_dir)}
    written["maps"] = str(save_maps(out_dir / "maps.npz", maps_a, maps_b, names))
    setting = f"site {capture.site}, top {capture.top_fraction:.0%} by {capture.rank_by}"
    written["freq_a"] = str(plot_maps(maps_a.freq, out_dir / "freq_a.png", f"Activation frequency, {names[0]} ({setting})"))
    restraint = None
    if maps_b is not None:
        diff = discrepancy(maps_a, maps_b)
        written["freq_b"] = str(plot_maps(maps_b.freq, out_dir / "freq_b.png", f"Activation frequency, {names[1]} ({setting})"))
        written["discrepancy"] = str(plot_maps(diff, out_dir / "discrepancy.png",
                                               f"Discrepancy {names[1]} - {names[0]} ({setting})", diverging=True))
        written["layer_change"] = str(plot_layer_change({g: layer_change(d) for g, d in diff.items()},
                                                        out_dir / "layer_change.png",
                                                        f"Per-layer change, {names[1]} vs {names[0]}"))
        if cfg.restraint.enabled:
            restraint = select_restraint(cfg.restraint, capture, diff)
            written["restraint"] = str(restraint.save(out_dir / "restraint.json"))
    summary = out_dir / "probe_summary.md"
    evaluate = f"python evaluate.py model={cfg.model.name} model.path={cfg.compare.path} data={cfg.data.name}"
    summary.write_text(summary_markdown(capture, names, (cfg.model.path, cfg.compare.path), maps_a, maps_b, restraint,
                                        (evaluate, f"{evaluate} restraint={out_dir.resolve()}")))
    written["summary"] = str(summary)
    log.info("probe outputs in %s", out_dir)
    print(f"probe outputs: {out_dir}")
    return written


def select_restraint(r: DictConfig, capture: Capture, diff: dict[str, np.ndarray]) -> Restraint:
    """The restraint the ``restraint`` group ``r`` asks for: the most-changed neurons of one
    group's discrepancy."""
    if r.dimension not in diff:
        raise ValueError(f"restraint.dimension={r.dimension!r}: no test case of that group was probed "
                         f"(have: {', '.join(diff)})")
    layers = list(r.layers) if r.layers is not None else None
    neurons = select_neurons(diff[r.dimension], select=r.select, k=r.k, fraction=r.fraction, scope=r.scope,
                             layers=layers, direction=r.direction)
    if not neurons:
        log.warning("restraint: no neuron changed in the selected range; restraint.json lists none")
    selection = {k: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for k, v in r.items()
                 if k not in ("enabled", "factor")}
    selection["site"] = capture.site
    selection["top_fraction"] = capture.top_fraction
    selection["changes"] = [round(float(diff[r.dimension][layer, neuron]), 6) for layer, neuron in neurons]
    return Restraint(neurons=neurons, site=capture.site, factor=float(r.factor), selection=selection)


def summary_markdown(capture: Capture, names: tuple[str, str], paths: tuple[str | None, str | None],
                     a: FrequencyMaps, b: FrequencyMaps | None, restraint: Restraint | None,
                     evaluate: tuple[str, str], top_layers: int = 5, top_neurons: int = 10) -> str:
    """``probe_summary.md``: setting, cases per group, the layers that changed most, top neurons.
    ``paths``: model A's and B's weights; ``evaluate``: the commands evaluating B without and
    with the restraint."""
    n_layers, width = a.shape
    lines = [
        "# Neuron probing" + (f": {names[1]} vs {names[0]}" if b is not None else f": {names[0]}"),
        "",
        f"- A ({names[0]}): `{paths[0] or 'random init'}`",
    ]
    if b is not None:
        lines.append(f"- B ({names[1]}): `{paths[1]}`")
    lines += [
        f"- site `{capture.site}`, top {capture.top_fraction:.0%} of {width} neurons per layer "
        f"(ranked by {capture.rank_by}), {n_layers} layers",
        "- test cases per group: " + ", ".join(f"{g} {n}" for g, n in a.n_cases.items()),
        "",
    ]
    if b is None:
        return "\n".join(lines + ["No compare model (compare.path): frequency maps of A only.", ""])
    diff = discrepancy(a, b)
    changes = {g: layer_change(d) for g, d in diff.items()}
    lines += [
        "## Layers that changed most",
        "",
        "Mean |freq B - freq A| over a layer's neurons; most changed first.",
        "",
        "| group | cases | most changed layers | least changed layers |",
        "|---|---|---|---|",
    ]
    for g, c in changes.items():
        order = np.argsort(-c, kind="stable")
        shown = min(top_layers, (n_layers + 1) // 2)  # most and least lists never share a layer
        most = ", ".join(f"{int(i)} ({c[i]:.4f})" for i in order[:shown])
        least = ", ".join(f"{int(i)} ({c[i]:.4f})" for i in order[::-1][:min(shown, n_layers - shown)]) or "-"
        lines.append(f"| {g} | {a.n_cases[g]} | {most} | {least} |")
    lines += ["", "## Per-layer change", "", "| layer | " + " | ".join(changes) + " |",
              "|---|" + "---|" * len(changes)]
    for layer in range(n_layers):
        lines.append(f"| {layer} | " + " | ".join(f"{c[layer]:.4f}" for c in changes.values()) + " |")
    lines += ["", f"## Most changed neurons per group (top {top_neurons} by |change|)", ""]
    for g, d in diff.items():
        top = select_neurons(d, k=top_neurons)
        shown = ", ".join(f"L{layer}/n{neuron} ({d[layer, neuron]:+.3f})" for layer, neuron in top) or "none"
        lines.append(f"- {g}: {shown}")
    if restraint is not None:
        sel = restraint.selection
        lines += [
            "", "## Restraint", "",
            f"`restraint.json`: {len(restraint.neurons)} neurons in {len(restraint.by_layer())} layers, "
            f"site `{restraint.site}`, factor {restraint.factor!r}; chosen from group {sel.get('dimension', ALL)} "
            f"({sel.get('select')}, scope {sel.get('scope')}, direction {sel.get('direction')}, "
            f"layers {sel.get('layers') or 'all'}).",
            "",
            "Before/after (paper Table 6): evaluate B without and with it,",
            "",
            f"    {evaluate[0]}",
            f"    {evaluate[1]}",
        ]
    return "\n".join(lines) + "\n"
