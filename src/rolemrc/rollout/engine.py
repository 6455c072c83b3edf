"""The engine protocol every generator of token ids follows (GRPO's rollouts, evaluation, the local
judge, the judge-scores callback, the memory simulation), and the sampling settings it takes.

An engine continues given prompts (token ids): it knows nothing of chats or turns, so a rollout of
one turn and one of several are the same calls. ``sync(model, step)`` hands it the policy's current
weights (every rank calls it before a rollout), ``generate(prompts, n, seeds, sampling)`` returns
``n`` continuations per prompt (each prompt's next to each other, each ending at a stop token or
``sampling.max_new_tokens`` long), ``close()`` frees what it holds. Engines are registered by name
in :data:`rolemrc.rollout.ENGINES`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Sampling:
    """How continuations are drawn: greedy (``sample=False``: the checkpoint's generation config
    ignored, no repetition penalty) or sampled with ``temperature``, ``top_p`` and ``top_k`` (0: off)."""

    max_new_tokens: int
    sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @classmethod
    def of(cls, objective: Any) -> "Sampling":
        """An RL objective's sampling keys (``temperature``, ``top_p``, ``top_k``, ``max_completion_length``)."""
        return cls(int(objective.max_completion_length), True, objective.temperature, objective.top_p, objective.top_k)

    def greedy(self) -> "Sampling":
        return Sampling(self.max_new_tokens)

    def hf(self) -> dict[str, Any]:
        """transformers ``generate`` keywords."""
        if not self.sample:
            return dict(max_new_tokens=self.max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                        repetition_penalty=1.0)
        return dict(max_new_tokens=self.max_new_tokens, do_sample=True, temperature=self.temperature,
                    top_p=self.top_p, top_k=self.top_k, repetition_penalty=1.0)

    def vllm(self) -> dict[str, Any]:
        """vLLM ``SamplingParams`` / ``/v1/completions`` fields."""
        if not self.sample:
            return {"temperature": 0, "max_tokens": self.max_new_tokens}
        return {"temperature": float(self.temperature), "top_p": float(self.top_p),
                "top_k": int(self.top_k) if int(self.top_k) > 0 else -1, "max_tokens": self.max_new_tokens}


@runtime_checkable
class Engine(Protocol):
    """What a rollout or an evaluation asks of an engine (see the module docstring)."""

    def sync(self, model: Any, step: int) -> None: ...

    def generate(self, prompts: Sequence[Sequence[int]], n: int, seeds: Sequence[int] | None,
                 sampling: Sampling | None = None) -> list[list[int]]: ...

    def close(self) -> None: ...
