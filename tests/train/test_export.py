"""Exporting a state dict (what export.py and FSDP runs do): the weights are loaded into a
meta-device skeleton, and the HF folder computes exactly what the trained model computed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rolemrc.models.export import export_state
from rolemrc.models.loading import load_model, load_tokenizer

LORA = ["model.peft.enabled=true", "model.peft.r=4", "model.peft.alpha=8"]
CASES = {
    "llama": [],
    "qwen2_bias": ["model=tiny_qwen"],
    "tied": ["model.init.tie_word_embeddings=true"],
    "bf16": ["model.dtype=bfloat16"],
    "lora_merged": LORA,
}


def trained_like(cfg) -> torch.nn.Module:
    """A fresh model whose every weight (LoRA B included, zero at init) is non-trivial."""
    torch.manual_seed(0)
    model = load_model(cfg.model, load_tokenizer(cfg.model))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model.eval()


@pytest.mark.parametrize("case", CASES)
def test_exported_model_computes_what_the_state_did(train_cfg, tmp_path: Path, case: str) -> None:
    cfg = train_cfg(*CASES[case])
    model = trained_like(cfg)
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits.float()
    state = {k: v.float().clone() for k, v in model.state_dict().items()}  # e.g. fp32 master weights
    out = export_state(cfg.model, state, tmp_path / "export")

    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert exported.dtype == model.dtype  # cast back to the run's dtype
    assert not any("lora" in n for n, _ in exported.named_parameters())
    if case == "tied":
        assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        got = exported(input_ids=ids).logits.float()
    tol = {"atol": 0.0, "rtol": 0.0} if case != "lora_merged" else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(got, want, **tol)


def test_lora_exports_as_adapter(train_cfg, tmp_path: Path) -> None:
    from peft import PeftModel

    cfg = train_cfg(*LORA)
    model = trained_like(cfg)
    ids = torch.arange(3, 20).unsqueeze(0)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    out = export_state(cfg.model, model.state_dict(), tmp_path / "adapter", merge_lora=False)
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    # The base weights of a random-init tiny model are on disk nowhere: the same seed rebuilds them.
    torch.manual_seed(0)
    base = load_model(train_cfg().model, load_tokenizer(cfg.model))
    with torch.no_grad():
        got = PeftModel.from_pretrained(base, out).eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want)


def test_a_state_that_does_not_fit_the_run_names_the_keys(train_cfg, tmp_path: Path) -> None:
    cfg = train_cfg()
    state = trained_like(cfg).state_dict()
    state.pop("model.norm.weight")
    state["model.extra.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\], unexpected \['model.extra.weight'\]"):
        export_state(cfg.model, state, tmp_path / "export", origin="ckpt.pt")
    assert not (tmp_path / "export").exists()


def test_exports_are_saved_for_inference(train_cfg) -> None:
    """Training turns the KV cache off; the exported config turns it back on (generation, judges)."""
    import json

    from rolemrc.run.train import run

    out = run(train_cfg("trainer.max_steps=0", "data.val_fraction=0"))
    assert json.loads((Path(out["export"]) / "config.json").read_text())["use_cache"] is True
