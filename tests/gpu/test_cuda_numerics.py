"""On the CUDA device: the chunked log-prob head against full logits, the packed-row attention
routes against unpacked rows, and a bf16-mixed SFT / DPO step against the same step in fp32."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch

from rolemrc.config import TrainStep
from rolemrc.objectives import IGNORE_INDEX
from tests.gpu.conftest import DEVICE, ON_DEVICE
from tests.gpu.helpers import probe, steps


@pytest.fixture(autouse=True)
def _full_fp32_matmuls():
    """fp32 references in full precision (TF32 off), as it was after the test."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


# ---------------------------------------------------------------- the chunked log-prob head

def _full_logits_sums(hidden, weight, labels, seq_ids, n):
    """Per-sequence summed log-probs from the [tokens x vocab] logits (what the head avoids)."""
    logp = torch.log_softmax((hidden.float() @ weight.float().T), dim=-1)
    mask = labels != IGNORE_INDEX
    tok = logp[mask].gather(-1, labels[mask].unsqueeze(-1)).squeeze(-1)
    owner = seq_ids[mask]
    return torch.zeros(n, dtype=torch.float32, device=hidden.device).index_add(0, owner, tok)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprob_head_matches_full_logits(dtype: torch.dtype) -> None:
    """LogprobHead (labels given: chunked, only at labelled positions) gives the full-logits
    per-sequence log-probs and the same gradients for the hidden states and the weight; packed
    rows (sequence ids) included. bf16 inputs: the head computes in fp32, so the reference is fp32
    on the same bf16 values."""
    from rolemrc.models.logprob_head import LogprobHead

    g = torch.Generator(device="cpu").manual_seed(0)
    b, t, h, v = 2, 384, 256, 32000
    hidden = torch.randn(b, t, h, generator=g).to(DEVICE, dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(DEVICE, dtype).requires_grad_()
    labels = torch.randint(0, v, (b, t), generator=g).to(DEVICE)
    labels[:, :100] = IGNORE_INDEX  # a prompt
    labels[1, -20:] = IGNORE_INDEX  # padding
    seq_ids = torch.zeros(b, t, dtype=torch.long, device=DEVICE)
    seq_ids[0, 200:] = 1  # two conversations packed in row 0
    seq_ids[1] = 2
    head = LogprobHead(torch.nn.Parameter(weight.detach().clone()), chunk_size=128)
    head.weight.requires_grad_()
    hid = hidden.detach().clone().requires_grad_()
    got = head(hid, labels=labels, sequence_ids=seq_ids, num_sequences=3)
    want = _full_logits_sums(hidden, weight, labels, seq_ids, 3)
    assert got.logps.dtype == torch.float32 and got.logps.device.type == DEVICE
    assert got.num_tokens.tolist() == [100, 184, 264]
    torch.testing.assert_close(got.logps, want, rtol=1e-5, atol=2e-3)
    upstream = torch.randn(3, generator=g).to(DEVICE)
    (got.logps * upstream).sum().backward()
    (want * upstream).sum().backward()
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-3}
    torch.testing.assert_close(hid.grad.float(), hidden.grad.float(), **tol)
    torch.testing.assert_close(head.weight.grad.float(), weight.grad.float(), **tol)


# ---------------------------------------------------------------- packed rows: the attention routes

@functools.cache
def _sft_module(model: str):
    from rolemrc.run.build import build_module
    from rolemrc.data.datamodule import ChatDataModule
    from rolemrc.data.templates import ChatFormat
    from rolemrc.models.loading import load_model, load_tokenizer
    from tests.conftest import compose_train

    cfg = compose_train([f"model={model}", "objective=sft", "data.max_length=192", "data.val_fraction=0"])
    tok = load_tokenizer(cfg.model)
    dm = ChatDataModule(cfg.data, "sft", ChatFormat(tok), share_prompt=False)
    dm.setup()
    torch.manual_seed(0)
    module = build_module(TrainStep.of(cfg), load_model(cfg.model, tok), dm, run_dir=str(cfg.run_dir)).to(DEVICE).eval()
    return module, dm, tok.pad_token_id


def _on_device(batch: dict) -> dict:
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@pytest.mark.parametrize("model", ["tiny", "tiny_qwen"])
def test_packed_routes_match_unpacked_rows(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-token log-probs of packed rows by the ``segments`` route (sdpa per conversation) and by
    the ``mask`` route (4-D additive mask) equal those of the same conversations unpacked."""
    from rolemrc.data.collate import PackedCollator, SFTCollator
    from rolemrc.data.packing import pack_rows
    from rolemrc.models import packed_attention
    from tests.perf.helpers import max_abs_diff, tokens_by_sequence

    module, dm, pad = _sft_module(model)
    rows = dm.train_rows[:12]
    plain = tokens_by_sequence(module, _on_device(SFTCollator(pad)(rows)))
    packs, report = pack_rows(rows, 512)
    assert report["items_per_row"] >= 2
    packed = _on_device(PackedCollator(pad)(packs))
    assert packed_attention.packed_route(module.model, False) == "segments"
    by_route = {"segments": tokens_by_sequence(module, packed)}
    monkeypatch.setattr(packed_attention, "packed_route", lambda model, need_context, prefer="auto": "mask")
    by_route["mask"] = tokens_by_sequence(module, packed)
    tol = 1e-4 if DEVICE == "cuda" else 1e-5  # fp32; CUDA's sdpa kernels sum in another order per shape
    for route, values in by_route.items():
        assert max_abs_diff(plain, values) < tol, route
    assert sum(v.numel() for v in plain.values()) == sum(
        x != IGNORE_INDEX for r in rows for x in r["labels"][1:])


# ---------------------------------------------------------------- bf16-mixed against fp32

STEP = [*ON_DEVICE, "trainer.enable_progress_bar=false", "callbacks=none", "logger=csv", "data.max_length=256",
        "data.max_prompt_length=192", "data.val_fraction=0", "data.batch_size=4", "trainer.max_steps=1",
        "export.enabled=false", "optim.warmup_ratio=0"]


@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_bf16_mixed_step_matches_fp32(objective: str, tmp_path: Path) -> None:
    """One step with bf16 autocast over fp32 master weights against the same step in fp32 (same
    weights, same batch): loss and gradient norm within bf16's tolerance (8 mantissa bits)."""
    from tests.train.helpers import train_in_process

    extra = ["objective=dpo", "data.packing=false"] if objective == "dpo" else ["data.packing=true"]
    seen = {}
    for precision in ("32-true", "bf16-mixed"):
        out = tmp_path / precision
        train_in_process(out, *STEP, *extra, f"trainer.precision={precision}", *probe(out / "probe.jsonl"))
        seen[precision] = steps(out / "probe.jsonl")[0]
    fp32, bf16 = seen["32-true"], seen["bf16-mixed"]
    assert fp32["device"].startswith(DEVICE) and bf16["device"].startswith(DEVICE)
    assert math.isfinite(bf16["loss"]) and math.isfinite(bf16["grad_norm"]) and fp32["grad_norm"] > 0
    assert bf16["grad_norm"] != fp32["grad_norm"], "the bf16-mixed step ran in fp32"
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=2e-2)
    assert bf16["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=5e-2)
    if objective == "dpo":  # policy = reference at the first step: the sigmoid loss is log 2
        assert fp32["loss"] == pytest.approx(math.log(2), abs=1e-5)
