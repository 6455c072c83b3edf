"""The multi-turn rollout kind on the engines (GRPO's with ``env=<name>``): each seed row's ``n``
conversations with the environment, sampled through :func:`~rolemrc.env.rollout.roll` from a random
stream of the rollout's own that travels in checkpoints (the one-turn kind's
:class:`~rolemrc.rollout.sampler.SamplingRNG`), and laid out as GRPO trains them.

The same two calls as the one-turn kind (:class:`~rolemrc.rollout.sampler.TurnSampler`):
``sample_hf`` (the policy generates every open conversation's next reply in one left-padded batch
per turn, from the stream) and ``sample_engine`` (another engine, the policy's weights synced into
it once, one seed per conversation per turn drawn from the stream), so a resumed run samples what
the uninterrupted one samples; and ``lay_out``, the conversations as GRPO trains them."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from rolemrc.env.base import EnvError, Environment
from rolemrc.env.rollout import Conversation, roll
from rolemrc.objectives import IGNORE_INDEX as IGNORE  # labels outside the role-player's tokens
from rolemrc.rollout.engine import Engine
from rolemrc.rollout.hf import left_padded
from rolemrc.rollout.sampler import SamplingRNG


def seed_rows(batch: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The prompt rows of a collated prompts batch (``prompts``, ``columns``) as environments read them
    (``{"messages", "columns"}``, one per seed)."""
    columns = batch["columns"]
    return [{"messages": list(messages), "columns": {k: v[i] for k, v in columns.items()}}
            for i, messages in enumerate(batch["prompts"])]


class ConversationSampler:
    """``n`` conversations per seed row with ``env`` (see the module docstring); ``stop_ids``: where a
    reply ends; ``max_turns`` / ``max_tokens``: the caps of :func:`roll`; ``rng``: the stream."""

    def __init__(self, n: int, env: Environment, chat: Any, *, stop_ids: Sequence[int], max_turns: int,
                 max_tokens: int | None) -> None:
        self.n, self.env, self.chat, self.rng = n, env, chat, SamplingRNG()
        self.stop_ids, self.max_turns, self.max_tokens = list(stop_ids), int(max_turns), max_tokens
        self.pad_id = chat.tokenizer.pad_token_id if chat.tokenizer.pad_token_id is not None \
            else chat.tokenizer.eos_token_id

    def _episodes(self, batch: Mapping[str, Any]) -> tuple[list[Any], list[list[int]]]:
        """Each seed's ``n`` episodes (each seed's next to each other) and their opening ids (the
        batch's prompt rows, as the data tokenised and cut them)."""
        episodes, openings = [], []
        for i, row in enumerate(seed_rows(batch)):
            ids = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
            for _ in range(self.n):
                try:
                    episodes.append(self.env.reset(row))
                except EnvError as err:
                    raise EnvError(f"prompt {int(batch['index'][i])} of data.prompts: {err}") from None
                openings.append(ids)
        return episodes, openings

    def _roll(self, batch: Mapping[str, Any], generate: Callable[[list[list[int]]], list[list[int]]]) -> tuple[
            list[Conversation], float]:
        episodes, openings = self._episodes(batch)
        start = time.perf_counter()
        convs = roll(episodes, self.chat, generate, stop_ids=self.stop_ids, max_turns=self.max_turns,
                     max_tokens=self.max_tokens, opening_ids=openings)
        return convs, time.perf_counter() - start

    def _cut(self, rows: list[list[int]]) -> list[list[int]]:
        stops = set(self.stop_ids)
        return [row[:next((k + 1 for k, t in enumerate(row) if t in stops), len(row))] for row in rows]

    def sample_hf(self, generate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], batch: Mapping[str, Any],
                  seed: int) -> tuple[list[Conversation], float]:
        """The policy generates (``generate``: left-padded ``[N, P]`` ids and mask -> new ids ``[N, C]``):
        per turn, every open conversation's next reply in one batch, drawn from the stream."""
        device = batch["prompt_ids"].device

        def step(prompts: list[list[int]]) -> list[list[int]]:
            ids, mask = left_padded(prompts, self.pad_id)
            with self.rng.fork(device, seed):
                new = generate(ids.to(device), mask.to(device))
            return self._cut(new.tolist())

        return self._roll(batch, step)

    def sample_engine(self, engine: Engine, model: Any, step: int, batch: Mapping[str, Any], seed: int,
                      pad_id: int | None = None) -> tuple[list[Conversation], float]:
        """Another engine: the policy's weights synced into it once, then per turn one seed per open
        conversation from the stream (``pad_id``: unused, the one-turn kind's argument)."""
        device = batch["prompt_ids"].device
        engine.sync(model, step)

        def turn(prompts: list[list[int]]) -> list[list[int]]:
            with self.rng.fork(device, seed):
                seeds = torch.randint(0, 2**31 - 1, (len(prompts),)).tolist()
            return self._cut(engine.generate(prompts, 1, seeds))

        return self._roll(batch, turn)

    def lay_out(self, convs: Sequence[Conversation], batch: Mapping[str, Any], *, stop_ids: Sequence[int] = (),
                mask_cut: bool = False) -> dict[str, torch.Tensor]:
        """:func:`lay_out` of ``convs`` after the batch's (left-padded) prompt width (``stop_ids``: unused,
        the one-turn kind's argument: each reply already ends where it stopped)."""
        return lay_out(convs, self.pad_id, batch["prompt_ids"].shape[1], mask_cut=mask_cut)


def lay_out(convs: Sequence[Conversation], pad_id: int, prompt_width: int, *,
            mask_cut: bool = False) -> dict[str, torch.Tensor]:
    """Conversations as GRPO trains them: ``input_ids`` ``[N, P + C]`` (each opening prompt left-padded
    to ``prompt_width``, everything after it right-padded to the longest), ``attention_mask`` (over
    all of it), ``labels`` (the role-player's tokens, -100 elsewhere; none in a conversation whose last
    reply was cut when ``mask_cut``, nor in one whose user failed), ``position_ids``; ``model_tokens`` ``[N]`` (the role-player's
    tokens of each), ``cut`` ``[N]``."""
    width = max([len(c.ids) - c.prompt_len for c in convs] + [1])
    n = len(convs)
    ids = torch.full((n, prompt_width + width), int(pad_id), dtype=torch.long)
    attention = torch.zeros_like(ids)
    labels = torch.full_like(ids, IGNORE)
    for i, c in enumerate(convs):
        if c.prompt_len > prompt_width:
            raise ValueError(f"opening prompt of {c.prompt_len} tokens wider than the batch's {prompt_width}")
        start = prompt_width - c.prompt_len
        ids[i, start:prompt_width + len(c.ids) - c.prompt_len] = torch.tensor(c.ids, dtype=torch.long)
        attention[i, start:prompt_width + len(c.ids) - c.prompt_len] = 1
        done, mask = c.completion
        if c.failed or (mask_cut and c.cut):  # the user failed: not scored, not trained
            continue
        trained = torch.tensor(mask, dtype=torch.bool)
        labels[i, prompt_width:prompt_width + len(done)] = torch.where(trained, torch.tensor(done, dtype=torch.long),
                                                                      IGNORE)
    return {"input_ids": ids, "attention_mask": attention, "labels": labels,
            "position_ids": (attention.cumsum(dim=1) - 1).clamp(min=0),
            "model_tokens": torch.tensor([sum(c.completion[1]) for c in convs], dtype=torch.long),
            "cut": torch.tensor([c.cut for c in convs], dtype=torch.bool)}
