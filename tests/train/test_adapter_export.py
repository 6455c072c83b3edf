"""LoRA adapter exports name their base model (``peft.AutoPeftModelForCausalLM`` loads them),
export.py can force a merged export of a LoRA run, and an adapter-only export given as
``model.path`` is loaded through peft on its base (or refused in one line when it names none)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rolemrc.errors import ModelSourceError
from rolemrc.models.export import export_state
from rolemrc.models.loading import load_model, load_tokenizer
from rolemrc.models.source import hf_model_path
from tests.conftest import ROOT, compose_train
from tests.train.helpers import train_in_process

# The tests share one base and one run: on one xdist worker, so they are made once.
pytestmark = pytest.mark.xdist_group("adapter_export")

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
       "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
IDS = torch.tensor([[1, 5, 9, 20, 33, 7, 2, 40]])


def python(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, script, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=600)


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits.float()


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model saved to a folder: the base a LoRA run starts from."""
    cfg = compose_train([])
    torch.manual_seed(0)
    model = load_model(cfg.model, load_tokenizer(cfg.model))
    return export_state(cfg.model, model.state_dict(), tmp_path_factory.mktemp("base") / "tiny")


@pytest.fixture(scope="module")
def lora_run(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-step LoRA run on ``base`` exporting the adapter alone."""
    run = train_in_process(tmp_path_factory.mktemp("lora") / "run", f"model.path={base}", "model.peft.enabled=true",
                           "model.peft.r=4", "model.peft.merge_on_export=false", "trainer.accelerator=cpu",
                           "data.max_length=96", "data.val_fraction=0", "trainer.enable_progress_bar=false",
                           "logger=csv", "optim.lr=2e-2", "optim.warmup_ratio=0", "trainer.max_steps=3",
                           "runtime.checkpoint_every_n_steps=3")
    assert (run / "export" / "adapter_config.json").is_file() and not (run / "export" / "config.json").exists()
    return run


def test_the_adapter_names_its_base_and_peft_loads_it(base: Path, lora_run: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from peft import AutoPeftModelForCausalLM

    export = lora_run / "export"
    config = json.loads((export / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve())
    # Nothing shipped (the base is a folder of its own); where it lies from the export is recorded
    relative = os.path.relpath(base.resolve(), export.resolve())
    assert json.loads((export / "rolemrc_base.json").read_text()) == {"base_relative": relative}
    # Export and base moved together, the absolute path gone (another machine): rolemrc finds the base
    far = tmp_path / "far" / Path(*["d"] * (relative.split("/").count("..") - 1)) / "export"
    shutil.copytree(export, far)
    shutil.copytree(base, (far / relative).resolve())
    moved_config = json.loads((far / "adapter_config.json").read_text())
    (far / "adapter_config.json").write_text(json.dumps({**moved_config, "base_model_name_or_path": "/gone/tiny"}))
    from rolemrc.models.adapters import adapter_base
    assert adapter_base(far) == str((far / relative).resolve())
    with_adapter = logits(AutoPeftModelForCausalLM.from_pretrained(str(export)))
    moved = tmp_path / "moved" / "export"  # the export moved; loaded from another working directory
    shutil.copytree(export, moved, ignore=shutil.ignore_patterns("merged*"))
    monkeypatch.chdir(tmp_path)
    torch.testing.assert_close(logits(AutoPeftModelForCausalLM.from_pretrained(str(moved))), with_adapter)

    merged = tmp_path / "merged"  # export.py --merge: merged although the run said merge_on_export=false
    done = python("export.py", str(lora_run / "checkpoints" / "last.ckpt"), "--out", str(merged), "--merge")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (merged / "model.safetensors").is_file() and not (merged / "adapter_config.json").exists()
    from_merged = logits(AutoModelForCausalLM.from_pretrained(merged))
    torch.testing.assert_close(with_adapter, from_merged, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(from_merged, logits(AutoModelForCausalLM.from_pretrained(base)), atol=1e-4)
    # The run folder alone names the same checkpoint (its newest).
    again = python("export.py", str(lora_run), "--out", str(tmp_path / "from_run"), "--merge")
    assert again.returncode == 0, again.stderr[-3000:]
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "from_run")), from_merged)


def test_a_random_init_adapter_carries_its_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The base ships inside the export; adapter_config.json names a content-keyed copy in rolemrc's
    cache (peft reads the name as a path from the working directory): the export folder moved
    elsewhere loads through peft from another working directory, and as evaluate.py's
    ``model.path`` from its shipped copy (rolemrc_base.json), even with the cached copy gone."""
    from peft import AutoPeftModelForCausalLM

    from rolemrc.eval.run import run as evaluate
    from tests.eval.test_evaluate_run import compose_eval

    cfg = compose_train(["model.peft.enabled=true", "model.peft.r=4"])
    torch.manual_seed(0)
    model = load_model(cfg.model, load_tokenizer(cfg.model))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)  # a trained-looking adapter (B starts at zero)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    adapter = export_state(cfg.model, state, tmp_path / "adapter", merge_lora=False)
    merged = export_state(cfg.model, state, tmp_path / "merged", merge_lora=True)
    config = json.loads((adapter / "adapter_config.json").read_text())
    cached = Path(config["base_model_name_or_path"])
    assert cached.is_absolute() and cached.parent == Path(os.environ["ROLEMRC_CACHE_DIR"]).resolve() / "bases"
    assert json.loads((adapter / "rolemrc_base.json").read_text())["shipped_base"] == "base_model"
    assert (adapter / "base_model" / "config.json").is_file()
    assert (cached / "model.safetensors").read_bytes() == (adapter / "base_model" / "model.safetensors").read_bytes()
    moved = tmp_path / "elsewhere" / "export"  # the run folder moved
    moved.parent.mkdir()
    adapter.rename(moved)
    monkeypatch.chdir(tmp_path / "elsewhere")  # neither the export folder nor where it was written
    torch.testing.assert_close(logits(AutoPeftModelForCausalLM.from_pretrained(str(moved))),
                               logits(AutoModelForCausalLM.from_pretrained(merged)), atol=1e-5, rtol=1e-5)
    monkeypatch.chdir(tmp_path)
    shutil.rmtree(cached)  # the cached copy gone (or the folder copied to another machine): the shipped one serves
    out = tmp_path / "eval"
    evaluate(compose_eval(f"model.path={moved}", "limit=1", "generation.max_new_tokens=2", "generation.progress=false",
                          "metrics.names=[bleu]", f"out_dir={out}"))
    assert len((out / "generations.jsonl").read_text().splitlines()) == 1
    # The merge is cached under rolemrc's cache, keyed by content: the export folder is not written
    assert not (moved / "merged").exists() and not (moved / "merged.lock").exists()
    cached_merge = Path(hf_model_path(str(moved)))
    assert cached_merge.parent == Path(os.environ["ROLEMRC_CACHE_DIR"]) / "merged"
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(cached_merge)),
                               logits(AutoModelForCausalLM.from_pretrained(merged)), atol=1e-5, rtol=1e-5)


def test_an_adapter_export_as_model_path(lora_run: Path, tmp_path: Path) -> None:
    export = lora_run / "export"
    out = tmp_path / "eval"
    before = sorted(p.name for p in export.iterdir())
    done = python("evaluate.py", f"model.path={export}", "limit=1", "generation.max_new_tokens=2",
                  "generation.progress=false", "metrics.names=[bleu]", f"out_dir={out}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert len((out / "generations.jsonl").read_text().splitlines()) == 1
    merged = Path(hf_model_path(str(export)))  # merged once through peft on its base, in the cache, reused after
    assert merged.parent == Path(os.environ["ROLEMRC_CACHE_DIR"]) / "merged"
    assert (merged / "model.safetensors").is_file() and (merged / "rolemrc_source.json").is_file()
    assert not (export / "merged").exists() and not (export / "merged.lock").exists()
    assert sorted(p.name for p in export.iterdir()) == before  # the user's export folder: nothing written into it

    nameless = tmp_path / "nameless"  # an adapter export that does not say its base (peft <= 0.21 from elsewhere)
    shutil.copytree(export, nameless, ignore=shutil.ignore_patterns("merged"))
    config = json.loads((nameless / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = None
    (nameless / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelSourceError) as err:  # a UserError: entry scripts print it as one "error:" line
        hf_model_path(str(nameless))
    assert str(err.value).startswith(f"{nameless} is an adapter-only LoRA export whose adapter_config.json "
                                     "names no base model"), str(err.value)
