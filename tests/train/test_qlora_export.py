"""QLoRA runs export and evaluate (issue 34, item 1): by default the adapter is merged into the
base loaded in full precision (``model.dtype``), as LLaMA-Factory and axolotl export QLoRA;
export.py exports its checkpoints merged or as the adapter alone, and evaluate.py takes its
``last.ckpt`` as ``model.path``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rolemrc.models.export import export_state
from rolemrc.models.loading import load_model, load_tokenizer
from tests.conftest import ROOT, compose_train
from tests.train.helpers import train_in_process

pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.xdist_group("qlora_export")  # one base, one run: made once, on one worker

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
       "OMP_NUM_THREADS": "1"}
IDS = torch.tensor([[1, 5, 9, 20, 33, 7, 2, 40]])


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits.float()


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = compose_train([])
    torch.manual_seed(0)
    model = load_model(cfg.model, load_tokenizer(cfg.model))
    return export_state(cfg.model, model.state_dict(), tmp_path_factory.mktemp("base") / "tiny")


@pytest.fixture(scope="module")
def qlora_run(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The README's QLoRA command on ``base``, the default merge_on_export (true)."""
    return train_in_process(tmp_path_factory.mktemp("qlora") / "run", f"model.path={base}",
                            "model.quantization.load_in_4bit=true", "model.peft.enabled=true", "model.peft.r=4",
                            "model.quantization.compute_dtype=float32", "trainer.accelerator=cpu",
                            "data.max_length=96", "data.val_fraction=0", "trainer.enable_progress_bar=false",
                            "logger=csv", "optim.lr=2e-2", "optim.warmup_ratio=0", "trainer.max_steps=2")


def test_qlora_merges_into_the_full_precision_base(base: Path, qlora_run: Path, tmp_path: Path) -> None:
    from peft import AutoPeftModelForCausalLM

    export = qlora_run / "export"
    merged = AutoModelForCausalLM.from_pretrained(export)
    assert not (export / "adapter_config.json").exists() and merged.dtype == torch.float32
    assert not any("lora" in n or "absmax" in n for n, _ in merged.named_parameters())
    base_model = AutoModelForCausalLM.from_pretrained(base)
    assert not torch.allclose(logits(merged), logits(base_model), atol=1e-4)  # the adapter is in it
    # export.py --adapter: the adapter alone, naming the full-precision base; peft loads it, and it
    # gives the merged export's logits.
    adapter = tmp_path / "adapter"
    done = subprocess.run([sys.executable, "export.py", str(qlora_run), "--out", str(adapter), "--adapter"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve())
    torch.testing.assert_close(logits(AutoPeftModelForCausalLM.from_pretrained(str(adapter))), logits(merged),
                               atol=1e-5, rtol=1e-5)


def test_qlora_checkpoints_export_and_evaluate(qlora_run: Path, tmp_path: Path) -> None:
    from rolemrc.eval.run import run as evaluate
    from tests.eval.test_evaluate_run import compose_eval

    out = tmp_path / "merged"
    done = subprocess.run([sys.executable, "export.py", str(qlora_run / "checkpoints" / "last.ckpt"), "--out",
                           str(out)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(out)),
                               logits(AutoModelForCausalLM.from_pretrained(qlora_run / "export")), atol=1e-5, rtol=1e-5)
    evaluated = tmp_path / "eval"
    evaluate(compose_eval(f"model.path={qlora_run / 'checkpoints' / 'last.ckpt'}", "limit=1",
                          "generation.max_new_tokens=2", "generation.progress=false", "metrics.names=[bleu]",
                          f"out_dir={evaluated}"))
    assert len((evaluated / "generations.jsonl").read_text().splitlines()) == 1
