"""The generation layer: every engine that continues token ids, and the one protocol they follow
(:class:`~rolemrc.rollout.engine.Engine`: ``sync(model, step)``, ``generate(prompts, n, seeds,
sampling)``, ``close()``; :class:`~rolemrc.rollout.engine.Sampling`: greedy or sampled).

- ``hf`` (``hf.py``): transformers ``generate`` in this process, the only call of it in rolemrc
  (GRPO's rollouts and validation, evaluation's ``hf`` backend, the local judge, the judge-scores
  callback, the memory simulation's rollout phase).
- ``server`` and ``colocate`` (``vllm.py``): vLLM, from an OpenAI-compatible server or ``vllm.LLM``
  in this process (built there only, also for evaluation's ``vllm`` backend), the policy's weights
  synced before every rollout (``weights.py``: full tensors under HF names, LoRA merged or as an adapter).

GRPO picks its engine by name from :data:`ENGINES` (:func:`engine_name`: ``objective.rollout``, and
``objective.vllm.mode`` for vLLM); each class's ``build(objective, **kwargs)`` takes what it needs of
``kwargs``. The registry lives with the objectives' settings (``rolemrc.config_objectives``, no torch
there: the values ``objective.rollout`` takes are read from it), each entry the engine's import path.
``sampler.py``: the one-turn rollout on them (:class:`TurnSampler`, its RNG saved in checkpoints;
:func:`padded` lays rows out as ``generate``'s ``[N, C]`` tensor); ``reuse.py``: the step's rollouts
between its micro-batches and their reuse over ``num_iterations`` steps (:class:`RolloutReuse`).
"""

from __future__ import annotations

import importlib
from typing import Any

from rolemrc.config_objectives import ENGINES
from rolemrc.rollout.engine import Engine, Sampling
from rolemrc.rollout.hf import HFEngine
from rolemrc.rollout.sampler import SamplingRNG, TurnSampler, padded
from rolemrc.rollout.vllm import ColocateEngine, RolloutError, ServerEngine

__all__ = ["ENGINES", "ColocateEngine", "Engine", "HFEngine", "RolloutError", "Sampling", "SamplingRNG",
           "ServerEngine", "TurnSampler", "engine_class", "engine_name", "make_engine", "padded"]


def engine_name(objective: Any) -> str:
    """``objective.rollout`` (``hf``), or vLLM's ``objective.vllm.mode`` (``server``, ``colocate``)."""
    return objective.vllm.mode if objective.rollout == "vllm" else objective.rollout


def engine_class(name: str) -> Any:
    """The class :data:`ENGINES` names ``name`` by (``"package.module:Class"``, imported here)."""
    module, _, cls = ENGINES.get(name).partition(":")
    return getattr(importlib.import_module(module), cls)


def make_engine(objective: Any, **kwargs: Any) -> Engine:
    """The engine :func:`engine_name` names; ``kwargs``: those its class takes (the others are ignored)."""
    return engine_class(engine_name(objective)).build(objective, **kwargs)
