"""SFT on the tiny model: the loss falls, the export loads and generates, runs resume,
LoRA exports merged or as an adapter, bad records stop or are skipped and counted. (Sweeps:
tests/test_config.py, tests/train/test_console_sweep.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rolemrc import asset
from rolemrc.data.schemas import DataError
from rolemrc.run.train import run
from tests.train.helpers import series

QUICK = ["data.max_length=192", "trainer.max_epochs=50"]


def test_sft_loss_falls_and_export_generates(train_cfg) -> None:
    cfg = train_cfg(*QUICK, "trainer.max_steps=40", "optim.lr=3e-3", "data.val_fraction=0.1")
    out = run(cfg)
    losses = series(Path(out["run_dir"]), "train/loss")
    assert len(losses) == 40
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.75 * first, f"loss did not fall enough: {first:.3f} -> {last:.3f}"
    assert series(Path(out["run_dir"]), "val/loss"), "validation loss was not logged"
    report = json.loads((Path(out["run_dir"]) / "data_report_sft.json").read_text())
    assert report["train"]["truncated"] > 0 and 0 < report["train"]["trained_fraction"] < 1

    export = Path(out["export"])
    assert (export / "model.safetensors").exists() and (export / "tokenizer.json").exists()
    model = AutoModelForCausalLM.from_pretrained(export)
    tok = AutoTokenizer.from_pretrained(export)
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": "You are a lighthouse keeper."}, {"role": "user", "content": "Any ships?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    gen = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert gen.shape[1] > prompt["input_ids"].shape[1]
    # The export holds the trained weights: same logits as a second load of the same folder
    # and different from a fresh random init.
    again = AutoModelForCausalLM.from_pretrained(export)
    with torch.no_grad():
        a = model(**prompt).logits
        b = again(**prompt).logits
    assert torch.equal(a, b)


def test_resume_from_last_checkpoint(train_cfg, tmp_path: Path) -> None:
    base = [*QUICK, "callbacks=default", "export.enabled=false", "data.val_fraction=0"]
    first = run(train_cfg(*base, "trainer.max_steps=6"))
    last = Path(first["run_dir"]) / "checkpoints" / "last.ckpt"
    assert last.exists()
    resumed = run(train_cfg(*base, "trainer.max_steps=9", "ckpt_path=last"))
    steps = [int(s) for s in series(Path(resumed["run_dir"]), "step")]
    assert max(steps) == 8 and 6 in steps  # continued at step 6, not from 0
    ckpt = torch.load(last, map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 9


def test_bad_records_stop_or_are_skipped(train_cfg) -> None:
    bad = asset("sample/bad_sft.jsonl")
    with pytest.raises(DataError, match=r"bad_sft.jsonl:3: invalid JSON"):
        run(train_cfg(f"data.sft=[{{path:{bad}}}]", "trainer.max_steps=1"))
    out = run(train_cfg(f"data.sft=[{{path:{bad}}}]", "data.on_error=skip", "trainer.max_steps=2",
                        "data.val_fraction=0", "export.enabled=false"))
    report = json.loads((Path(out["run_dir"]) / "data_report_sft.json").read_text())
    assert report["skipped"] == {bad: 4} and report["train"]["examples"] == 6
    # Each skipped record is named by file:line with its own reason, in file order.
    reasons = [(3, "invalid JSON: "), (5, "missing field 'conversations' (has: task, dialogue)"),
               (7, "conversations[2].role: unknown role 'Narrator'"), (9, "field 'conversations[1].content' is empty")]
    assert len(report["skipped_examples"]) == len(reasons), report["skipped_examples"]
    for shown, (line, reason) in zip(report["skipped_examples"], reasons):
        assert shown.startswith(f"{bad}:{line}: {reason}"), shown


@pytest.mark.parametrize("merge", [True, False])
def test_lora_export(train_cfg, merge: bool) -> None:
    out = run(train_cfg(*QUICK, "model.peft.enabled=true", "model.peft.r=4", "trainer.max_steps=3",
                        f"model.peft.merge_on_export={str(merge).lower()}", "optim.lr=1e-2", "data.val_fraction=0"))
    export = Path(out["export"])
    if merge:
        assert not (export / "adapter_config.json").exists()
        model = AutoModelForCausalLM.from_pretrained(export)
        assert not any("lora" in n for n, _ in model.named_parameters())
    else:
        config = json.loads((export / "adapter_config.json").read_text())
        assert config["r"] == 4 and set(config["target_modules"]) == {"q_proj", "v_proj"}
        assert (export / "adapter_model.safetensors").exists()


def test_qlora_trains_from_an_export(train_cfg, tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes")
    base = run(train_cfg(*QUICK, "trainer.max_steps=1", "data.val_fraction=0"))
    out = run(train_cfg(*QUICK, f"model.path={base['export']}", "model.peft.enabled=true",
                        "model.quantization.load_in_4bit=true", "model.quantization.compute_dtype=float32",
                        "model.peft.merge_on_export=false", "trainer.max_steps=2", "data.val_fraction=0"))
    assert len(series(Path(out["run_dir"]), "train/loss")) == 2


def test_qlora_without_lora_fails_early(train_cfg) -> None:
    with pytest.raises(ValueError, match="peft.enabled=true"):
        run(train_cfg("model.quantization.load_in_4bit=true", "model.path=/x"))


def test_bf16_mixed_precision_trains(train_cfg) -> None:
    out = run(train_cfg(*QUICK, "trainer.precision=bf16-mixed", "trainer.max_steps=3", "data.val_fraction=0",
                        "export.enabled=false"))
    losses = series(Path(out["run_dir"]), "train/loss")
    assert len(losses) == 3 and all(0 < x < 20 for x in losses)
