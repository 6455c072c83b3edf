"""The transformers engine: the one place rolemrc calls an HF model's ``generate``.

:func:`hf_generate` is that call (left-padded prompt rows in, the model's output back);
:func:`greedy_generate_ids` batches prompts of any length through it (evaluation, the judge-scores
callback); :class:`HFEngine` is the :class:`~rolemrc.rollout.engine.Engine` of ``objective.rollout=hf``
(the policy itself generates; ``sync`` only points the engine at it)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rolemrc.models.loading import eval_mode
from rolemrc.rollout.engine import Sampling

log = logging.getLogger(__name__)


def pad_id_of(tokenizer: Any) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def stop_token_ids(tokenizer: Any, eot: str | None) -> list[int]:
    """eos plus the chat template's end-of-turn token: a base model fine-tuned on chat data
    ends its turn with ``<|eot_id|>``/``<|im_end|>`` while its eos may be another token."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    if eot:
        eot_ids = tokenizer(eot, add_special_tokens=False)["input_ids"]
        if len(eot_ids) == 1:
            ids.append(int(eot_ids[0]))
        else:
            log.warning("end-of-turn marker %r is %d tokens, not one: generation stops at eos only", eot, len(eot_ids))
    if not ids:
        raise ValueError("the tokenizer has neither an eos token nor a one-token end-of-turn marker to stop at")
    return sorted(set(ids))


def hf_generate(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, sampling: Sampling, *,
                pad_id: int, stop_ids: Any = None, synced_gpus: bool | None = None, **extra: Any) -> Any:
    """transformers ``generate`` on left-padded rows (KV cache on), with ``sampling``'s keywords;
    ``stop_ids``: ``eos_token_id`` (None: the model's own); ``synced_gpus``: every rank runs the same
    number of decoding steps (FSDP2; None: transformers decides); ``extra``: more ``generate``
    keywords. Returns what ``generate`` returns (the prompts' ids followed by the new ones)."""
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, pad_token_id=pad_id, use_cache=True,
                  **sampling.hf(), **extra)
    if stop_ids is not None:
        kwargs["eos_token_id"] = stop_ids
    if synced_gpus is not None:
        kwargs["synced_gpus"] = synced_gpus
    return model.generate(**kwargs)


def new_ids(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, sampling: Sampling,
            **kwargs: Any) -> torch.Tensor:
    """The new token ids ``[N, C]`` after each row (no gradient), padded after the stop token."""
    with torch.no_grad():
        return hf_generate(model, input_ids, attention_mask, sampling, **kwargs)[:, input_ids.shape[1]:]


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt rows as ``(input_ids, attention_mask)``, left-padded to the longest."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        if not ids:
            raise ValueError("empty prompt: nothing to generate from")
        input_ids[row, width - len(ids):] = torch.tensor(list(ids), dtype=torch.long)
        attention[row, width - len(ids):] = 1
    return input_ids, attention


def greedy_generate_ids(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    batch_size: int,
    max_new_tokens: int,
    pad_id: int,
    stop_ids: Sequence[int],
    progress: bool = False,
    on_batch: Callable[[list[int], list[list[int]]], None] | None = None,
    synced_gpus: bool | None = None,
) -> list[list[int]]:
    """Greedy new tokens for each prompt (in input order), each cut after its first stop token.

    Batches are taken from the prompts sorted longest first and left-padded. ``on_batch``
    receives ``(prompt indices, new token ids)`` as each batch finishes.
    """
    from tqdm.auto import tqdm

    if batch_size < 1:
        raise ValueError(f"generation.batch_size must be >= 1, got {batch_size}")
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
    stops = set(int(s) for s in stop_ids)
    sampling = Sampling(max_new_tokens)
    out: list[list[int] | None] = [None] * len(prompts)
    bar = tqdm(total=len(prompts), desc="generate", unit="item", disable=not progress)
    try:
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            input_ids, attention = left_padded([prompts[i] for i in idx], pad_id)
            with torch.inference_mode():
                result = hf_generate(model, input_ids.to(device), attention.to(device), sampling, pad_id=pad_id,
                                     stop_ids=sorted(stops), synced_gpus=synced_gpus)
            new = result[:, input_ids.shape[1]:].tolist()
            batch_out: list[list[int]] = []
            for row, i in enumerate(idx):
                ids = new[row]
                cut = next((k + 1 for k, t in enumerate(ids) if t in stops), len(ids))
                out[i] = ids[:cut]
                batch_out.append(ids[:cut])
            if on_batch is not None:
                on_batch(idx, batch_out)
            bar.update(len(idx))
    finally:
        bar.close()
    assert all(ids is not None for ids in out)
    return out  # type: ignore[return-value]


class HFEngine:
    """``objective.rollout=hf``: the policy generates in the trainer's process. ``sampling``: the
    default settings; ``synced_gpus``: FSDP2 across ranks (see :func:`hf_generate`)."""

    def __init__(self, *, stop_ids: Sequence[int], pad_id: int, sampling: Sampling,
                 synced_gpus: bool | None = None) -> None:
        self.stop_ids, self.pad_id, self.sampling, self.synced_gpus = list(stop_ids), int(pad_id), sampling, synced_gpus
        self.model: Any = None

    @classmethod
    def build(cls, objective: Any, **kwargs: Any) -> "HFEngine":
        return cls(stop_ids=kwargs["stop_ids"], pad_id=kwargs["pad_id"], sampling=Sampling.of(objective),
                   synced_gpus=kwargs.get("synced_gpus"))

    def sync(self, model: Any, step: int) -> None:
        """The policy generates itself: nothing to copy."""
        self.model = model

    def generate_ids(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                     sampling: Sampling | None = None) -> torch.Tensor:
        """New ids ``[N, C]`` after each left-padded row (torch's RNG as the caller set it), in eval mode."""
        with eval_mode(self.model):
            return new_ids(self.model, prompt_ids, prompt_mask, sampling or self.sampling, pad_id=self.pad_id,
                           stop_ids=self.stop_ids, synced_gpus=self.synced_gpus)

    def generate(self, prompts: Sequence[Sequence[int]], n: int, seeds: Sequence[int] | None,
                 sampling: Sampling | None = None) -> list[list[int]]:
        """``n`` continuations per prompt, each cut after its stop token. The rows are sampled together
        from one RNG: torch's, forked and seeded with ``seeds[0]`` when seeds are given."""
        ids, mask = left_padded([p for p in prompts for _ in range(n)], self.pad_id)
        device = next(self.model.parameters()).device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            if seeds:
                torch.manual_seed(int(seeds[0]))
            rows = self.generate_ids(ids.to(device), mask.to(device), sampling).tolist()
        stops = set(self.stop_ids)
        return [row[:next((k + 1 for k, t in enumerate(row) if t in stops), len(row))] for row in rows]

    def close(self) -> None:
        self.model = None
