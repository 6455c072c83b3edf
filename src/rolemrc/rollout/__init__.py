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
``kwargs``. ``sampler.py``: the one-turn rollout on them (:class:`TurnSampler`, its RNG saved in
checkpoints; :func:`padded` lays rows out as ``generate``'s ``[N, C]`` tensor).
"""

from __future__ import annotations

from typing import Any

from rolemrc.registry import Registry
from rolemrc.rollout.engine import Engine, Sampling
from rolemrc.rollout.hf import HFEngine
from rolemrc.rollout.sampler import SamplingRNG, TurnSampler, padded
from rolemrc.rollout.vllm import ColocateEngine, RolloutError, ServerEngine

__all__ = ["ENGINES", "ColocateEngine", "Engine", "HFEngine", "RolloutError", "Sampling", "SamplingRNG",
           "ServerEngine", "TurnSampler", "engine_name", "make_engine", "padded"]

# engine name -> its class (``build(objective, **kwargs)``)
ENGINES: Registry[Any] = Registry("rollout engine", doc="GRPO's rollout engines, by objective.rollout "
                                  "(hf) or, for objective.rollout=vllm, objective.vllm.mode")
ENGINES.register("hf", HFEngine, doc="transformers generate in this process")
ENGINES.register("server", ServerEngine, doc="a vLLM OpenAI-compatible server, weights synced each step")
ENGINES.register("colocate", ColocateEngine, doc="vllm.LLM in this process, weights loaded each step")


def engine_name(objective: Any) -> str:
    """``objective.rollout`` (``hf``), or vLLM's ``objective.vllm.mode`` (``server``, ``colocate``)."""
    return objective.vllm.mode if objective.rollout == "vllm" else objective.rollout


def make_engine(objective: Any, **kwargs: Any) -> Engine:
    """The engine :func:`engine_name` names; ``kwargs``: those its class takes (the others are ignored)."""
    return ENGINES.get(engine_name(objective)).build(objective, **kwargs)
