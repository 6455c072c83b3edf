"""Enum-like keys and cross-key rules are refused when the config is checked, naming the key,
before any data or weights load (issue: config checked when composed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rolemrc.config import check_train_config
from rolemrc.errors import ConfigError
from rolemrc.objectives.dpo import LOSS_TYPES
from tests.conftest import ROOT, compose_train

BAD = [
    (["objective=dpo", "objective.loss_type=ipx"], r"objective.loss_type must be one of sigmoid, ipo, hinge, exo_pair, .*, got 'ipx'"),
    (["objective=dpo", "objective.beta=0"], r"objective.beta must be > 0, got 0"),
    (["objective=dpo", "objective.beta=-0.1"], r"objective.beta must be > 0"),
    (["objective=dpo", "objective.label_smoothing=0.5"], r"objective.label_smoothing must be in \[0, 0.5\)"),
    (["objective=dpo", "objective.loss_type=ipo", "objective.label_smoothing=0.1"],
     r"objective.label_smoothing only applies to objective.loss_type=sigmoid\|robust\|exo_pair\|aot\|aot_unpaired, not ipo"),
    (["objective=dpo", "objective.sft_weight=-1"], r"objective.sft_weight must be >= 0"),
    (["objective=dpo", "objective.reference=cached"], r"objective.reference must be one of copy, adapter, precomputed"),
    (["objective=dpo", "objective.reference=adapter"], r"objective.reference=adapter needs a LoRA model"),
    (["optim.scheduler=cosin"], r"optim.scheduler must be one of cosine, linear, constant, got 'cosin'"),
    (["strategy.name=deepspeed"], r"strategy.name must be one of single, ddp, fsdp"),
    (["data.on_error=ignore"], r"data.on_error must be one of raise, skip"),
    (["model.attn_implementation=flash"], r"model.attn_implementation must be one of"),
    (["model.kernels=triton"], r"model.kernels must be one of none, liger"),
    (["model.quantization.load_in_4bit=true"], r"load_in_4bit=true \(QLoRA\) needs model.peft.enabled=true"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_value_is_refused_naming_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_train_config(compose_train(overrides))


@pytest.mark.parametrize("overrides", [
    ["objective=dpo", "objective.loss_type=ipo"],
    ["objective=dpo", "objective.loss_type=hinge", "objective.reference=precomputed"],
    ["objective=dpo", "objective.reference=adapter", "model.peft.enabled=true"],
    ["objective=dpo", "objective.label_smoothing=0.1"],
    ["optim.scheduler=constant", "strategy=ddp", "data.on_error=skip"],
    ["model.peft.enabled=true", "model.quantization.load_in_4bit=true"],
])
def test_good_values_pass(overrides: list[str]) -> None:
    check_train_config(compose_train(overrides))


def test_paper_recipes_pass_the_checks() -> None:
    for name in ("rolemrc_llama_sft", "rolemrc_llama_dpo", "rolemrc_qwen_sft", "rolemrc_qwen_dpo"):
        check_train_config(compose_train([f"experiment={name}"]))


def test_train_py_refuses_before_loading_anything(tmp_path) -> None:
    """Through the entry script: exit 1, one ``error:`` line naming the key, and the run wrote
    no data report (no data was read) and no checkpoint."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "objective=dpo", "objective.loss_type=ipx", "logger=none",
         f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert errors == [f"error: objective.loss_type must be one of {', '.join(LOSS_TYPES)}, got 'ipx'"], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not list(run_dir.glob("data_report_*.json")) and not (run_dir / "checkpoints").exists()


UNKNOWN = [
    (["+data.max_len=10"], r"^data.max_len is not a config key \(DataConfig\); did you mean data.max_length\?"),
    (["+model.foo=1"], r"^model.foo is not a config key \(ModelConfig\); its keys: name, path"),
    (["+trainer.max_step=5"], r"^trainer.max_step is not a config key \(TrainerConfig\); did you mean trainer.max_steps\?"),
    (["+seeed=3"], r"^seeed is not a config key \(TrainConfig\); did you mean seed\?"),
    (["+data.sft.0.weigth=2"], r"^data.sft\[0\].weigth is not a config key \(SourceConfig\); did you mean data.sft\[0\].weight\?"),
    (["+runtime.simulate=false"], r"^runtime.simulate is not a config key \(RuntimeConfig\); did you mean runtime.simulate_memory\?"),
]


@pytest.mark.parametrize("overrides,message", UNKNOWN, ids=[" ".join(o) for o, _ in UNKNOWN])
def test_key_added_with_plus_must_exist(overrides: list[str], message: str) -> None:
    """Hydra's ``+key=value`` lifts the schema's check; ours refuses the key, naming the nearest one."""
    with pytest.raises(ConfigError, match=message):
        check_train_config(compose_train(overrides))


def test_free_form_nodes_take_added_keys() -> None:
    """``model.init`` (architecture kwargs) and ``callbacks`` are untyped: added keys are theirs to read."""
    check_train_config(compose_train(["+model.init.attention_bias=true", "+callbacks.mine._target_=x.Y"]))


@pytest.mark.parametrize("script,override,message", [
    ("train.py", "+data.max_len=10",
     "error: data.max_len is not a config key (DataConfig); did you mean data.max_length? (a key added with + must "
     "exist in the schema)"),
    ("evaluate.py", "+generation.batchsize=2",
     "error: generation.batchsize is not a config key (EvalGenerationConfig); did you mean generation.batch_size? "
     "(a key added with + must exist in the schema)"),
    ("synthesize.py", "+personas.nn=3",
     "error: personas.nn is not a config key (PersonasConfig); did you mean personas.n? (a key added with + must "
     "exist in the schema)"),
])
def test_entry_scripts_refuse_unknown_keys_at_once(tmp_path, script: str, override: str, message: str) -> None:
    """Through the entry script: exit 1 with one ``error:`` line, and nothing was read or written
    (no data report, no generations) in the run folder."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, str(ROOT / script), override, f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert errors == [message], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not list(run_dir.glob("data_report_*.json")) and not (run_dir / "generations.jsonl").exists()


def test_data_local_without_its_folder_names_data_dir() -> None:
    with pytest.raises(ConfigError, match=r"^data=local reads its files from data.dir, which is not set: add data.dir="):
        check_train_config(compose_train(["data=local"]))


@pytest.mark.parametrize("overrides,message", [
    (["data.sft=[{path: /no/such/sft.jsonl}]"], r"^data.sft\[0\].path: data file not found: /no/such/sft.jsonl$"),
    (["objective=dpo", "data.pairs=[{path: ./no-such-pairs.jsonl}]"], r"^data.pairs\[0\].path: data file not found"),
    (["ckpt_path=/no/such/last.ckpt"], r"^ckpt_path not found: /no/such/last.ckpt$"),
    (["model.path=/no/such/export"], r"^model.path=/no/such/export: no such folder"),
])
def test_files_named_in_the_config_are_checked_before_the_model_loads(train_cfg, monkeypatch, overrides, message) -> None:
    import rolemrc.run.train
    from rolemrc.errors import InputNotFound

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the files were checked")

    monkeypatch.setattr(rolemrc.run.train, "build_model", no_model)
    monkeypatch.setattr(rolemrc.run.train, "build_datamodule", no_model)
    with pytest.raises(InputNotFound, match=message):
        rolemrc.run.train.setup(train_cfg(*overrides))


@pytest.mark.parametrize("case,message", [
    ("file", r"^objective.reference_cache_dir=\S+/cache is a file, not a folder of reference log-probs$"),
    ("run folder", r"^objective.reference_cache_dir=\S+/cache is a run folder; its reference log-probs are in "
                   r"\S+/cache/ref_cache$"),
    ("damaged", r"^objective.reference_cache_dir: \S+/ref_logps-0-0.safetensors is not a readable safetensors file \(.+\); "
                r"delete it to have the reference log-probs computed again$"),
    ("foreign", r"^objective.reference_cache_dir: \S+/ref_logps-0-0.safetensors holds \['weight'\], not reference "
                r"log-probs \('logps'\): a file of another program; move it out of the cache folder$"),
])
def test_a_precomputed_references_cache_is_checked_before_the_model_loads(train_cfg, monkeypatch, tmp_path, case,
                                                                           message) -> None:
    """objective.reference=precomputed with reference_cache_dir: a file, a run folder or a table that
    is not ours is one error before the model (and the reference pass over the data) loads; a
    folder not there yet, or one holding our tables, is fine."""
    import torch
    from safetensors.torch import save_file

    import rolemrc.run.train
    from rolemrc.errors import ConfigError

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the files were checked")

    cache = tmp_path / "cache"
    if case == "file":
        cache.write_text("not a folder")
    elif case == "run folder":
        (cache / "ref_cache").mkdir(parents=True)
    else:
        cache.mkdir()
        table = cache / "ref_logps-0-0.safetensors"
        if case == "damaged":
            table.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
        else:
            save_file({"weight": torch.zeros(2)}, str(table))
    monkeypatch.setattr(rolemrc.run.train, "build_model", no_model)
    monkeypatch.setattr(rolemrc.run.train, "build_datamodule", no_model)
    overrides = ["objective=dpo", "objective.reference=precomputed", f"objective.reference_cache_dir={cache}"]
    with pytest.raises(ConfigError, match=message):
        rolemrc.run.train.setup(train_cfg(*overrides))
    fine = tmp_path / "fine"
    fine.mkdir()
    save_file({"logps": torch.zeros(3, 2)}, str(fine / "ref_logps-0-0.safetensors"))
    for folder in (fine, tmp_path / "not-yet"):  # ours, and one this run will fill
        rolemrc.run.train.check_files(train_cfg(*overrides[:2], f"objective.reference_cache_dir={folder}"))


@pytest.mark.parametrize("config_name,overrides", [
    ("probe", []), ("probe", ["restraint.layers=[0,1]"]), ("evaluate", ["data=rolebench_sample"]),
    ("evaluate", ["data=characterllm_sample", "benchmarks=general_sample"]), ("train", ["experiment=rolemrc_qwen_dpo"]),
])
def test_every_shipped_config_has_only_known_keys(config_name: str, overrides: list[str]) -> None:
    """Nodes set to None (``restraint.layers``, ``data.rolebench``) or left ``???`` are no error."""
    from hydra import compose, initialize_config_dir

    from rolemrc.config import check_known_keys
    from tests.conftest import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        check_known_keys(compose(config_name, overrides=overrides))
