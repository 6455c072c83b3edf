"""The one-turn rollout on the engines (GRPO's): each prompt's ``n`` continuations, drawn from a
random stream of the rollout's own that travels in checkpoints. The engines continue given prompt
ids, so a multi-turn environment is a second rollout kind on the same engines."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from rolemrc.objectives.logprobs import IGNORE_INDEX
from rolemrc.rollout.engine import Engine

RNG_KEY = "grpo_sampling_rng"  # top-level checkpoint entry: the rollout sampler's RNG state


class SamplingRNG:
    """The rollouts' random stream, apart from the global one (dropout, shuffling): ``generate``
    draws inside :meth:`fork`, which swaps this stream's state in and out. Seeded on first use from
    ``seed`` (the run's, ``torch.initial_seed()`` after ``seed_everything``) and the rank; its state
    travels in every checkpoint (a :func:`run_state_parts` part), each rank's its own."""

    per_rank = True  # seeded by rank: every rank's state is saved (rolemrc.run.state.gather_per_rank)

    def __init__(self) -> None:
        self.cpu: torch.Tensor | None = None
        self.cuda: torch.Tensor | None = None

    @contextlib.contextmanager
    def fork(self, device: torch.device, seed: int) -> Iterator[None]:
        cuda = device.type == "cuda"
        with torch.random.fork_rng(devices=[device] if cuda else [], device_type="cuda" if cuda else "cpu"):
            if self.cpu is None:
                torch.manual_seed(seed)
            else:
                torch.set_rng_state(self.cpu)
                if cuda and self.cuda is not None:
                    torch.cuda.set_rng_state(self.cuda, device)
            try:
                yield
            finally:
                self.cpu = torch.get_rng_state()
                self.cuda = torch.cuda.get_rng_state(device) if cuda else self.cuda

    def state_dict(self) -> dict[str, Any]:
        if self.cpu is None:
            return {}
        state = {"cpu": self.cpu}
        if self.cuda is not None:
            state["cuda"] = self.cuda
        return {RNG_KEY: state}

    def load_state_dict(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(RNG_KEY)
        if state:
            self.cpu, self.cuda = state["cpu"], state.get("cuda")


def padded(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Completion rows as one ``[N, C]`` tensor (``C``: the longest row, at least 1), padded after
    each row's end with ``pad_id`` (masked by the caller: after the stop token, as ``generate``'s)."""
    width = max([len(r) for r in rows] + [1])
    out = torch.full((len(rows), width), int(pad_id), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            out[i, :len(row)] = torch.tensor(list(row), dtype=torch.long)
    return out.to(device)


def completion_mask(new_ids: torch.Tensor, stop_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask [N, C], truncated [N])``: 1 on each completion up to and including its first stop token
    (TRL's completion mask), truncated where it has none."""
    is_stop = torch.isin(new_ids, torch.tensor(list(stop_ids), device=new_ids.device))
    has_stop = is_stop.any(dim=1)
    first = torch.where(has_stop, is_stop.int().argmax(dim=1),
                        torch.full_like(has_stop, new_ids.shape[1], dtype=torch.long))
    positions = torch.arange(new_ids.shape[1], device=new_ids.device).expand_as(new_ids)
    return (positions <= first.unsqueeze(1)).long(), ~has_stop


class TurnSampler:
    """The one-turn rollout kind: ``n`` continuations of each left-padded prompt row (``prompt_ids`` /
    ``prompt_mask`` ``[B, P]``), as ``[B x n, C]`` new ids (each prompt's next to each other) and the
    seconds sampling took; ``rng``: the stream they are drawn from, seeded with ``seed`` at first use
    (then continued); :meth:`lay_out` lays the samples out for the loss. The multi-turn kind
    (:class:`rolemrc.env.sampler.ConversationSampler`) has the same three calls."""

    def __init__(self, n: int) -> None:
        self.n, self.rng = n, SamplingRNG()

    def sample_hf(self, generate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], batch: Mapping[str, Any],
                  seed: int) -> tuple[torch.Tensor, float]:
        """The policy generates (``generate``: :class:`~rolemrc.rollout.hf.HFEngine` ``.generate_ids`` on it):
        every row of ``batch`` (``prompt_ids``, ``prompt_mask``) ``n`` times in one batch, from the stream."""
        prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
        ids, mask = prompt_ids.repeat_interleave(self.n, dim=0), prompt_mask.repeat_interleave(self.n, dim=0)
        start = time.perf_counter()
        with self.rng.fork(ids.device, seed):
            new_ids = generate(ids, mask)
        return new_ids, time.perf_counter() - start

    def lay_out(self, new_ids: torch.Tensor, batch: Mapping[str, Any], *, stop_ids: Sequence[int],
                mask_cut: bool = False) -> dict[str, torch.Tensor]:
        """The sampled ``new_ids`` as GRPO trains them: ``input_ids`` ``[N, P + C]`` (each prompt, left-padded
        as the batch holds it, then its completion), ``attention_mask``, ``labels`` (each completion up to
        and including its stop token, -100 elsewhere; none for a truncated one when ``mask_cut``),
        ``position_ids``, ``model_tokens`` ``[N]`` (each completion's length), ``cut`` ``[N]`` (truncated)."""
        prompt_ids = batch["prompt_ids"].repeat_interleave(self.n, dim=0)
        prompt_mask = batch["prompt_mask"].repeat_interleave(self.n, dim=0)
        mask, truncated = completion_mask(new_ids, stop_ids)
        loss_mask = mask * (~truncated).long().unsqueeze(1) if mask_cut else mask
        ids = torch.cat([prompt_ids, new_ids * mask], dim=1)  # pad id after the stop: masked anyway
        attention = torch.cat([prompt_mask, mask], dim=1)
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[:, prompt_ids.shape[1]:] = torch.where(loss_mask.bool(), new_ids, IGNORE_INDEX)
        return {"input_ids": ids, "attention_mask": attention, "labels": labels,
                "position_ids": (attention.cumsum(dim=1) - 1).clamp(min=0), "model_tokens": mask.sum(dim=1),
                "cut": truncated}

    def sample_engine(self, engine: Engine, model: Any, step: int, batch: Mapping[str, Any], seed: int,
                      pad_id: int) -> tuple[torch.Tensor, float]:
        """Another engine: the policy's weights synced into it, then one seed per prompt from the stream
        (a resumed run asks for what the uninterrupted one asks for)."""
        prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
        device = prompt_ids.device
        engine.sync(model, step)
        with self.rng.fork(device, seed):
            seeds = torch.randint(0, 2**31 - 1, (prompt_ids.shape[0],)).tolist()
        prompts = [row[m.bool()].tolist() for row, m in zip(prompt_ids, prompt_mask)]
        start = time.perf_counter()
        rows = engine.generate(prompts, self.n, seeds)
        return padded(rows, pad_id, device), time.perf_counter() - start
