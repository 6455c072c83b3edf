"""Memory-lean per-token log-probabilities straight from the last hidden states.

A causal LM's logits are ``[B, T, V]``; at a 128k vocabulary and 2k tokens that is 1 GiB in fp32,
and the usual ``log_softmax`` + backward keeps two or three such buffers alive at once. Training
only needs ``log p(label)`` at the supervised positions, so here we:

1. gather the supervised positions first (``hidden[labels != ignore_index]`` -> ``[N, H]``), so
   prompt tokens and padding cost nothing;
2. run a custom autograd function that walks ``[N, V]`` in tiles of ``chunk_size`` rows by
   ``vocab_chunk_size`` vocabulary entries. The forward keeps only each row's logsumexp and its
   target logit (two floats per token); the backward recomputes each tile's logits and turns them
   into ``grad_logits = g * (onehot - softmax)`` for both ``grad_hidden`` and ``grad_weight``.

Tiling the vocabulary as well as the rows matters when the model is bf16: upcasting the whole
``[V, H]`` lm_head to fp32 (or keeping an fp32 ``[V, H]`` grad accumulator) would cost 2 GiB at
128k x 4096 -- more than the logits we set out to avoid. Per vocabulary block we upcast only that
block, and accumulate its weight gradient in fp32 before one cast to the weight's dtype.

All arithmetic is fp32 whatever the input dtype (upcast per tile), also inside an autocast
region (bf16-mixed training), which is switched off around the tiles; results are fp32. (fp64
inputs are computed and returned in fp64, which is what lets a float64 gradcheck test the math.)

Label alignment: every function here takes labels that are ALREADY ALIGNED with ``hidden``, i.e.
``labels[b, t]`` is the token predicted FROM ``hidden[b, t]``. Hugging Face models instead take
unshifted ``labels == input_ids`` and shift internally; callers holding such labels use
:func:`shift_labels` first.

Objectives import no Lightning and no transformers model classes: these are plain tensor functions.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

IGNORE_INDEX = -100

__all__ = ["IGNORE_INDEX", "SequenceLogProbs", "SequenceLogProbsEntropy", "sequence_logprobs",
           "sequence_logprobs_and_entropy", "shift_labels", "token_logprobs", "token_nll"]


def shift_labels(labels: Tensor, sequence_ids: Tensor | None = None, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Align unshifted labels (``labels == input_ids`` style) with the hidden states.

    ``labels: [B, T]`` -> ``[B, T]`` with ``out[:, t] = labels[:, t + 1]`` and ``ignore_index`` in
    the last column. With packed rows, pass ``sequence_ids: [B, T]`` (segment id per position, -1
    for none): positions whose next token belongs to another segment are masked too, so the last
    token of one sequence is never trained to predict the first token of the next.
    """
    out = labels.new_full(labels.shape, ignore_index)
    out[..., :-1] = labels[..., 1:]
    if sequence_ids is not None:
        _check_same_shape(sequence_ids, labels)
        crosses = torch.ones_like(labels, dtype=torch.bool)
        crosses[..., :-1] = (sequence_ids[..., :-1] != sequence_ids[..., 1:]) | (sequence_ids[..., :-1] < 0)
        out = out.masked_fill(crosses, ignore_index)
    return out


def _check_same_shape(sequence_ids: Tensor, labels: Tensor) -> None:
    if sequence_ids.shape != labels.shape:
        raise ValueError(f"sequence_ids shape {tuple(sequence_ids.shape)} != labels shape {tuple(labels.shape)}")


def _check_inputs(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None) -> None:
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"expected hidden [..., H] and weight [V, H]; got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal hidden.shape[:-1] = "
                         f"{tuple(hidden.shape[:-1])}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    if labels.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool):
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    """fp32, or fp64 when an input is fp64 (so float64 gradcheck tests the real math)."""
    return functools.reduce(torch.promote_types, (t.dtype for t in tensors), torch.float32)


def _tile_logits(h_tile: Tensor, w_blk: Tensor, b_blk: Tensor | None) -> Tensor:
    """``[c, H] x [v, H] -> [c, v]`` logits of one tile, in ``w_blk``'s (compute) dtype."""
    h_tile = h_tile.to(w_blk.dtype)
    if b_blk is None:
        return h_tile @ w_blk.T
    return torch.addmm(b_blk, h_tile, w_blk.T)


def _target_logprob_tiles(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, chunk_size: int,
                          vocab_chunk_size: int, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(log p(target) [N], logsumexp [N], entropy [N])`` of the rows' softmax, tile by tile (the
    entropy only ``with_entropy``, else an empty tensor). Autocast off (the caller's business)."""
    # Autocast would run the tile matmuls in bf16 and overflow the fp32 logsumexp bookkeeping.
    n, v = hidden.shape[0], weight.shape[0]
    cdt = _compute_dtype(hidden, weight)
    n_blocks = -(-v // vocab_chunk_size)
    # One logsumexp per (row, vocab block), merged at the end: N * n_blocks floats, tiny.
    block_lse = hidden.new_empty((n, n_blocks), dtype=cdt)
    # Entropy: each block's softmax-weighted mean logit, merged with the blocks' weights at the end
    # (H = lse - sum_v p_v logit_v); one more tile-sized buffer while a tile is open.
    block_mean = hidden.new_empty((n, n_blocks), dtype=cdt) if with_entropy else None
    target_logit = hidden.new_zeros((n,), dtype=cdt)
    for j, v0 in enumerate(range(0, v, vocab_chunk_size)):
        v1 = min(v0 + vocab_chunk_size, v)
        # Upcast one vocabulary block at a time (a no-op view when the weight is fp32).
        w_blk = weight[v0:v1].to(cdt)
        b_blk = None if bias is None else bias[v0:v1].to(cdt)
        for r0 in range(0, n, chunk_size):
            r1 = min(r0 + chunk_size, n)
            tile = _tile_logits(hidden[r0:r1], w_blk, b_blk)
            # Target logit read from the same tile as the logsumexp, so logp <= 0 exactly as
            # log_softmax would give; rows whose target is in another block add 0.
            local = targets[r0:r1] - v0
            in_blk = (local >= 0) & (local < v1 - v0)
            picked = tile.gather(1, local.clamp(0, v1 - v0 - 1).unsqueeze(1)).squeeze(1)
            target_logit[r0:r1] += torch.where(in_blk, picked, 0.0)
            # In-place logsumexp: no second tile-sized buffer.
            row_max = tile.amax(dim=1).clamp_min(torch.finfo(cdt).min)
            tile.sub_(row_max.unsqueeze(1))
            if block_mean is not None:
                e = tile.exp()
                sum_exp = e.sum(dim=1)
                block_mean[r0:r1, j] = e.mul_(tile).sum(dim=1) / sum_exp + row_max
                del e
            else:
                sum_exp = tile.exp_().sum(dim=1)
            block_lse[r0:r1, j] = sum_exp.log_() + row_max
            del tile
        # Free this block's upcast copy before the next one is made, not after (2x peak).
        del w_blk, b_blk
    lse = torch.logsumexp(block_lse, dim=1)
    if block_mean is None:
        entropy = hidden.new_empty((0,), dtype=cdt)
    else:
        entropy = lse - (torch.exp(block_lse - lse.unsqueeze(1)) * block_mean).sum(dim=1)
    return target_logit - lse, lse, entropy


class _LinearTargetLogProb(torch.autograd.Function):
    """``logp[n] = log_softmax(hidden[n] @ weight.T + bias)[targets[n]]`` without ``[N, V]`` logits.

    hidden ``[N, H]``, weight ``[V, H]``, bias ``[V]`` or None, targets ``[N]`` in ``[0, V)``.
    Returns ``[N]`` fp32 (fp64 if an input is fp64), and, ``with_entropy``, the entropy ``[N]`` of
    each row's softmax (else an empty tensor): without gradient, or with it when ``entropy_grad``
    (``dH/dz_v = -p_v (log p_v + H)``, recomputed tile by tile in the backward as the log-probs' is).
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,  # type: ignore[override]
                chunk_size: int, vocab_chunk_size: int, with_entropy: bool = False,
                entropy_grad: bool = False) -> tuple[Tensor, Tensor]:
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            logp, lse, entropy = _target_logprob_tiles(hidden, weight, bias, targets, chunk_size, vocab_chunk_size,
                                                       with_entropy)
        ctx.entropy_grad = with_entropy and entropy_grad
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy if ctx.entropy_grad else None)
        ctx.chunk_size = chunk_size
        ctx.vocab_chunk_size = vocab_chunk_size
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor, grad_entropy: Tensor | None = None):  # type: ignore[override]
        with torch.autocast(device_type=grad_out.device.type, enabled=False):
            return (*_LinearTargetLogProb._backward(ctx, grad_out, grad_entropy), None, None)

    @staticmethod
    def _backward(ctx, grad_out: Tensor, grad_entropy: Tensor | None = None):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n, v = hidden.shape[0], weight.shape[0]
        cdt = lse.dtype
        chunk_size, vocab_chunk_size = ctx.chunk_size, ctx.vocab_chunk_size
        # d logp / d logits = onehot - softmax: build (softmax - onehot) in place, scale by -g.
        neg_g = -grad_out.to(cdt)
        g_ent = grad_entropy.to(cdt) if ctx.entropy_grad and grad_entropy is not None else None

        grad_h_acc = hidden.new_zeros(hidden.shape, dtype=cdt) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        gw_direct = need_w and grad_w.dtype == cdt
        grad_b = torch.empty_like(bias) if need_b else None
        for v0 in range(0, v, vocab_chunk_size):
            v1 = min(v0 + vocab_chunk_size, v)
            w_blk = weight[v0:v1].to(cdt)
            b_blk = None if bias is None else bias[v0:v1].to(cdt)
            gw_blk = None
            if need_w:
                # Weights in the compute dtype: accumulate straight into the output block;
                # otherwise in an fp32 block cast once at the end (one rounding per entry).
                gw_blk = grad_w[v0:v1].zero_() if gw_direct else w_blk.new_zeros(w_blk.shape)
            gb_blk = w_blk.new_zeros((v1 - v0,)) if need_b else None
            for r0 in range(0, n, chunk_size):
                r1 = min(r0 + chunk_size, n)
                h_tile = hidden[r0:r1].to(cdt)
                tile = _tile_logits(h_tile, w_blk, b_blk)
                local = targets[r0:r1] - v0
                in_blk = (local >= 0) & (local < v1 - v0)
                col = local.clamp(0, v1 - v0 - 1).unsqueeze(1)  # the target's column (in_blk: in this block)
                if g_ent is None:
                    tile.sub_(lse[r0:r1].unsqueeze(1)).exp_()  # softmax, using the forward's logsumexp
                    tile.scatter_add_(1, col, -in_blk.to(tile.dtype).unsqueeze(1))
                    tile.mul_(neg_g[r0:r1].unsqueeze(1))  # tile is now grad_logits
                else:  # g (onehot - p) + g_H (-p (log p + H)) = p (-g - g_H (log p + H)) + g onehot
                    tile.sub_(lse[r0:r1].unsqueeze(1))  # log p
                    weight_p = (tile + entropy[r0:r1].unsqueeze(1)).mul_(-g_ent[r0:r1].unsqueeze(1))
                    weight_p.add_(neg_g[r0:r1].unsqueeze(1))
                    tile.exp_().mul_(weight_p)
                    del weight_p
                    tile.scatter_add_(1, col, (-neg_g[r0:r1] * in_blk.to(tile.dtype)).unsqueeze(1))
                if need_h:
                    grad_h_acc[r0:r1].addmm_(tile, w_blk)
                if need_w:
                    gw_blk.addmm_(tile.T, h_tile)
                if need_b:
                    gb_blk += tile.sum(dim=0)
                del tile
            if need_w and not gw_direct:
                grad_w[v0:v1] = gw_blk
            if need_b:
                grad_b[v0:v1] = gb_blk
            del w_blk, b_blk, gw_blk, gb_blk
        grad_h = None if grad_h_acc is None else grad_h_acc.to(hidden.dtype)
        return grad_h, grad_w, grad_b, None, None, None


def _flat_logprobs(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, chunk_size: int,
                   vocab_chunk_size: int, with_entropy: bool = False,
                   entropy_grad: bool = False) -> tuple[Tensor, Tensor]:
    if chunk_size < 1 or vocab_chunk_size < 1:
        raise ValueError(f"chunk sizes must be >= 1, got {chunk_size=} {vocab_chunk_size=}")
    vocab = weight.shape[0]
    # Out-of-range labels would otherwise match no vocabulary block and silently give logp=-lse.
    if targets.numel() and bool(((targets < 0) | (targets >= vocab)).any()):
        bad = targets[(targets < 0) | (targets >= vocab)][:5].tolist()
        raise ValueError(f"labels must be in [0, {vocab}) or the ignore index; found {bad}")
    return _LinearTargetLogProb.apply(hidden, weight, bias, targets.long(), chunk_size, vocab_chunk_size, with_entropy,
                                      entropy_grad)


def token_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int = 1024, *,
                   bias: Tensor | None = None, vocab_chunk_size: int = 8192,
                   ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """Log-probs of the (aligned) labels at the supervised positions.

    hidden ``[B, T, H]`` (decoder output before lm_head, any float dtype), weight ``[V, H]``,
    bias ``[V]`` or None, labels ``[B, T]`` aligned (``labels[b, t]`` is predicted from
    ``hidden[b, t]``; see :func:`shift_labels`), ``ignore_index`` marks unsupervised positions.

    Returns ``(logps [N] fp32, mask [B, T] bool)`` where ``N = mask.sum()`` and ``logps`` follows
    ``mask``'s row-major order (``full[mask] = logps`` scatters them back). ``N == 0`` gives an
    empty ``logps`` that is still attached to the graph (its backward yields zero gradients).
    """
    _check_inputs(hidden, weight, labels, bias)
    mask = labels != ignore_index
    return _flat_logprobs(hidden[mask], weight, bias, labels[mask], chunk_size, vocab_chunk_size)[0], mask


class SequenceLogProbs(NamedTuple):
    """Per-sequence summed log-probs ``[S]`` fp32 and supervised token counts ``[S]`` long."""

    logps: Tensor
    num_tokens: Tensor


def sequence_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, sequence_ids: Tensor | None = None,
                      chunk_size: int = 1024, *, bias: Tensor | None = None, vocab_chunk_size: int = 8192,
                      num_sequences: int | None = None, ignore_index: int = IGNORE_INDEX) -> SequenceLogProbs:
    """Sum of token log-probs per sequence (the DPO policy/reference quantity).

    Without ``sequence_ids`` each batch row is one sequence (``S = B``). For packed rows pass
    ``sequence_ids [B, T]`` long: the segment id of each position of ``hidden`` (the same positions
    as the aligned labels), ``-1`` for none; sums are per id, ``S = num_sequences`` or
    ``max(id) + 1`` (which reads the max back from the device). Positions with id -1 are dropped.

    Returns ``SequenceLogProbs(logps [S] fp32, num_tokens [S] long)``; divide the two for the
    length-normalised log-probs IPO uses.
    """
    sums, counts, _ = _sequence_sums(hidden, weight, labels, sequence_ids, chunk_size, bias, vocab_chunk_size,
                                     num_sequences, ignore_index, with_entropy=False)
    return SequenceLogProbs(sums, counts)


class SequenceLogProbsEntropy(NamedTuple):
    """:class:`SequenceLogProbs` and each sequence's summed per-token entropy ``[S]`` fp32 (with gradient
    only when asked: ``entropy_grad``)."""

    logps: Tensor
    num_tokens: Tensor
    entropy: Tensor


def sequence_logprobs_and_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, sequence_ids: Tensor | None = None,
                                  chunk_size: int = 1024, *, bias: Tensor | None = None, vocab_chunk_size: int = 8192,
                                  num_sequences: int | None = None, ignore_index: int = IGNORE_INDEX,
                                  entropy_grad: bool = False) -> SequenceLogProbsEntropy:
    """:func:`sequence_logprobs` and, from the same tiles, the sum over each sequence's supervised
    positions of the entropy of the next-token distribution (``-sum_v p_v log p_v``; what TRL's
    GRPO logs as ``entropy``, as a token mean). The entropy costs one more tile-sized buffer while
    a tile is open; it carries no gradient unless ``entropy_grad`` (GRPO's entropy bonus,
    ``entropy_coef``: the backward then holds one more tile-sized buffer too)."""
    sums, counts, entropy = _sequence_sums(hidden, weight, labels, sequence_ids, chunk_size, bias, vocab_chunk_size,
                                           num_sequences, ignore_index, with_entropy=True, entropy_grad=entropy_grad)
    assert entropy is not None
    return SequenceLogProbsEntropy(sums, counts, entropy)


def _sequence_sums(hidden: Tensor, weight: Tensor, labels: Tensor, sequence_ids: Tensor | None, chunk_size: int,
                   bias: Tensor | None, vocab_chunk_size: int, num_sequences: int | None, ignore_index: int,
                   with_entropy: bool, entropy_grad: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    _check_inputs(hidden, weight, labels, bias)
    mask = labels != ignore_index
    logps, entropy = _flat_logprobs(hidden[mask], weight, bias, labels[mask], chunk_size, vocab_chunk_size,
                                    with_entropy, entropy_grad)
    if sequence_ids is None:
        if labels.dim() != 2:
            raise ValueError(f"row mode expects labels [B, T], got {tuple(labels.shape)}")

        def add_up(values: Tensor) -> Tensor:
            return values.new_zeros(labels.shape).masked_scatter(mask, values).sum(dim=1)

        counts = mask.sum(dim=1)
    else:
        _check_same_shape(sequence_ids, labels)
        seg = sequence_ids[mask].long()
        if num_sequences is None:
            num_sequences = int(sequence_ids.max().item()) + 1 if sequence_ids.numel() else 0
            num_sequences = max(num_sequences, 0)
        keep = seg >= 0
        # -1 positions are routed to a scratch slot S and dropped, which avoids a data-dependent
        # boolean index (and its device sync) on the log-probs.
        index = torch.where(keep, seg, num_sequences)
        n = num_sequences

        def add_up(values: Tensor) -> Tensor:
            return values.new_zeros(n + 1).index_add(0, index, values)[:n]

        counts = torch.zeros(num_sequences + 1, dtype=torch.long, device=labels.device)
        counts = counts.index_add(0, index, torch.ones_like(index))[:num_sequences]
    # (no view of a shared buffer is returned: FSDP2 hooks the head's outputs)
    return add_up(logps), counts, (add_up(entropy) if with_entropy else None)


def token_nll(logps: Tensor, num_tokens: Tensor | int) -> Tensor:
    """The SFT loss: negative log-likelihood per token, ``-logps.sum() / max(num_tokens, 1)``
    (0.0, not NaN, with no token; still attached to the graph).

    ``logps``: log-probs to add up (per token, per sequence as :func:`sequence_logprobs` sums
    them, or one total). ``num_tokens``: what the sum is divided by. The tokens behind ``logps``
    give their mean; an optimizer step's label tokens, counted over all of its micro-batches and
    ranks, give this micro-batch's share of the step's mean, which is how the training modules
    normalise: the shares add up to the global-batch mean however the batch is cut.
    """
    total = -logps.sum()
    if isinstance(num_tokens, Tensor):
        return total / num_tokens.to(total.dtype).clamp(min=1)
    return total / max(num_tokens, 1)
