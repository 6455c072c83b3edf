"""The lm_head as training uses it: a real module that replaces the model's output ``nn.Linear``
(same parameters, tied ones included) and, given labels, returns per-sequence log-probs
through :func:`rolemrc.objectives.sequence_logprobs` (chunked: never ``[tokens x vocab]``
logits). Without labels it is the plain linear layer, so generation is unchanged. Called as a
module, so FSDP2's hooks gather its weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rolemrc.models import family
from rolemrc.models.kernels import liger_sequence_logprobs
from rolemrc.objectives.logprobs import (SequenceLogProbs, SequenceLogProbsEntropy, sequence_logprobs,
                                         sequence_logprobs_and_entropy)


class LogprobHead(nn.Module):
    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None, chunk_size: int = 1024) -> None:
        super().__init__()
        self.weight = weight  # the model's own parameter (shared with embed_tokens when tied)
        self.bias = bias
        self.chunk_size = chunk_size
        self.kernel = "chunked"  # "liger": Liger's fused linear cross-entropy (model.kernels=liger, rolemrc.models.kernels)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> LogprobHead:
        return cls(linear.weight, linear.bias)

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` on the same parameters (what exports save)."""
        with torch.device("meta"):
            linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear.weight = self.weight
        if self.bias is not None:
            linear.bias = self.bias
        return linear

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None,
                sequence_ids: torch.Tensor | None = None, num_sequences: int | None = None,
                entropy: bool = False, entropy_grad: bool = False
                ) -> torch.Tensor | SequenceLogProbs | SequenceLogProbsEntropy:
        """Logits (no ``labels``), or the summed log-probs and token counts of each sequence
        (``labels`` aligned with ``hidden``; rows are sequences unless ``sequence_ids`` says
        which sequence each position belongs to); ``entropy``: also each sequence's summed
        per-token entropy, from the same tiles (GRPO's ``entropy`` metric), without gradient unless
        ``entropy_grad`` (GRPO's entropy bonus; then the chunked pass, with Liger's kernel too)."""
        if labels is None:
            return F.linear(hidden, self.weight, self.bias)
        if entropy and self.kernel == "liger" and not entropy_grad:  # Liger gives no entropy: a chunked pass, no grad
            with torch.no_grad():
                ent = sequence_logprobs_and_entropy(hidden, self.weight, labels, sequence_ids, self.chunk_size,
                                                    bias=self.bias, num_sequences=num_sequences).entropy
            seq = liger_sequence_logprobs(hidden, self.weight, labels, sequence_ids, bias=self.bias,
                                          num_sequences=num_sequences)
            return SequenceLogProbsEntropy(seq.logps, seq.num_tokens, ent)
        if entropy:
            return sequence_logprobs_and_entropy(hidden, self.weight, labels, sequence_ids, self.chunk_size,
                                                 bias=self.bias, num_sequences=num_sequences, entropy_grad=entropy_grad)
        if self.kernel == "liger":
            return liger_sequence_logprobs(hidden, self.weight, labels, sequence_ids, bias=self.bias,
                                           num_sequences=num_sequences)
        return sequence_logprobs(hidden, self.weight, labels, sequence_ids, self.chunk_size, bias=self.bias,
                                 num_sequences=num_sequences)


def install_logprob_head(model: nn.Module) -> LogprobHead | None:
    """Give ``model`` (a transformers causal LM, maybe PEFT-wrapped) a :class:`LogprobHead`; a
    model without an lm_head (a sequence-classification reward model) is left as it is (None)."""
    base = family.base_model(model)
    head = family.output_head(base)
    if isinstance(head, LogprobHead):
        return head
    if head is None and not hasattr(base, "lm_head"):  # a sequence-classification model (a reward model)
        return None
    if type(head) is not nn.Linear:
        raise TypeError(f"unsupported lm_head type {type(head).__name__}: expected nn.Linear")
    new = LogprobHead.from_linear(head)
    base.set_output_embeddings(new)
    return new


def restore_linear_head(model: nn.Module) -> None:
    """Put a plain ``nn.Linear`` back (exports are plain transformers models)."""
    base = family.base_model(model)
    head = family.output_head(base)
    if isinstance(head, LogprobHead):
        base.set_output_embeddings(head.to_linear())
