"""Training objectives as pure tensor functions (no Lightning, no transformers model classes).

``logprobs``: memory-lean per-token / per-sequence log-probs from final hidden states + lm_head
weight, and the SFT loss. ``dpo``: the DPO loss family over per-sequence log-probs and its metrics.
"""

from rolemrc.objectives.dpo import LOSS_TYPES, DPOOutput, LossType, average_logps, dpo_loss, metrics
from rolemrc.objectives.logprobs import (
    IGNORE_INDEX,
    SequenceLogProbs,
    naive_token_logprobs,
    sequence_logprobs,
    sft_loss,
    shift_labels,
    token_logprobs,
)

__all__ = [
    "IGNORE_INDEX",
    "LOSS_TYPES",
    "DPOOutput",
    "LossType",
    "SequenceLogProbs",
    "average_logps",
    "dpo_loss",
    "metrics",
    "naive_token_logprobs",
    "sequence_logprobs",
    "sft_loss",
    "shift_labels",
    "token_logprobs",
]
