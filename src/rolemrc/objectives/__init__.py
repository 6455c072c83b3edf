"""Training objectives as pure tensor functions (no Lightning, no transformers model classes).

``logprobs``: memory-lean per-token / per-sequence log-probs from final hidden states + lm_head
weight, and the SFT loss (:func:`token_nll`). ``dpo``: the DPO loss family over per-sequence log-probs,
its reduction to a step's loss (:func:`preference_loss`). The training modules
compute every loss term with these functions.
"""

from rolemrc.objectives.dpo import LOSS_TYPES, DPOOutput, LossType, average_logps, dpo_loss, pair_mean, preference_loss
from rolemrc.objectives.logprobs import (IGNORE_INDEX, SequenceLogProbs, SequenceLogProbsEntropy, sequence_logprobs,
                                         sequence_logprobs_and_entropy, shift_labels, token_logprobs, token_nll)

__all__ = ["IGNORE_INDEX", "LOSS_TYPES", "DPOOutput", "LossType", "SequenceLogProbs", "SequenceLogProbsEntropy",
           "average_logps", "dpo_loss", "pair_mean", "preference_loss", "sequence_logprobs",
           "sequence_logprobs_and_entropy", "shift_labels", "token_logprobs", "token_nll"]
