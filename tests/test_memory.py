"""The memory estimate knows the target models and warns when a run cannot fit; a run calls it
explicitly (``log_estimate``), and ``python -m rolemrc.memory <overrides>`` prints it."""

import logging
import subprocess
import sys

from omegaconf import OmegaConf

import pytest

from rolemrc.errors import ConfigError
from rolemrc.config import TrainStep, upgrade_train_config
from rolemrc.sizing import formula
from rolemrc.sizing.formula import KNOWN, Arch, arch_of, log_estimate
from tests.conftest import ROOT, compose_train


def check(cfg, *args):
    """The estimate's line for a composed config's step (as the run hands it)."""
    return formula.check(TrainStep.of(cfg), *args)


def choose_checkpointing(cfg, *args):
    return formula.choose_checkpointing(TrainStep.of(cfg), *args)


def test_parameter_counts_match_the_published_sizes() -> None:
    llama = arch_of(compose_train(["model=llama"]).model)
    qwen = arch_of(compose_train(["model=qwen"]).model)
    assert isinstance(llama, Arch) and abs(llama.params / 1e9 - 8.03) < 0.01  # Llama-3.1-8B: 8.03B
    assert isinstance(qwen, Arch) and abs(qwen.params / 1e9 - 7.62) < 0.01  # Qwen2.5-7B: 7.62B
    assert set(KNOWN) == {"meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-7B"}


def test_paper_recipe_fits_and_no_checkpointing_warns(caplog) -> None:
    ok = check(compose_train(["experiment=rolemrc_llama_sft"]))
    assert not ok.startswith("WARNING") and "4 device(s)" in ok
    with caplog.at_level(logging.WARNING, logger="rolemrc.sizing.formula"):
        bad = check(compose_train(["experiment=rolemrc_llama_sft", "model.gradient_checkpointing=false"]))
    assert bad.startswith("WARNING") and "exceeds 80 GB" in caplog.text
    more_gpus = check(compose_train(["experiment=rolemrc_llama_sft", "trainer.devices=8"]))
    assert float(more_gpus.split("~")[1].split()[0]) < float(ok.split("~")[1].split()[0])


def check_memory(cfg):
    """The estimate of a composed config, its deprecated keys mapped first (as the run's checks do)."""
    return log_estimate(TrainStep.of(upgrade_train_config(cfg)))


def test_check_memory_logs_the_estimate_and_reads_runtime(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="rolemrc.sizing.formula"):
        line = check_memory(compose_train(["experiment=rolemrc_llama_sft"]))
    assert f"memory estimate: {line}" in caplog.text and not line.startswith("WARNING")
    gb = float(line.split("~")[1].split()[0])
    small = compose_train(["experiment=rolemrc_llama_sft", f"runtime.device_memory_gb={gb}"])
    assert check_memory(small).startswith(f"WARNING: {line}")  # above 90% of a device of exactly that size
    # The deprecated spellings map onto the current keys before estimating.
    old = compose_train(["experiment=rolemrc_llama_sft", f"trainer.device_memory_gb={gb}",
                         "strategy.activation_checkpointing=false"])
    assert check_memory(old).startswith("WARNING:") and old.runtime.device_memory_gb == gb
    assert old.model.gradient_checkpointing is False


def test_cfg_job_resolve_prints_without_an_estimate_key() -> None:
    out = subprocess.run([sys.executable, "train.py", "experiment=rolemrc_llama_sft", "--cfg", "job", "--resolve"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    cfg = OmegaConf.create(out)
    assert "memory_check" not in cfg and cfg.runtime.device_memory_gb == 80.0 and cfg.task_name == "rolemrc_llama_sft"


def test_cli_prints_the_estimate_of_a_config_and_the_table() -> None:
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rolemrc.memory", *args], cwd=ROOT, capture_output=True, text=True)

    one = cli("experiment=rolemrc_llama_sft", "trainer.devices=8")
    assert one.returncode == 0 and one.stdout.strip() == check(
        compose_train(["experiment=rolemrc_llama_sft", "trainer.devices=8"]))
    assert "8 device(s)" in one.stdout
    table = cli()
    assert table.returncode == 0 and table.stdout.startswith("| run | GPUs |") and "| SFT 8B full | 4 | yes | no | 46 |" in table.stdout
    assert table.stdout.strip() in (ROOT / "docs" / "memory.md").read_text(encoding="utf-8"), (
        "docs/memory.md quotes the table as python -m rolemrc.memory prints it")
    bad = cli("objective=sft", "objective.beta=0.1")
    assert bad.returncode == 1 and bad.stderr.startswith("error:") and "beta" in bad.stderr and "Traceback" not in bad.stderr


def test_auto_checkpointing_follows_the_estimate() -> None:
    """model.gradient_checkpointing=auto (the recipes' and model=llama/qwen's value): on where the
    estimate without it exceeds 90% of the device, off where it fits; true/false are taken as set."""
    recipe = compose_train(["experiment=rolemrc_llama_sft"])
    assert recipe.model.gradient_checkpointing == "auto"
    on, why = choose_checkpointing(recipe)
    assert on is True and why.startswith("auto: on") and "80 GB" in why
    assert "activation checkpointing on" in check(recipe) and not check(recipe).startswith("WARNING")
    roomy = compose_train(["experiment=rolemrc_llama_sft", "runtime.device_memory_gb=100000"])
    assert choose_checkpointing(roomy)[0] is False and "activation checkpointing off" in check(roomy)
    assert choose_checkpointing(compose_train(["model.gradient_checkpointing=auto"]))[0] is False  # tiny fits
    forced = compose_train(["model.gradient_checkpointing=true"])
    assert choose_checkpointing(forced) == (True, "set by model.gradient_checkpointing")
    unknown = compose_train(["experiment=rolemrc_llama_dpo", "model.path=/nowhere"])  # no dimensions offline
    assert choose_checkpointing(unknown)[0] is True
    with pytest.raises(ConfigError, match="must be true, false or auto, got 'maybe'"):
        choose_checkpointing(compose_train(["model.gradient_checkpointing=maybe"]))


def test_cli_simulate_json_has_the_documented_keys() -> None:
    """``--simulate --json`` after the overrides: the last stdout line is one JSON object with the
    per-rank peak, its categories (the tracker's names), both checkpointing peaks for ``auto``, and
    whether it fits; the peak is the sum of its categories."""
    import json

    args = ["strategy=fsdp", "trainer.devices=2", "model.gradient_checkpointing=auto", "--simulate", "--json"]
    out = subprocess.run([sys.executable, "-m", "rolemrc.memory", *args], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["ranks"] == 2 and report["fits"] is True and report["tracker"] == "FSDPMemTracker"
    assert {"Sharded Param", "Unsharded Param", "Activation", "OptState", "All Gather", "Reduce Scatter"} <= set(report["by_category"])
    assert abs(sum(report["by_category"].values()) - report["peak_gib"]) < 0.002 * len(report["by_category"])
    gc = report["gradient_checkpointing"]
    assert gc["off"] > gc["on"] > 0 and report["checkpointing"] == "off" and report["peak_gib"] == gc["off"]
    assert report["micro_batch"] == {"rows": 8, "tokens": 8 * 1024}  # data.batch_size x data.max_length
    assert "simulated per-rank peak" in out.stdout
    alone = subprocess.run([sys.executable, "-m", "rolemrc.memory", "--json"], cwd=ROOT, capture_output=True, text=True)
    assert alone.returncode == 1 and alone.stderr.startswith("error: --json goes with --simulate")
