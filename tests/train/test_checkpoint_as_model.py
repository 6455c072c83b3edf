"""``model.path`` may name a checkpoint or a run folder this framework wrote: train.py,
evaluate.py and probe.py load its weights (exported once, LoRA merged, reused while the
checkpoint is unchanged). And a saved model's own tokenizer beats the tiny default."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from rolemrc.models.export import export_state
from rolemrc.models.source import hf_model_path, resolve_model_sources
from rolemrc.models.loading import load_model, load_tokenizer
from tests.conftest import ROOT, compose_train
from tests.train.helpers import train_in_process

# The tests share one run (lora_run): on one xdist worker, so it is made once.
pytestmark = pytest.mark.xdist_group("checkpoint_as_model")

RUN = ["trainer.accelerator=cpu", "data.max_length=96", "data.val_fraction=0", "trainer.enable_progress_bar=false",
       "logger=csv", "trainer.max_steps=3", "runtime.checkpoint_every_n_steps=3",
       "model.peft.enabled=true", "model.peft.r=4"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def python(script: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, script, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 3-step LoRA SFT run: .hydra config, checkpoints/last.ckpt, merged export/."""
    run = train_in_process(tmp_path_factory.mktemp("sft") / "run", *RUN)
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "export" / "model.safetensors").is_file()
    return run


def test_a_checkpoint_is_exported_once_and_matches_the_run_export(lora_run: Path) -> None:
    ckpt = lora_run / "checkpoints" / "last.ckpt"
    folder = Path(hf_model_path(str(ckpt)))
    assert folder == lora_run / "exports" / "last"
    got, want = load_file(folder / "model.safetensors"), load_file(lora_run / "export" / "model.safetensors")
    assert got.keys() == want.keys() and not any("lora" in k for k in got)  # merged
    for key in want:
        assert torch.equal(got[key], want[key]), key

    written = (folder / "model.safetensors").stat().st_mtime_ns
    assert hf_model_path(str(ckpt)) == str(folder)
    assert (folder / "model.safetensors").stat().st_mtime_ns == written  # reused, not exported again
    os.utime(ckpt, ns=(ckpt.stat().st_atime_ns, ckpt.stat().st_mtime_ns + 10**9))  # "rewritten"
    assert hf_model_path(str(ckpt)) == str(folder)
    assert (folder / "model.safetensors").stat().st_mtime_ns != written


def test_a_run_folder_means_its_export_else_its_newest_checkpoint(lora_run: Path, tmp_path: Path) -> None:
    assert hf_model_path(str(lora_run)) == str(lora_run / "export")
    bare = tmp_path / "bare"
    shutil.copytree(lora_run, bare, ignore=shutil.ignore_patterns("export", "exports"))
    assert hf_model_path(str(bare)) == str(bare / "exports" / "last")
    assert hf_model_path("Qwen/Qwen2.5-7B") == "Qwen/Qwen2.5-7B"  # hub ids and HF folders pass through
    assert hf_model_path(str(lora_run / "export")) == str(lora_run / "export")


def test_a_checkpoint_outside_a_run_folder_says_what_is_missing(lora_run: Path, tmp_path: Path) -> None:
    stray = tmp_path / "somewhere" / "model.ckpt"
    stray.parent.mkdir()
    shutil.copy(lora_run / "checkpoints" / "last.ckpt", stray)
    with pytest.raises(FileNotFoundError, match=r"no \.hydra/config\.yaml .*export\.py --run-dir"):
        hf_model_path(str(stray))


def test_evaluate_probe_and_dpo_start_from_a_checkpoint(lora_run: Path, tmp_path: Path) -> None:
    ckpt = str(lora_run / "checkpoints" / "last.ckpt")
    out = tmp_path / "eval"
    python("evaluate.py", f"model.path={ckpt}", "limit=2", "generation.max_new_tokens=3", "generation.progress=false",
           "metrics.names=[bleu]", f"out_dir={out}")
    assert len((out / "generations.jsonl").read_text().splitlines()) == 2
    meta = json.loads((out / "metrics.json").read_text())["meta"]
    assert (meta["model"], meta["model_checkpoint"]) == (str(lora_run / "exports" / "last"), ckpt)

    probe = tmp_path / "probe"
    python("probe.py", f"model.path={lora_run}", f"compare.path={ckpt}", "limit=4", f"out_dir={probe}")
    assert (probe / "discrepancy.png").is_file()

    dpo = train_in_process(tmp_path / "dpo", "objective=dpo", f"model.path={ckpt}", "trainer.accelerator=cpu",
                           "data.max_length=160", "data.max_prompt_length=96", "data.val_fraction=0",
                           "trainer.enable_progress_bar=false", "logger=csv", "trainer.max_steps=1",
                           "export.enabled=false")
    assert json.loads((dpo / "run_summary.json").read_text())["steps"] == 1


def test_saved_weights_bring_their_own_tokenizer(tmp_path: Path) -> None:
    """``model=tiny`` (Llama-3 layout tokenizer by default) evaluating a ChatML model's export."""
    qwen = compose_train(["model=tiny_qwen"])
    torch.manual_seed(0)
    model = load_model(qwen.model, load_tokenizer(qwen.model))
    folder = export_state(qwen.model, model.state_dict(), tmp_path / "qwen_export")

    cfg = compose_train([f"model.path={folder}"])  # model=tiny
    assert cfg.model.tokenizer is None
    assert "<|im_start|>" in load_tokenizer(cfg.model).chat_template
    assert "<|start_header_id|>" in load_tokenizer(compose_train([]).model).chat_template  # no path: the asset
    explicit = compose_train([f"model.path={folder}", f"model.tokenizer={compose_train([]).model.tokenizer}"])
    assert "<|start_header_id|>" in load_tokenizer(explicit.model).chat_template  # an explicit choice wins


def test_resolve_model_sources_rewrites_only_what_names_a_checkpoint(lora_run: Path) -> None:
    given = OmegaConf.create({"model": {"path": str(lora_run / "checkpoints" / "last.ckpt")},
                              "compare": {"path": "Qwen/Qwen2.5-7B"}})
    cfg, changed = resolve_model_sources(given, "compare.path")
    assert changed == {"model.path": given.model.path}
    assert given.model.path.endswith("last.ckpt")  # the caller's config is not mutated
    assert cfg.model.path == str(lora_run / "exports" / "last") and cfg.compare.path == "Qwen/Qwen2.5-7B"
    assert json.loads((lora_run / "exports" / "last" / "rolemrc_source.json").read_text())["checkpoint"].endswith(
        "last.ckpt")


@pytest.mark.parametrize("key", ["model.path", "model.tokenizer"])
def test_a_missing_local_folder_is_named_before_anything_loads(train_cfg, key: str) -> None:
    from rolemrc.run.train import run

    with pytest.raises(FileNotFoundError, match=f"{key}=/no/such/model: no such folder"):
        run(train_cfg(f"{key}=/no/such/model"))


def test_ranks_resolving_one_checkpoint_at_once_export_it_once(lora_run: Path, tmp_path: Path) -> None:
    """Every rank of a DDP/FSDP job resolves model.path itself: one exports, the others wait and reuse."""
    run = tmp_path / "run"
    shutil.copytree(lora_run, run, ignore=shutil.ignore_patterns("export", "exports"))
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO); "
            "from rolemrc.models.source import hf_model_path; print(hf_model_path(sys.argv[1]))")
    ranks = [subprocess.Popen([sys.executable, "-c", code, str(run / "checkpoints" / "last.ckpt")], cwd=ROOT, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [rank.communicate(timeout=300) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), [err[-2000:] for _, err in outs]
    assert {out.strip() for out, _ in outs} == {str(run / "exports" / "last")}
    assert sum("exporting it to" in err for _, err in outs) == 1
    assert sum("using its export" in err for _, err in outs) == 1


def test_a_hub_model_missing_offline_names_the_key_and_the_way_out(train_cfg, monkeypatch) -> None:
    from rolemrc.run.train import run

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", "/nonexistent-hf-home")  # an empty cache, whatever this machine holds
    with pytest.raises(OSError, match=r"model.path=Qwen/Qwen2.5-7B: cannot load it .*hf download Qwen/Qwen2.5-7B"):
        run(train_cfg("model=qwen"))


def test_a_run_folder_it_cannot_write_in_exports_to_the_user_cache(lora_run: Path, tmp_path: Path,
                                                                   monkeypatch) -> None:
    run = tmp_path / "theirs"
    shutil.copytree(lora_run, run, ignore=shutil.ignore_patterns("export", "exports"))
    (run / "exports").write_text("not a folder")  # mkdir fails there, as in a read-only run folder
    monkeypatch.setenv("ROLEMRC_CACHE_DIR", str(tmp_path / "cache"))
    folder = Path(hf_model_path(str(run / "checkpoints" / "last.ckpt")))
    assert folder.parent == tmp_path / "cache" / "exports" and folder.name.endswith("-last")
    assert (folder / "model.safetensors").is_file()
    assert hf_model_path(str(run / "checkpoints" / "last.ckpt")) == str(folder)  # and reused
