"""ORPO: the chosen sequences' NLL plus ``beta`` x the odds-ratio term
(:func:`rolemrc.objectives.orpo.orpo_loss`), reference-free: no reference model is built, loaded
or sharded (its registry entry has ``reference=False``).

``objective.nll_on_prompt`` (default true, as TRL's ORPOTrainer and the authors' code): the NLL
covers the chosen sequence's prompt and response; the prompt's log-probs come from the same
forward and head call (the chosen rows' prompt positions are summed into sequences of their own).
Its token mean is taken over each micro-batch's tokens, as TRL's cross-entropy does, and the
micro-batches of a step are weighted by their pairs; false: the chosen responses' token-mean NLL
over the step's global batch. Logged under TRL's names: ``nll_loss``, ``log_odds_ratio``,
``log_odds_chosen``, ``rewards/*`` (``beta`` x the average log-probs), ``logps/*`` (average log-probs).
"""

from __future__ import annotations

import torch

from rolemrc.modules.base import REWARD_METRICS, PairModule, reward_terms
from rolemrc.objectives.dpo import pair_mean
from rolemrc.objectives.logprobs import IGNORE_INDEX, token_nll
from rolemrc.objectives.orpo import orpo_loss


class ORPOModule(PairModule):
    """``objective``: the orpo node (beta, nll_on_prompt, logprob_chunk_size)."""

    pair_metrics = (*REWARD_METRICS, "log_odds_ratio", "log_odds_chosen")
    val_extra = ("nll_sum", "nll_tokens")

    def trained_labels(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The responses' labels, and with ``nll_on_prompt`` also every attended position of the
        chosen rows (chosen then rejected rows; packed batches are refused)."""
        labels = super().trained_labels(batch)
        if not self.objective.nll_on_prompt:
            return labels
        if "sequence_ids" in batch or "segments" in batch:
            raise ValueError("objective.nll_on_prompt=true needs unpacked pairs: set data.packing=false "
                             "(or objective.nll_on_prompt=false)")
        b = batch["index"].shape[0]
        ids = batch["input_ids"][:b, 1:]
        attended = batch["attention_mask"][:b, 1:].bool() if "attention_mask" in batch else torch.ones_like(ids).bool()
        chosen = labels[:b].clone()
        chosen[:, :-1] = ids.masked_fill(~attended, IGNORE_INDEX)
        return torch.cat([chosen, labels[b:]])

    def _logps(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(summed response log-probs ``[2B]``, their counts ``[2B]``, the chosen sequences' NLL
        log-probs ``[B]`` and token counts ``[B]``) from one forward."""
        b = batch["index"].shape[0]
        if not self.objective.nll_on_prompt:
            logps, counts = self.pair_logps(self.model, batch)
            return logps, counts, logps[:b], counts[:b]
        response = super().trained_labels(batch) != IGNORE_INDEX
        rows = torch.arange(2 * b, device=response.device).unsqueeze(1).expand_as(response)
        # response positions sum into their row (0..2B-1); the chosen rows' other scored positions
        # (the prompt) into 2B + row
        ids = torch.where(response, rows, rows + 2 * b)
        logps, counts = self.sequence_logps(self.model, batch, 3 * b, sequence_ids=ids)
        return logps[:2 * b], counts[:2 * b], logps[:b] + logps[2 * b:], counts[:b] + counts[2 * b:]

    def pair_terms(self, batch: dict[str, torch.Tensor], stage: str) -> dict[str, torch.Tensor]:
        b = batch["index"].shape[0]
        logps, counts, nll_logps, nll_tokens = self._logps(batch)
        out = orpo_loss(logps[:b], logps[b:], counts[:b], counts[b:], beta=self.objective.beta)
        return {**reward_terms(out, logps, counts), "log_odds_ratio": out.log_odds_ratio.detach(),
                "log_odds_chosen": out.log_odds_chosen.detach(), "nll_sum": nll_logps, "nll_tokens": nll_tokens}

    def pair_loss(self, terms: dict[str, torch.Tensor], pairs: torch.Tensor | None = None,
                  chosen_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The chosen NLL plus the mean odds-ratio term; with ``nll_on_prompt`` a micro-batch's NLL is
        its own token mean, weighted by its share of the step's pairs."""
        if pairs is None or self.objective.nll_on_prompt:
            nll = token_nll(terms["nll_sum"], terms["nll_tokens"].sum())
            if pairs is not None:
                nll = nll * terms["nll_tokens"].shape[0] / pairs.to(nll.dtype).clamp(min=1)
        else:
            nll = token_nll(terms["nll_sum"], chosen_tokens)
        return nll + pair_mean(terms["loss"], pairs), {"nll_loss": nll}
