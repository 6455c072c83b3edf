"""Neuron restraint: scale chosen neurons of a site's output by a factor at inference (facts §6).

A restraint is a list of (layer, neuron) pairs, a site (``mlp_out``, ``attn_out``, ``residual``,
see :mod:`rolemrc.probing.capture`) and a factor (paper: 1 - 1e-6). ``probe.py`` writes it as
``restraint.json``; :func:`load_restraint` turns that file into a context manager that installs
forward hooks on a model, so evaluation runs with it and no weights change:

    with load_restraint("outputs/probe/<time>", model):
        generate(...)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rolemrc.models.family import check_site, decoder_layers, family_of, site_module
from rolemrc.probing.capture import replace_site_tensor, site_tensor

log = logging.getLogger(__name__)

FILENAME = "restraint.json"
PAPER_FACTOR = 1.0 - 1e-6


@dataclass
class Restraint:
    """Which neurons to scale, where, and by how much. ``neurons``: (layer, neuron) pairs."""

    neurons: list[tuple[int, int]]
    site: str = "mlp_out"
    factor: float = PAPER_FACTOR
    selection: dict[str, Any] = field(default_factory=dict)  # how they were chosen (for the record)

    def __post_init__(self) -> None:
        check_site(self.site)
        self.neurons = [(int(layer), int(neuron)) for layer, neuron in self.neurons]
        bad = [p for p in self.neurons if p[0] < 0 or p[1] < 0]
        if bad:
            raise ValueError(f"negative layer/neuron indices in restraint: {bad[:5]}")

    def by_layer(self) -> dict[int, list[int]]:
        """layer -> sorted neuron indices."""
        out: dict[int, set[int]] = {}
        for layer, neuron in self.neurons:
            out.setdefault(layer, set()).add(neuron)
        return {layer: sorted(n) for layer, n in sorted(out.items())}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        if path.is_dir():
            path = path / FILENAME
        path.parent.mkdir(parents=True, exist_ok=True)
        data = asdict(self)
        data["neurons"] = [list(p) for p in self.neurons]
        # One key per line, each value on one line: long neuron lists stay readable and diffable.
        path.write_text("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in data.items()) + "\n}\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Restraint:
        """From ``restraint.json`` or a folder holding one (a ``probe.py`` output folder)."""
        path = Path(path).expanduser()
        if path.is_dir():
            path = path / FILENAME
        if not path.is_file():
            raise FileNotFoundError(f"restraint file not found: {path} (expected a probe.py output folder "
                                    f"or its {FILENAME})")
        data = json.loads(path.read_text())
        missing = {"neurons", "site", "factor"} - set(data)
        if missing:
            raise ValueError(f"{path}: missing keys {sorted(missing)}")
        return cls(neurons=[tuple(p) for p in data["neurons"]], site=data["site"], factor=float(data["factor"]),
                   selection=data.get("selection", {}))


class RestraintHooks:
    """Context manager: while active, every forward of ``model`` multiplies the restrained
    neurons of the site output ([B, T, H], all positions) by the factor; all else is untouched.

    Reentrant use is refused (hooks would stack and scale twice).
    """

    def __init__(self, model: nn.Module, restraint: Restraint) -> None:
        self.model = model
        self.restraint = restraint
        self.layers = decoder_layers(model)
        too_deep = [layer for layer in restraint.by_layer() if layer >= len(self.layers)]
        if too_deep:
            raise ValueError(f"restraint names layers {too_deep} but the model has {len(self.layers)} layers")
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._scales: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}

    def _scale(self, layer: int, like: torch.Tensor) -> torch.Tensor:
        """[H] ones with the factor at the restrained neurons, in ``like``'s dtype and device
        (multiplying by exactly 1.0 leaves every other neuron bit-identical)."""
        key = (layer, like.device, like.dtype)
        if key not in self._scales:
            width = like.shape[-1]
            neurons = self.restraint.by_layer()[layer]
            if neurons[-1] >= width:
                raise ValueError(f"restraint: neuron {neurons[-1]} in layer {layer} but the "
                                 f"{self.restraint.site} output has {width} neurons")
            scale = torch.ones(width, dtype=like.dtype, device=like.device)
            scale[neurons] = self.restraint.factor
            if neurons and bool(scale[neurons[0]] == 1):
                # e.g. 1 - 1e-6 rounds to 1.0 in bfloat16/float16: the restraint would do nothing
                log.warning("restraint factor %r is 1.0 in %s: restraint has no effect at this precision "
                            "(load the model in float32 or use a smaller factor)", self.restraint.factor, like.dtype)
            self._scales[key] = scale
        return self._scales[key]

    def _hook(self, layer: int) -> Callable[[nn.Module, Any, Any], Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            act = site_tensor(output)
            return replace_site_tensor(output, act * self._scale(layer, act))

        return hook

    def __enter__(self) -> RestraintHooks:
        if self._handles:
            raise RuntimeError("restraint hooks are already installed")
        try:
            for layer in self.restraint.by_layer():
                module = site_module(self.layers[layer], self.restraint.site, family_of(self.model))
                self._handles.append(module.register_forward_hook(self._hook(layer)))
        except Exception:
            self.remove()
            raise
        log.info("restraint on: %d neurons in %d layers at %s, factor %r", len(self.restraint.neurons),
                 len(self._handles), self.restraint.site, self.restraint.factor)
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def load_restraint(path: str | Path, model: nn.Module) -> RestraintHooks:
    """``restraint.json`` (or the probe output folder holding it) -> context manager installing
    the restraint hooks on ``model`` for its duration."""
    return RestraintHooks(model, Restraint.load(path))


def restrain(model: nn.Module, neurons: Sequence[tuple[int, int]], site: str = "mlp_out",
             factor: float = PAPER_FACTOR) -> RestraintHooks:
    """Context manager restraining ``neurons`` of ``model`` without a file (e.g. in a callback)."""
    return RestraintHooks(model, Restraint(list(neurons), site, factor))
