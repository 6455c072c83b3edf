"""Optional GPU kernels, never required: ``model.kernels=liger`` (default ``none``).

With ``liger`` (GPU nodes: ``pip install liger-kernel==0.8.5``; its Triton kernels need a CUDA
device), a loaded model gets Liger's fused RMSNorm and SwiGLU modules (patched on the instance)
and RoPE (Liger replaces transformers' ``apply_rotary_pos_emb`` of that architecture, process-wide,
as its ``apply_liger_kernel_to_*`` does), and its :class:`LogprobHead` computes the
log-probs of the labelled positions with Liger's fused linear cross-entropy instead of rolemrc's
chunked one. Both avoid the ``[tokens x vocab]`` logits; Liger's fuses the matmul and the softmax
in Triton. The fused loss is a sum over tokens, so per-sequence log-probs (DPO, and the SFT loss
through the same head) take one call per sequence of the batch.

``liger_kernel`` is imported only here, only when the switch is on. Parity with the default path:
tests/perf/test_liger.py (runs where liger-kernel and a GPU are present, skipped otherwise).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from rolemrc.config import KERNELS
from rolemrc.models import family
from rolemrc.objectives.logprobs import IGNORE_INDEX, SequenceLogProbs


def check_kernels(name: str) -> None:
    """Raise a one-line error when ``model.kernels`` names something unknown or unusable here."""
    if name not in KERNELS:
        raise ValueError(f"model.kernels={name!r}: expected one of {', '.join(KERNELS)}")
    if name == "liger":
        liger_available(raise_why=True)


def liger_available(raise_why: bool = False) -> bool:
    """True when liger-kernel imports and a CUDA device is present (its kernels are Triton)."""
    why = None
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        why = "model.kernels=liger needs liger-kernel, which is not installed (GPU nodes: pip install liger-kernel==0.8.5)"
    else:
        if not torch.cuda.is_available():
            why = "model.kernels=liger needs a CUDA device (Liger's kernels are Triton GPU kernels); use model.kernels=none"
    if why and raise_why:
        raise ValueError(why)
    return why is None


def apply_kernels(model: nn.Module, name: str) -> None:
    """Patch ``model`` (a transformers causal LM, maybe PEFT-wrapped, its LogprobHead installed)."""
    check_kernels(name)
    if name == "none":
        return
    import liger_kernel.transformers as liger

    base = family.base_model(model)
    fam = family.family_of(base)
    patch = fam.liger_patch
    if patch is None or not hasattr(liger, patch):
        supported = sorted(name for name, f in family.FAMILIES.items() if f.liger_patch)
        raise ValueError(f"model.kernels=liger: no Liger kernels for model type {fam.model_type!r} "
                         f"(supported here: {', '.join(supported)}); use model.kernels=none")
    # Only the module kernels: the loss is the LogprobHead's, switched below.
    getattr(liger, patch)(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                          fused_linear_cross_entropy=False, model=base)
    head = family.output_head(base)
    if not hasattr(head, "kernel"):
        raise TypeError(f"model.kernels=liger: expected rolemrc's LogprobHead as the output layer, got {type(head).__name__}")
    head.kernel = "liger"


def liger_sequence_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, sequence_ids: Tensor | None = None, *,
                            bias: Tensor | None = None, num_sequences: int | None = None,
                            ignore_index: int = IGNORE_INDEX) -> SequenceLogProbs:
    """:func:`rolemrc.objectives.sequence_logprobs` (same arguments and result) through Liger's
    fused linear cross-entropy: ``-sum`` of each sequence's token cross-entropies."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    mask = labels != ignore_index
    if sequence_ids is None:  # row mode: each row a sequence
        seg_full = torch.arange(labels.shape[0], device=labels.device).unsqueeze(1).expand_as(labels)
        num = labels.shape[0]
    else:
        if sequence_ids.shape != labels.shape:
            raise ValueError(f"sequence_ids {tuple(sequence_ids.shape)} and labels {tuple(labels.shape)} differ in shape")
        seg_full = sequence_ids.long()
        num = num_sequences if num_sequences is not None else int(sequence_ids.max().item()) + 1 if sequence_ids.numel() else 0
        mask = mask & (seg_full >= 0)
    h = hidden[mask]
    y = labels[mask].long()
    seg = seg_full[mask]
    w, b = weight, bias
    if torch.is_autocast_enabled(h.device.type):  # bf16-mixed: the matmul in the autocast dtype, as F.linear would
        dtype = torch.get_autocast_dtype(h.device.type)
        h, w = h.to(dtype), w.to(dtype)
        b = b.to(dtype) if b is not None else None
    logps = []
    counts = torch.bincount(seg, minlength=num)[:num] if seg.numel() else torch.zeros(num, dtype=torch.long, device=labels.device)
    for s in range(num):
        pick = seg == s
        if not bool(pick.any()):
            logps.append(hidden.new_zeros((), dtype=torch.float32))
            continue
        loss = liger_fused_linear_cross_entropy(h[pick], w, y[pick], bias=b, ignore_index=ignore_index, reduction="sum")
        logps.append(-loss.float())
    values = torch.stack(logps) if logps else hidden.new_zeros(0, dtype=torch.float32)
    return SequenceLogProbs(values, counts.long())
