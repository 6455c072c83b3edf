"""Packed SFT rows and shared-prompt pairs give the per-token log-probs of separate sequences,
for the Llama and Qwen2 architectures and every attention route; rows are filled deterministically."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from rolemrc.config import TrainStep
from rolemrc.data.collate import PackedCollator, PairCollator, SFTCollator
from rolemrc.data.datamodule import ChatDataModule
from rolemrc.data.packing import best_fit_decreasing, item_length, item_pieces, pack_rows
from rolemrc.data.templates import ChatFormat
from rolemrc.objectives import IGNORE_INDEX
from rolemrc.models.loading import load_model, load_tokenizer
from rolemrc.models.family import attention_implementation
from rolemrc.run.build import build_module
from rolemrc.models import packed_attention
from tests.conftest import compose_train
from tests.perf.helpers import max_abs_diff, token_logps, tokens_by_sequence

TOL = 1e-5  # fp32; observed differences are ~1e-7 (kernel summation order)
MODELS = ["tiny", "tiny_qwen"]


@functools.cache
def build(kind: str, model: str, *overrides: str):
    """(module, datamodule, pad id) for the sample data and a fresh tiny model, built once per test
    session: the routes below are forced per call, so sharing a model between tests is safe."""
    cfg = compose_train([f"model={model}", "objective=" + ("sft" if kind == "sft" else "dpo"),
                         "data.max_length=192", "data.max_prompt_length=128", "data.val_fraction=0", *overrides])
    tok = load_tokenizer(cfg.model)
    dm = ChatDataModule(cfg.data, kind, ChatFormat(tok), share_prompt=kind == "pairs" and cfg.objective.share_prompt)
    dm.setup()
    torch.manual_seed(0)
    net = load_model(cfg.model, tok)
    module = build_module(TrainStep.of(cfg), net, dm, run_dir=str(cfg.run_dir))
    return module.eval(), dm, tok.pad_token_id


@pytest.fixture(params=["segments", "mask", "position_ids"])
def route(request, monkeypatch) -> str:
    """Force one attention route: per-piece kernels, the 4-D float additive mask (models whose
    attention cannot be swapped), or flattened rows with position ids only (the flash-attn varlen
    route; with sdpa, transformers itself turns the restarting position ids into a packed mask)."""
    forced = {"segments": None, "mask": "mask", "position_ids": "flash_varlen"}[request.param]
    if forced is not None:
        monkeypatch.setattr(packed_attention, "packed_route", lambda model, need_context, prefer="auto": forced)
    return request.param


def test_best_fit_decreasing_fills_bins_deterministically() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(50, 700) for _ in range(300)] + [1500]  # one longer than a bin
    bins = best_fit_decreasing(lengths, 1024)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert [300] in bins  # the oversized item alone
    assert all(sum(lengths[i] for i in b) <= 1024 for b in bins if b != [300])
    assert sum(lengths[:300]) / (1024 * (len(bins) - 1)) > 0.97  # rows are full
    assert best_fit_decreasing(lengths, 1024) == bins


def test_shared_pair_layout() -> None:
    row = {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6, 7, 8], "index": 0}
    chosen, rejected = item_pieces(row, share_prompt=True)
    assert chosen.ids == [1, 2, 3, 4, 5] and chosen.labels == [IGNORE_INDEX] * 3 + [4, 5]
    # A copy of the last prompt token predicts the first rejected token, at its original position,
    # seeing the rest of the prompt as context.
    assert rejected.ids == [3, 6, 7, 8] and rejected.labels == [IGNORE_INDEX, 6, 7, 8]
    assert rejected.pos0 == 2 and rejected.context == (0, 2) and rejected.side == 1
    assert item_length(row, True) == 9 and item_length(row, False) == 11
    batch = PackedCollator(0, share_prompt=True)([[row, {**row, "index": 1}]])
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 5] * 2
    assert batch["sequence_ids"][0].tolist() == [0] * 5 + [2] * 4 + [1] * 5 + [3] * 4
    assert batch["segments"].tolist() == [[0, 0, 5, 0, 0], [0, 5, 9, 0, 2], [0, 9, 14, 9, 9], [0, 14, 18, 9, 11]]


@pytest.mark.parametrize("model", MODELS)
def test_packed_sft_equals_unpacked(model: str, route: str) -> None:
    module, dm, pad_id = build("sft", model)
    rows = dm.train_rows[:12]
    plain = tokens_by_sequence(module, SFTCollator(pad_id)(rows))
    packs, report = pack_rows(rows, 512)
    assert report["items_per_row"] >= 2
    batch = PackedCollator(pad_id)(packs)
    packed = tokens_by_sequence(module, batch)
    assert max_abs_diff(plain, packed) < TOL
    # Same per-token values, hence the same loss; no piece predicts its neighbour's first token.
    assert sum(v.numel() for v in packed.values()) == sum(x != IGNORE_INDEX for r in rows for x in r["labels"][1:])
    if route == "segments":
        assert packed_attention.packed_route(module.model, False) == "segments"


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("pairs_per_row", [1, 3])
def test_shared_prompt_equals_separate(model: str, pairs_per_row: int, route: str) -> None:
    if route == "position_ids":
        pytest.skip("position ids alone cannot say 'rejected sees the prompt but not chosen'")
    module, dm, pad_id = build("pairs", model, "objective.share_prompt=true")
    rows = dm.train_rows[:6]
    separate = tokens_by_sequence(module, PairCollator(pad_id)(rows))
    items = [rows[i : i + pairs_per_row] for i in range(0, len(rows), pairs_per_row)]
    shared_batch = PackedCollator(pad_id, share_prompt=True)(items)
    shared = tokens_by_sequence(module, shared_batch)
    assert max_abs_diff(separate, shared) < TOL
    # The shared rows are shorter: each prompt once (+1 token), instead of twice.
    assert shared_batch["input_ids"].numel() < PairCollator(pad_id)(rows)["input_ids"].numel()
    # Summed per pair the way the DPO loss sees them: chosen then rejected.
    with torch.no_grad():
        sums, counts = module.pair_logps(module.model, shared_batch)
        ref_sums, ref_counts = module.pair_logps(module.model, PairCollator(pad_id)(rows))
    order = shared_batch["index"].tolist()
    ref_sums = torch.cat([ref_sums[: len(rows)][order], ref_sums[len(rows) :][order]])
    ref_counts = torch.cat([ref_counts[: len(rows)][order], ref_counts[len(rows) :][order]])
    assert torch.equal(counts, ref_counts)
    assert torch.allclose(sums, ref_sums, rtol=1e-6, atol=1e-4)


def test_packed_logps_under_bf16_autocast() -> None:
    """bf16-mixed training runs the chunked lm_head in fp32 (autocast off around it)."""
    module, dm, pad_id = build("sft", "tiny")
    batch = PackedCollator(pad_id)(pack_rows(dm.train_rows[:6], 512)[0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        seq = module.sequence_logps(module.model, batch, batch["index"].shape[0])
        logps, mask = token_logps(module, batch)
    assert seq.logps.dtype == torch.float32 and torch.isfinite(seq.logps).all()
    assert logps.dtype == torch.float32 and torch.isfinite(logps).all() and logps.numel() == mask.sum()


def test_installed_attention_leaves_unpacked_calls_alone(tmp_path) -> None:
    """Batches without a layout (validation, generation) go to the model's own attention, and the
    swap is not saved with the model."""
    cfg = compose_train(["model=tiny_qwen", "model.attn_implementation=eager"])
    tok = load_tokenizer(cfg.model)
    torch.manual_seed(0)
    net = load_model(cfg.model, tok).eval()
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])}
    with torch.no_grad():
        before = net(**batch).logits
        assert packed_attention.packed_route(net, need_context=True) == "segments"
        after = net(**batch).logits
        generated = net.generate(batch["input_ids"][:1], max_new_tokens=3, do_sample=False)
    assert torch.equal(before, after) and generated.shape == (1, 7)
    assert attention_implementation(net) == packed_attention.PREFIX + "eager"
    net.save_pretrained(tmp_path)
    assert "rolemrc" not in (tmp_path / "config.json").read_text()


def test_route_choice_is_overridable_refused_when_impossible_and_logged(caplog) -> None:
    """model.packed_attention: auto picks segments for an sdpa model; mask can be forced; a route
    the model cannot take, or an unknown name, is refused naming the key; the choice is logged once."""
    import logging

    cfg = compose_train(["model=tiny"])
    tok = load_tokenizer(cfg.model)
    net = load_model(cfg.model, tok)
    with caplog.at_level(logging.INFO, logger="rolemrc.models.packed_attention"):
        assert packed_attention.packed_route(net, False) == "segments"
        assert packed_attention.packed_route(net, False) == "segments"
    assert caplog.text.count("packed attention (model.packed_attention=auto): segments") == 1
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rolemrc.models.packed_attention"):
        assert packed_attention.packed_route(net, True, "mask") == "mask"
    assert "packed attention (model.packed_attention=mask): mask" in caplog.text
    with pytest.raises(ValueError, match="model.packed_attention=flash_varlen needs"):
        packed_attention.packed_route(net, False, "flash_varlen")
    with pytest.raises(ValueError, match="must be auto or one of"):
        packed_attention.packed_route(net, False, "flex")


def test_model_packed_attention_reaches_the_forward(train_cfg, caplog) -> None:
    """model.packed_attention=mask trains through the mask route (named in the run's log); an
    unknown value is refused before anything loads."""
    import logging

    from rolemrc.errors import ConfigError
    from rolemrc.run.train import fit, setup

    with pytest.raises(ConfigError, match="model.packed_attention must be one of"):
        setup(train_cfg("model.packed_attention=flex"))
    with caplog.at_level(logging.INFO, logger="rolemrc.models.packed_attention"):
        fit(setup(train_cfg("data.packing=true", "model.packed_attention=mask", "trainer.max_steps=1",
                            "export.enabled=false")))
    assert "packed attention (model.packed_attention=mask): mask" in caplog.text
