"""Rollout engines for ``objective=grpo`` besides transformers ``generate`` (``objective.rollout=hf``,
in ``rolemrc.modules.grpo``): ``objective.rollout=vllm`` samples with vLLM, from a server
(:class:`~rolemrc.rollout.vllm.ServerEngine`) or colocated in the trainer's process
(:class:`~rolemrc.rollout.vllm.ColocateEngine`), the policy's weights synced before every rollout
(``weights.py``: full tensors under HF names, LoRA merged or as an adapter).

An engine has ``sync(model, step)`` (every rank calls it before the step's rollout), ``generate(prompts,
n, seeds)`` (``n`` completions per prompt, token ids, each prompt's next to each other; ``seeds`` from
the run's sampling RNG, one per prompt) and ``close()``; :func:`padded` lays its rows out as
``generate``'s ``[N, C]`` tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rolemrc.rollout.vllm import ColocateEngine, RolloutError, ServerEngine

__all__ = ["ColocateEngine", "RolloutError", "ServerEngine", "make_engine", "padded"]


def make_engine(objective: Any, **kwargs: Any) -> Any:
    """The engine ``objective.vllm.mode`` names; ``kwargs``: those its class takes."""
    mode = objective.vllm.mode
    if mode == "server":
        keys = ("stop_ids", "vocab", "rank", "broadcast", "run_dir")
        return ServerEngine(objective, **{k: kwargs[k] for k in keys if k in kwargs})
    keys = ("model_path", "tokenizer_path", "stop_ids", "max_model_len", "seed", "world_size")
    return ColocateEngine(objective, **{k: kwargs[k] for k in keys if k in kwargs})


def padded(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Completion rows as one ``[N, C]`` tensor (``C``: the longest row, at least 1), padded after
    each row's end with ``pad_id`` (masked by the caller: after the stop token, as ``generate``'s)."""
    width = max([len(r) for r in rows] + [1])
    out = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            out[i, :len(row)] = torch.tensor(list(row), dtype=torch.long)
    return out.to(device)
