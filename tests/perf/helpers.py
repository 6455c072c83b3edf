"""Per-sequence token log-probs of plain and packed batches, keyed so the two can be compared."""

from __future__ import annotations

import torch

from rolemrc.models.forward import policy_hidden
from rolemrc.models.loading import decoder_and_head
from rolemrc.modules.base import PolicyModule
from rolemrc.objectives import shift_labels, token_logprobs


def token_logps(module: PolicyModule, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of the labelled tokens (``[N]``, and their ``[B, T]`` mask), through the
    same forward as training (:func:`policy_hidden`) and the objectives' chunked log-probs."""
    decoder, head = decoder_and_head(module.model)
    hidden = policy_hidden(module.model, decoder, batch, module.packs_with_context())
    labels = shift_labels(batch["labels"], batch.get("sequence_ids"))
    return token_logprobs(hidden, head.weight, labels, bias=head.bias)


def tokens_by_sequence(module: PolicyModule, batch: dict[str, torch.Tensor]) -> dict[tuple[int, int], torch.Tensor]:
    """``(dataset index, side) -> [n] log-probs`` in token order; side 0 = conversation/chosen.

    Plain batches hold one sequence per row (pairs: chosen rows, then rejected rows); packed ones
    name the sequence of every position in ``sequence_ids`` (pairs: j chosen, P + j rejected).
    """
    with torch.no_grad():
        logps, mask = token_logps(module, batch)
    index = batch["index"].tolist()
    n = len(index)
    owner = batch["sequence_ids"][mask] if "sequence_ids" in batch else mask.nonzero()[:, 0]
    out: dict[tuple[int, int], torch.Tensor] = {}
    for sid in owner.unique().tolist():
        out[(index[sid % n], sid // n)] = logps[owner == sid]
    return out


def max_abs_diff(a: dict[tuple[int, int], torch.Tensor], b: dict[tuple[int, int], torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst = 0.0
    for key in a:
        assert a[key].shape == b[key].shape, key
        worst = max(worst, (a[key] - b[key]).abs().max().item())
    return worst


class StopAt:
    """Lightning callback (``+callbacks.stop._target_=tests.perf.helpers.StopAt``): ends the run
    after optimizer step ``step``, as a preemption would, without changing ``max_steps`` (and so
    the learning-rate schedule)."""

    def __new__(cls, step: int):
        import lightning as L

        class _StopAt(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                if trainer.global_step >= step:
                    trainer.should_stop = True

        return _StopAt()
