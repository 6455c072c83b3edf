"""Enum-like keys and cross-key rules are refused when the config is checked, naming the key,
before any data or weights load (issue: config checked when composed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rolemrc.config import TrainStep, check_train_config
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
    # TR-DPO's reference sync: only a reference copy can follow the policy
    (["objective=dpo", "objective.sync_ref_model=true", "objective.reference=precomputed"],
     r"^objective.sync_ref_model=true needs objective.reference=copy, got precomputed \(the precomputed"),
    (["objective=dpo", "objective.sync_ref_model=true", "objective.reference=adapter", "model.peft.enabled=true"],
     r"^objective.sync_ref_model=true needs objective.reference=copy, got adapter"),
    (["objective=dpo", "objective.sync_ref_model=true", "model.peft.enabled=true"],
     r"^objective.sync_ref_model=true with model.peft.enabled=true: a LoRA run has no separate reference"),
    (["objective=grpo", "data.packing=false", "objective.sync_ref_model=true"],
     r"^objective.sync_ref_model=true with objective.beta=0: no reference is used"),
    (["objective=rloo", "data.packing=false", "objective.beta=0", "objective.sync_ref_model=true"],
     r"^objective.sync_ref_model=true with objective.beta=0: no reference is used"),
    (["objective=grpo", "data.packing=false", "objective.use_adaptive_entropy=true", "objective.entropy_coef_min=0.5",
      "objective.entropy_coef_max=0.1"], r"^objective.entropy_coef_min \(0.5\) must be <= objective.entropy_coef_max"),
    (["objective=grpo", "data.packing=false", "objective.rollout=vllm", "objective.loss_type=vespo"],
     r"^objective.loss_type=vespo takes the vLLM correction's per-token weights: set objective.vllm_importance_sampling_mode"),
    (["objective=grpo", "data.packing=false", "objective.rollout=vllm", "objective.vllm_importance_sampling_mode=token_truncate",
      "objective.vllm_importance_sampling_clip_max=null"], r"^objective.vllm_importance_sampling_mode=token_truncate clips"),
    (["objective=grpo", "data.packing=false", "objective.vllm_importance_sampling_clip_min=3",
      "objective.vllm_importance_sampling_clip_max=2"], r"^objective.vllm_importance_sampling_clip_min \(3.0\) must be less"),
    (["objective=dpo", "objective.ref_model_mixup_alpha=1.5"], r"^objective.ref_model_mixup_alpha must be in \[0, 1\]"),
    (["objective=grpo", "objective.ref_model_sync_steps=0"], r"^objective.ref_model_sync_steps must be >= 1"),
    (["optim.scheduler=cosin"], r"optim.scheduler must be one of cosine, linear, constant, got 'cosin'"),
    (["strategy.name=deepspeed"], r"strategy.name must be one of single, ddp, fsdp"),
    (["data.on_error=ignore"], r"data.on_error must be one of raise, skip"),
    (["model.attn_implementation=flash"], r"model.attn_implementation must be one of"),
    (["model.kernels=triton"], r"model.kernels must be one of none, liger"),
    (["model.quantization.load_in_4bit=true"], r"load_in_4bit=true \(QLoRA\) needs model.peft.enabled=true"),
    # numbers no run can use: refused before the data is built (a batch of 0 divided by zero at the first step)
    (["data.batch_size=0"], r"^data.batch_size must be >= 1 \(items per micro-batch\), got 0$"),
    (["trainer.max_steps=-5"], r"^trainer.max_steps must be -1 \(no limit: trainer.max_epochs decides\) or >= 0, got -5$"),
    (["data.max_length=0"], r"^data.max_length must be >= 2 \(tokens per row; the first token of a row is never trained"),
    (["data.max_length=1"], r"^data.max_length must be >= 2 "),
    (["objective=dpo", "data.max_length=1"], r"^data.max_length must be >= 2 "),
    (["optim.lr=-0.001"], r"^optim.lr must be >= 0 \(0: the weights stay as they are\), got -0.001"),
    (["trainer.accumulate_grad_batches=0"], r"^trainer.accumulate_grad_batches must be >= 1, got 0$"),
    (["data.val_fraction=1.0"], r"^data.val_fraction must be in \[0, 1\), got 1.0$"),
    (["objective=dpo", "data.max_prompt_length=0"], r"^data.max_prompt_length must be >= 1, got 0$"),
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
    ["objective=dpo", "objective.sync_ref_model=true"],
    ["objective=grpo", "data.packing=false", "objective.beta=0.04", "objective.sync_ref_model=true"],
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
        cfg = train_cfg(*overrides[:2], f"objective.reference_cache_dir={folder}")
        rolemrc.run.train.check_files(TrainStep.of(cfg), ckpt_path=None, run_dir=str(cfg.run_dir), export=cfg.export)


@pytest.mark.parametrize("config_name,overrides", [
    ("probe", []), ("probe", ["restraint.layers=[0,1]"]), ("evaluate", ["data=rolebench_sample"]),
    ("evaluate", ["data=characterllm_sample", "benchmarks=general_sample"]), ("train", ["experiment=rolemrc_qwen_dpo"]),
    ("evaluate", ["data=personagym"]), ("evaluate", ["data=coser_sample"]),
    ("evaluate", ["data=charactereval"]), ("evaluate", ["data=characterbench_sample"]),
])
def test_every_shipped_config_has_only_known_keys(config_name: str, overrides: list[str]) -> None:
    """Nodes set to None (``restraint.layers``, ``data.rolebench``) or left ``???`` are no error."""
    from hydra import compose, initialize_config_dir

    from rolemrc.config import check_known_keys
    from tests.conftest import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        check_known_keys(compose(config_name, overrides=overrides))


# ---------------------------------------------------------------- Hydra's own errors, one line each

HYDRA_ERRORS = [
    ("train", ["trainer.max_step=5"], "trainer.max_step is not a config key (TrainerConfig); did you mean trainer.max_steps?"),
    ("train", ["objective=dpo", "objective.bata=0.2"],
     "objective.bata is not a config key (DPOObjectiveConfig); did you mean objective.beta?"),
    ("train", ["objective.beta=0.2"], "objective.beta is not a config key (SFTObjectiveConfig); its keys: name, "
     "logprob_chunk_size; beta is a key of objective=dpo|simpo|orpo|kto|grpo|rloo"),
    ("train", ["objective=dpp"],
     "objective=dpp is not an option of objective; did you mean objective=dpo? (options: dpo, grpo, kto, orpo, reward, rloo, sft, simpo)"),
    ("train", ["data.batch_size=abc"], "data.batch_size=abc: Value 'abc' of type 'str' could not be converted to Integer"),
    ("evaluate", ["limt=4"], "limt is not a config key (EvaluateConfig); did you mean limit?"),
]


@pytest.mark.parametrize("config_name,overrides,line", HYDRA_ERRORS, ids=[" ".join(o) for _, o, _ in HYDRA_ERRORS])
def test_hydras_errors_become_one_line_naming_the_nearest_key(config_name: str, overrides: list[str], line: str) -> None:
    """A misspelt key gets the nearest known key, not Hydra's advice to add it with + (which the
    schema then refuses); a misspelt group option the nearest option, the ``*_schema`` entries left out."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    from rolemrc.hydra_errors import one_line
    from tests.conftest import CONF

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"), pytest.raises(HydraException) as err:
        compose(config_name, overrides=overrides)
    assert one_line(err.value) == line


def test_an_sbatch_that_refuses_the_sweep_is_one_line() -> None:
    """SLURM on PATH but unreachable (submitit's FailedJobError over sbatch's exit status): sbatch's
    last line, not a traceback; any other failed command keeps its traceback."""
    import subprocess as sp

    from submitit.core.utils import FailedJobError

    from rolemrc.hydra_errors import one_line

    said = "sbatch: error: fetch_config: DNS SRV lookup failed\nsbatch: fatal: Could not establish a configuration source"
    for cmd, expected in ((["sbatch", "/tmp/x.sh"], True), (["squeue"], False)):
        try:
            try:
                raise sp.CalledProcessError(1, cmd)
            except sp.CalledProcessError as inner:
                raise FailedJobError(said) from inner
        except FailedJobError as err:
            line = one_line(err)
        if expected:
            assert line == ("hydra/launcher=slurm: sbatch refused the sweep's jobs (sbatch: fatal: Could not establish "
                            "a configuration source): check that SLURM answers here (sinfo), or run the sweep with "
                            "hydra/launcher=local")
        else:
            assert line is None


@pytest.mark.parametrize("args,line", [
    (["trainer.max_step=5"], "error: trainer.max_step is not a config key (TrainerConfig); did you mean trainer.max_steps?"),
    (["-m", "hydra/launcher=slurm", "trainer.max_steps=1"],
     "error: hydra/launcher=slurm submits each job of the sweep with SLURM, which this machine does not have (no srun on "
     "PATH): run the command on a SLURM login node, or run the sweep here with hydra/launcher=local (or without a "
     "hydra/launcher override: one job after another)"),
    (["data.batch_size=0"], "error: data.batch_size must be >= 1 (items per micro-batch), got 0"),
    (["model.path={empty}"], "error: model.path={empty}: the folder has no model files (no config.json, and it is no "
     "adapter export, run folder or checkpoint of rolemrc's): point model.path at a model export (a run's export/ "
     "folder), a run folder, a checkpoint or a hub id"),
    (["trainer.max_steps=-5"], "error: trainer.max_steps must be -1 (no limit: trainer.max_epochs decides) or >= 0, "
     "got -5"),
    (["data.max_length=1"], "error: data.max_length must be >= 2 (tokens per row; the first token of a row is never "
     "trained on; the recipes use 1024-4096), got 1"),
    (["model.path={custom}", "model.gradient_checkpointing=auto"],
     "error: model.path={custom}: its config names custom code (auto_map) that transformers would have to run, "
     "refused: read that code, and only if you trust it set model.trust_remote_code=true"),
], ids=["misspelt key", "slurm launcher without slurm", "batch of 0", "empty model folder", "max_steps -5",
        "max_length 1", "auto_map without sizes"])
def test_train_py_says_it_in_one_line_before_any_work(tmp_path, args: list[str], line: str) -> None:
    """Through the entry script, with HYDRA_FULL_ERROR=1 as slurm/train.sbatch sets it: exit 1,
    the one ``error:`` line, no traceback, no data read and no job started."""
    empty, custom = tmp_path / "empty", tmp_path / "custom"
    empty.mkdir()
    custom.mkdir()  # a config naming its own code, without the sizes the memory estimate reads
    (custom / "config.json").write_text('{"model_type": "mine", "auto_map": {"AutoModelForCausalLM": "mine.Model"}}')
    env = {**os.environ, "WANDB_MODE": "disabled", "HYDRA_FULL_ERROR": "1",
           "PATH": os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "srun").exists())}
    args = [a.format(empty=empty, custom=custom) for a in args]
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={tmp_path / 'run'}",
                           f"hydra.sweep.dir={tmp_path / 'sweep'}"], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [line.format(empty=empty, custom=custom)], proc.stderr[-2000:]
    assert not list((tmp_path / "run").glob("data_report_*.json")) and not (tmp_path / "sweep" / "0").exists()


def test_evaluate_py_names_a_misspelt_key_in_one_line(tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "evaluate.py"), "limt=4", f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "WANDB_MODE": "disabled"},
                          timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["error: limt is not a config key (EvaluateConfig); did you mean limit?"]


def test_a_gpu_recipe_without_a_gpu_is_refused_before_the_sizing(train_cfg, monkeypatch) -> None:
    """``trainer=gpu`` (every GPU recipe) where Lightning finds no CUDA device: one error naming
    the key and the overrides that train on the CPU, before the memory sizing (a simulated step
    of an 8B model), the data and the model."""
    import lightning.fabric.accelerators.cuda
    import lightning.fabric.accelerators.mps

    import rolemrc.run.train

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the accelerator was checked")

    monkeypatch.setattr(lightning.fabric.accelerators.cuda, "num_cuda_devices", lambda: 0)
    monkeypatch.setattr(lightning.fabric.accelerators.mps.MPSAccelerator, "is_available", staticmethod(lambda: False))
    for name in ("resolve_checkpointing", "log_estimate", "build_datamodule", "build_model"):
        monkeypatch.setattr(rolemrc.run.train, name, no_work)
    with pytest.raises(ConfigError, match=r"^trainer.accelerator=gpu but this machine has no GPU that torch can use "
                                          r"\(no CUDA device found\): run it on a GPU node .*, or train on the CPU with "
                                          r"trainer.accelerator=cpu trainer.devices=1 strategy=single$"):
        rolemrc.run.train.setup(train_cfg("trainer=gpu", "strategy=fsdp", "trainer.devices=4"))


def test_a_model_folder_is_checked_for_its_files_before_the_slow_imports(tmp_path) -> None:
    """``model.path`` (or ``model.tokenizer``) naming a folder without a model's (tokenizer's)
    files, or whose config names its own code while ``model.trust_remote_code`` is off: one error
    each (transformers would say "install sentencepiece or tiktoken", or refuse the code only after
    the memory estimate failed on the config's missing sizes). train.py checks it before importing
    torch (rolemrc.models.paths imports neither torch nor transformers)."""
    from omegaconf import OmegaConf

    from rolemrc.errors import InputNotFound, ModelSourceError
    from rolemrc.sizing.formula import arch_of
    from rolemrc.models.paths import check_model_paths

    def model(path, tokenizer=None, trust=False):
        return OmegaConf.create({"path": str(path), "tokenizer": tokenizer and str(tokenizer), "trust_remote_code": trust,
                                 "init": {}})

    empty, custom, run = tmp_path / "empty", tmp_path / "custom", tmp_path / "run"
    for folder in (empty, custom, run / ".hydra"):
        folder.mkdir(parents=True)
    (custom / "config.json").write_text('{"model_type": "mine", "auto_map": {"AutoModelForCausalLM": "mine.Model"}}')
    (run / ".hydra" / "config.yaml").write_text("{}")
    with pytest.raises(InputNotFound, match=rf"^model.path={empty}: the folder has no model files \(no config.json"):
        check_model_paths(model(empty))
    with pytest.raises(ModelSourceError, match=rf"^model.path={custom}: its config names custom code \(auto_map\) that "
                                               r"transformers would have to run, refused: .* model.trust_remote_code=true$"):
        check_model_paths(model(custom))
    with pytest.raises(InputNotFound, match=rf"^model.path={custom}: the folder has a model but no tokenizer files "
                                            r"\(tokenizer.json, .*\): set model.tokenizer="):
        check_model_paths(model(custom, trust=True))
    with pytest.raises(InputNotFound, match=rf"^model.tokenizer={empty}: the folder has no tokenizer files"):
        check_model_paths(model(custom, tokenizer=empty, trust=True))
    check_model_paths(model(run))  # a run folder of ours: its export or checkpoint is found later
    assert arch_of(model(custom, trust=True)) is None  # no sizes to estimate from: no estimate, no TypeError


def test_remote_code_is_refused_before_the_memory_estimate(train_cfg, monkeypatch, tmp_path) -> None:
    import rolemrc.run.train
    from rolemrc.errors import ModelSourceError

    def no_work(*args, **kwargs):
        raise AssertionError("the memory estimate ran before the model's config was checked")

    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "config.json").write_text('{"model_type": "mine", "auto_map": {"AutoConfig": "mine.Config"}}')
    for name in ("resolve_checkpointing", "log_estimate", "build_datamodule", "build_model"):
        monkeypatch.setattr(rolemrc.run.train, name, no_work)
    with pytest.raises(ModelSourceError, match=r"its config names custom code \(auto_map\)"):
        rolemrc.run.train.setup(train_cfg(f"model.path={custom}", "model.gradient_checkpointing=auto"))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_a_gpu_recipe_on_a_machine_without_one_is_one_line_through_train_py(tmp_path) -> None:
    """The paper's DPO recipe (trainer=gpu, FSDP on 4 devices, gradient_checkpointing=auto) on a
    CPU machine: the one line with the overrides that train on the CPU, before the memory sizing
    (no estimate logged) and the data (no data report)."""
    import shutil

    from rolemrc import asset

    model = tmp_path / "qwen"
    model.mkdir()
    shutil.copy(asset("architectures/qwen2.5-7b/config.json"), model)
    for f in Path(asset("tokenizers/tiny-chatml")).iterdir():
        shutil.copy(f, model)
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "experiment=rolemrc_qwen_dpo", f"model.path={model}",
                           "data=sample", "logger=none", f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True,
                          text=True, cwd=tmp_path, env={**os.environ, "WANDB_MODE": "disabled"}, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert errors == ["error: trainer.accelerator=gpu but this machine has no GPU that torch can use (no CUDA device "
                      "found): run it on a GPU node (e.g. sbatch slurm/train.sbatch ...), or train on the CPU with "
                      "trainer.accelerator=cpu trainer.devices=1 strategy=single"], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "memory estimate" not in proc.stdout + proc.stderr
    assert not list((tmp_path / "run").glob("data_report_*.json"))
