"""The chunked log-prob function against full-logits references: values, gradients, edge cases."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rolemrc.objectives import sequence_logprobs, shift_labels, token_logprobs, token_nll
from tests.objectives.oracle import naive_token_logprobs

B, T, H, V = 3, 11, 16, 37


def make_case(dtype: torch.dtype, *, with_bias: bool = False, seed: int = 0, scale: float = 1.0):
    """Random hidden [B, T, H], weight [V, H], bias [V] | None, labels [B, T] with masked spans."""
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(B, T, H, generator=gen) * scale).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) / H**0.5).to(dtype).requires_grad_()
    bias = torch.randn(V, generator=gen).to(dtype).requires_grad_() if with_bias else None
    labels = torch.randint(0, V, (B, T), generator=gen)
    labels[0, :4] = -100  # a prompt
    labels[1, -3:] = -100  # padding
    labels[2, 5] = -100  # a hole in the middle
    return hidden, weight, bias, labels


def grads(out: torch.Tensor, upstream: torch.Tensor, inputs: list[torch.Tensor]):
    return torch.autograd.grad((out * upstream).sum(), inputs)


# (chunk_size, vocab_chunk_size): single-row tiles, ragged tiles, one tile bigger than N and V.
CHUNKS = [(1, 5), (4, 16), (7, 37), (10_000, 10_000)]


@pytest.mark.parametrize("chunk_size,vocab_chunk_size", CHUNKS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_values_and_grads_match_full_logits(chunk_size, vocab_chunk_size, with_bias):
    hidden, weight, bias, labels = make_case(torch.float32, with_bias=with_bias)
    inputs = [hidden, weight] + ([bias] if with_bias else [])

    logps, mask = token_logprobs(
        hidden, weight, labels, chunk_size, bias=bias, vocab_chunk_size=vocab_chunk_size
    )
    ref, ref_mask = naive_token_logprobs(hidden, weight, labels, bias=bias)

    assert logps.dtype == torch.float32 and logps.shape == (int(mask.sum()),)
    assert torch.equal(mask, ref_mask)
    torch.testing.assert_close(logps, ref, atol=1e-5, rtol=1e-5)
    upstream = torch.randn(logps.shape, generator=torch.Generator().manual_seed(1))
    for got, want in zip(grads(logps, upstream, inputs), grads(ref, upstream, inputs)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size,vocab_chunk_size", CHUNKS)
def test_bf16_inputs_computed_in_fp32(chunk_size, vocab_chunk_size):
    hidden, weight, bias, labels = make_case(torch.bfloat16, with_bias=True)
    logps, _ = token_logprobs(
        hidden, weight, labels, chunk_size, bias=bias, vocab_chunk_size=vocab_chunk_size
    )
    # The reference upcasts the same bf16 values to fp32, so values agree to fp32 precision:
    # nothing is rounded to bf16 on the way (a bf16 logits tensor would be off by ~1e-2).
    ref, _ = naive_token_logprobs(hidden, weight, labels, bias=bias)
    assert logps.dtype == torch.float32
    torch.testing.assert_close(logps, ref, atol=1e-5, rtol=1e-5)

    upstream = torch.randn(logps.shape, generator=torch.Generator().manual_seed(1))
    got = grads(logps, upstream, [hidden, weight, bias])
    want = grads(ref, upstream, [hidden, weight, bias])
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16  # grads come back in the parameter's dtype
        torch.testing.assert_close(g, w)  # bf16 tolerances: one rounding at the end


def test_autocast_region_still_computes_in_fp32():
    """bf16-mixed training calls the head inside autocast; its tiles must not drop to bf16."""
    hidden, weight, bias, labels = make_case(torch.float32, with_bias=True, scale=30.0)
    inputs = [hidden, weight, bias]
    ref, _ = naive_token_logprobs(hidden, weight, labels, bias=bias)
    upstream = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logps, _ = token_logprobs(hidden, weight, labels, 4, bias=bias, vocab_chunk_size=8)
        got = grads(logps, upstream, inputs)  # backward inside the region too
    assert logps.dtype == torch.float32
    torch.testing.assert_close(logps, ref, atol=1e-4, rtol=1e-5)
    for g, w in zip(got, grads(ref, upstream, inputs)):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_logits_stay_finite_and_exact(dtype):
    # Logits in the hundreds overflow a naive exp; the per-tile max shift must hold across blocks.
    hidden, weight, _, labels = make_case(dtype, scale=200.0)
    logps, _ = token_logprobs(hidden, weight, labels, 4, vocab_chunk_size=8)
    ref, _ = naive_token_logprobs(hidden.double(), weight.double(), labels)
    assert torch.isfinite(logps).all() and (logps <= 0).all()
    assert logps.dtype == dtype
    # fp32 logits of ~500 carry ~5e-5 absolute round-off; fp64 agrees to its default tolerance.
    tol = {"atol": 1e-3, "rtol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(logps, ref.to(dtype), **tol)


def test_gradcheck_float64():
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 3, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(6, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(6, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = torch.tensor([[1, -100, 5], [0, 2, -100]])

    # float64 inputs are computed in float64, so gradcheck's default tolerances apply; the small
    # chunks make every row and vocabulary tile boundary part of the check.
    def fn(h, w, b):
        return token_logprobs(h, w, labels, 2, bias=b, vocab_chunk_size=4)[0]

    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


def test_no_supervised_tokens_gives_empty_result_and_zero_loss():
    hidden, weight, bias, labels = make_case(torch.float32, with_bias=True)
    labels = torch.full_like(labels, -100)

    logps, mask = token_logprobs(hidden, weight, labels, bias=bias)
    assert logps.shape == (0,) and not mask.any()

    loss = token_nll(logps, mask.sum())  # the SFT loss
    assert loss.item() == 0.0
    loss.backward()  # still attached: DDP ranks with an all-prompt batch can step with the rest
    for t in (hidden, weight, bias):
        assert t.grad is not None and not t.grad.isnan().any() and not t.grad.any()

    seq = sequence_logprobs(hidden, weight, labels)
    assert seq.logps.tolist() == [0.0] * B and seq.num_tokens.tolist() == [0] * B


def test_only_weight_or_only_hidden_requires_grad():
    hidden, weight, _, labels = make_case(torch.float32)
    n = (labels != -100).sum()
    (gh,) = torch.autograd.grad(token_nll(token_logprobs(hidden, weight.detach(), labels)[0], n), [hidden])
    (gw,) = torch.autograd.grad(token_nll(token_logprobs(hidden.detach(), weight, labels)[0], n), [weight])
    rh, rw = torch.autograd.grad(
        -naive_token_logprobs(hidden, weight, labels)[0].mean(), [hidden, weight]
    )
    torch.testing.assert_close(gh, rh)
    torch.testing.assert_close(gw, rw)


def test_sft_loss_equals_cross_entropy_on_unshifted_labels():
    # The Hugging Face convention: labels == input_ids, logits[:, t] predicts labels[:, t + 1].
    hidden, weight, bias, input_labels = make_case(torch.float32, with_bias=True)
    logits = F.linear(hidden, weight, bias)
    want = F.cross_entropy(
        logits[:, :-1].reshape(-1, V), input_labels[:, 1:].reshape(-1), ignore_index=-100
    )
    # the SFT module's route: per-sequence sums over the batch's label tokens
    seq = sequence_logprobs(hidden, weight, shift_labels(input_labels), None, 3, bias=bias, vocab_chunk_size=10)
    torch.testing.assert_close(token_nll(seq.logps, seq.num_tokens.sum()), want)

    logps, mask = token_logprobs(hidden, weight, shift_labels(input_labels), bias=bias)
    per_token = F.cross_entropy(
        logits[:, :-1].reshape(-1, V), input_labels[:, 1:].reshape(-1), ignore_index=-100, reduction="none"
    )
    torch.testing.assert_close(-logps, per_token[shift_labels(input_labels)[:, :-1].reshape(-1) != -100])


def test_shift_labels():
    labels = torch.tensor([[-100, 5, 6, 7, 8, 9]])
    assert shift_labels(labels).tolist() == [[5, 6, 7, 8, 9, -100]]
    # Packed row: sequences 0 (positions 0-2) and 1 (3-5). Position 2 would otherwise learn to
    # predict the first token of sequence 1.
    ids = torch.tensor([[0, 0, 0, 1, 1, -1]])
    assert shift_labels(labels, ids).tolist() == [[5, 6, -100, 8, -100, -100]]


def test_sequence_logprobs_per_row():
    hidden, weight, _, labels = make_case(torch.float32)
    seq = sequence_logprobs(hidden, weight, labels, chunk_size=5)
    ref, mask = naive_token_logprobs(hidden, weight, labels)
    want = torch.zeros(B, T).masked_scatter(mask, ref).sum(1)
    torch.testing.assert_close(seq.logps, want)
    assert seq.num_tokens.tolist() == mask.sum(1).tolist()
    seq.logps.sum().backward()
    assert hidden.grad is not None and weight.grad is not None


def test_sequence_logprobs_packed_segments():
    hidden, weight, _, labels = make_case(torch.float32)
    # Row 0 holds sequences 0 and 1, row 1 holds 2, row 2 holds 3 then padding (-1).
    ids = torch.tensor([[0] * 6 + [1] * 5, [2] * 11, [3] * 8 + [-1] * 3])
    seq = sequence_logprobs(hidden, weight, labels, sequence_ids=ids)

    ref, mask = naive_token_logprobs(hidden, weight, labels)
    per_pos = torch.zeros(B, T).masked_scatter(mask, ref)
    want = torch.stack([(per_pos * (ids == s)).sum() for s in range(4)])
    torch.testing.assert_close(seq.logps, want)
    assert seq.num_tokens.tolist() == [int((mask & (ids == s)).sum()) for s in range(4)]

    # A larger explicit count leaves trailing sequences empty instead of reading the max.
    seq6 = sequence_logprobs(hidden, weight, labels, sequence_ids=ids, num_sequences=6)
    torch.testing.assert_close(seq6.logps[:4], want)
    assert seq6.logps[4:].tolist() == [0.0, 0.0] and seq6.num_tokens[4:].tolist() == [0, 0]


def test_invalid_inputs_raise():
    hidden, weight, _, labels = make_case(torch.float32)
    bad = labels.clone()
    bad[0, 5] = V  # out of the vocabulary
    with pytest.raises(ValueError, match="labels must be in"):
        token_logprobs(hidden, weight, bad)
    with pytest.raises(ValueError, match="labels shape"):
        token_logprobs(hidden, weight, labels[:, :-1])
    with pytest.raises(ValueError, match="chunk sizes"):
        token_logprobs(hidden, weight, labels, 0)
    with pytest.raises(ValueError, match="weight"):
        token_logprobs(hidden, weight[:, :-1], labels)


@pytest.mark.parametrize("chunk_size,vocab_chunk_size", CHUNKS)
@pytest.mark.parametrize("packed", [False, True])
def test_entropy_from_the_same_tiles_equals_trls_on_full_logits(chunk_size, vocab_chunk_size, packed):
    """``sequence_logprobs_and_entropy``: the log-probs and gradients of :func:`sequence_logprobs`,
    and per sequence the summed entropy TRL 1.16's ``entropy_from_logits`` gives on the full logits,
    merged across vocabulary blocks (large logits: the blocks' maxima differ a lot)."""
    from rolemrc.objectives import sequence_logprobs_and_entropy

    trl_utils = pytest.importorskip("trl.trainer.utils")
    hidden, weight, bias, labels = make_case(torch.float64, with_bias=True, scale=4.0)
    ids = None
    if packed:  # two pieces in row 0, one in each other row, and positions of no sequence
        ids = torch.tensor([[0] * 6 + [1] * 5, [2] * 9 + [-1] * 2, [3] * 11])
    kw = dict(bias=bias, vocab_chunk_size=vocab_chunk_size, num_sequences=4 if packed else None)
    both = sequence_logprobs_and_entropy(hidden, weight, labels, ids, chunk_size, **kw)
    plain = sequence_logprobs(hidden, weight, labels, ids, chunk_size, **kw)
    torch.testing.assert_close(both.logps, plain.logps)
    assert torch.equal(both.num_tokens, plain.num_tokens)
    up = torch.randn(plain.logps.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for a, b in zip(grads(both.logps, up, [hidden, weight, bias]), grads(plain.logps, up, [hidden, weight, bias])):
        torch.testing.assert_close(a, b)
    assert not both.entropy.requires_grad

    per_pos = trl_utils.entropy_from_logits(F.linear(hidden, weight, bias).detach())  # [B, T]
    mask = labels != -100
    if ids is None:
        expected = (per_pos * mask).sum(dim=1)
    else:
        expected = torch.stack([(per_pos * (mask & (ids == s))).sum() for s in range(4)])
    torch.testing.assert_close(both.entropy, expected)
    assert (both.entropy > 0).all()


@pytest.mark.parametrize("chunk_size,vocab_chunk_size", CHUNKS)
def test_entropy_gradient_equals_autograd_on_full_logits(chunk_size, vocab_chunk_size):
    """``entropy_grad=True`` (GRPO's ``entropy_coef``): the gradient of any mix of the summed
    log-probs and entropies equals autograd's through ``-sum p log p`` of the full logits, for the
    hidden states, the weight and the bias; without it the entropy has none."""
    from rolemrc.objectives import sequence_logprobs_and_entropy

    hidden, weight, bias, labels = make_case(torch.float64, with_bias=True, scale=4.0)
    got = sequence_logprobs_and_entropy(hidden, weight, labels, None, chunk_size, bias=bias,
                                        vocab_chunk_size=vocab_chunk_size, entropy_grad=True)
    logp_full = torch.log_softmax(F.linear(hidden, weight, bias), dim=-1)
    mask = labels != -100
    ent = -(logp_full.exp() * logp_full).sum(-1)
    picked = logp_full.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    want_ent, want_logps = (ent * mask).sum(1), (picked * mask).sum(1)
    torch.testing.assert_close(got.entropy, want_ent)
    g = torch.Generator().manual_seed(3)
    up_l, up_e = torch.randn(B, generator=g, dtype=torch.float64), torch.randn(B, generator=g, dtype=torch.float64)
    ours = torch.autograd.grad((got.logps * up_l).sum() + (got.entropy * up_e).sum(), [hidden, weight, bias])
    theirs = torch.autograd.grad((want_logps * up_l).sum() + (want_ent * up_e).sum(), [hidden, weight, bias],
                                 retain_graph=True)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)
    only_ent = sequence_logprobs_and_entropy(hidden, weight, labels, None, chunk_size, bias=bias,
                                             vocab_chunk_size=vocab_chunk_size, entropy_grad=True)
    (gh,) = torch.autograd.grad(only_ent.entropy.sum(), [hidden])
    torch.testing.assert_close(gh, torch.autograd.grad(want_ent.sum(), [hidden])[0])


def test_the_head_gives_entropies_with_gradient_from_the_chunked_pass_even_with_liger():
    """``LogprobHead(entropy=True, entropy_grad=True)`` (GRPO's entropy bonus): the chunked pass whatever
    ``model.kernels`` says (Liger's kernel has no entropy), with the entropies' gradient."""
    from torch import nn

    from rolemrc.models.logprob_head import LogprobHead
    from rolemrc.objectives import sequence_logprobs_and_entropy

    hidden, weight, _, labels = make_case(torch.float64)
    head = LogprobHead(nn.Parameter(weight.detach().clone()))
    head.kernel = "liger"  # not installed here: the bonus's path must not need it
    out = head(hidden, labels=labels, entropy=True, entropy_grad=True)
    want = sequence_logprobs_and_entropy(hidden, head.weight, labels, entropy_grad=True)
    torch.testing.assert_close(out.entropy, want.entropy)
    assert out.entropy.requires_grad and out.logps.requires_grad
