"""What a simulation gives back, shared by the simulator (:mod:`rolemrc.sizing.simulate`), the
run's decision (:mod:`rolemrc.sizing.decide`, which reads it from a child process) and the
command line (:mod:`rolemrc.memory`). Imports nothing heavy: no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GIB = 1024**3
HEADROOM = 0.9  # fraction of device memory a run's simulated peak may use (context, NCCL, fragmentation)


class SimulationUnavailable(RuntimeError):
    """The configured run cannot be simulated (the formula of :mod:`rolemrc.sizing.formula` is the fallback)."""


@dataclass
class Simulation:
    """One simulated optimizer step: per-rank peak bytes and their categories (tracker names)."""

    ranks: int
    peak_bytes: int
    by_category: dict[str, int]
    checkpointing: bool
    rows: int  # rows of the micro-batch
    tokens: int  # tokens of the micro-batch (rows x length)
    strategy: str
    tracker: str  # FSDPMemTracker | MemTracker
    after_backward: dict[str, int] = field(default_factory=dict)  # bytes by category once backward is done
    kind: str = "fake"  # fake: FakeTensorMode on a fake process group; else the real backend (gloo)
    note: str = ""  # what of the step is not simulated (the module's memory_note), printed with the report
    phase: str = "step"  # the phase whose peak is peak_bytes: step (forward, backward, AdamW) or rollout
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)  # {phase: {peak_bytes, by_category}}
    rollout: dict[str, Any] = field(default_factory=dict)  # an objective's rollout: sequences, tokens, KV cache bytes

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB


def step_peak(sim: Simulation) -> int:
    """The simulated training step's peak bytes (forward, backward, AdamW), less an objective's
    rollout phase: what activation checkpointing changes."""
    return int(sim.phases["step"]["peak_bytes"]) if "step" in sim.phases else int(sim.peak_bytes)
