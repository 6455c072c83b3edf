"""General Δ through lm-evaluation-harness on the shipped tiny tasks, offline: the documented
command as a subprocess on two saved models; accuracies equal a direct log-likelihood
computation with transformers; Δ = model - compare; bad task specs are clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from rolemrc import asset
from rolemrc.config import ModelConfig
from rolemrc.errors import ConfigError
from rolemrc.eval.general import task_specs
from rolemrc.models.export import export_pretrained
from rolemrc.models.loading import load_model, load_tokenizer
from tests.conftest import CONF, ROOT


def _export(path: Path, seed: int) -> Path:
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF / "model" / "tiny.yaml"))
    cfg.tokenizer = asset("tokenizers/tiny-llama3")
    tok = load_tokenizer(cfg)
    torch.manual_seed(seed)
    return export_pretrained(load_model(cfg, tok), tok, path)


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("general")
    return _export(base / "trained", 1), _export(base / "start", 2)


def direct_accuracy(model_dir: Path, task_yaml: str) -> float:
    """Log-likelihood multiple choice computed by hand: sum of log p(continuation | context)
    over the choice's tokens, argmax vs the answer (lm-eval's acc)."""
    spec = yaml.safe_load(Path(task_yaml).read_text())
    rows = [json.loads(x) for x in (Path(task_yaml).parent / spec["dataset_kwargs"]["data_files"]["test"])
            .read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    from jinja2 import Template

    correct = 0
    for row in rows:
        context = Template(spec["doc_to_text"]).render(**row)
        scores = []
        for choice in row["choices"]:
            ctx_ids = tok(context)["input_ids"]
            ids = tok(context + " " + choice)["input_ids"]
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
            scores.append(sum(logp[i - 1, ids[i]].item() for i in range(len(ctx_ids), len(ids))))
        correct += int(max(range(len(scores)), key=scores.__getitem__) == row["answer"])
    return correct / len(rows)


def test_general_sample_command_reports_delta(exports: tuple[Path, Path], tmp_path: Path) -> None:
    trained, start = exports
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline")
    cmd = [sys.executable, "evaluate.py", "benchmarks=general_sample", f"model.path={trained}",
           f"compare.path={start}", f"out_dir={tmp_path}", "generation.cpu_threads=1", "logger=csv"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "metrics.json").read_text())["general"]
    tasks = doc["tasks"]
    assert list(tasks) == ["rolemrc_general_sample", "rolemrc_roleeval_sample"]
    yamls = {"rolemrc_general_sample": asset("lm_eval/general_sample.yaml"),
             "rolemrc_roleeval_sample": asset("lm_eval/roleeval_sample.yaml")}
    for name, row in tasks.items():
        assert row["metric"] == "acc,none" and row["n"] == 6
        assert row["model"] == pytest.approx(direct_accuracy(trained, yamls[name]), abs=1e-12)
        assert row["compare"] == pytest.approx(direct_accuracy(start, yamls[name]), abs=1e-12)
        assert row["delta"] == pytest.approx(row["model"] - row["compare"], abs=1e-12)
    assert doc["average"]["delta"] == pytest.approx(sum(r["delta"] for r in tasks.values()) / 2, abs=1e-12)
    assert doc["settings"]["batch_size"] == "auto" and doc["settings"]["harness"] == "lm-eval 0.4.13"
    summary = (tmp_path / "summary.md").read_text()
    r = tasks["rolemrc_roleeval_sample"]
    assert (f"| rolemrc_roleeval_sample | acc,none | {100 * r['model']:.2f} | {100 * r['compare']:.2f} | "
            f"{100 * r['delta']:+.2f} |") in summary
    # The title names the evaluated model (its path), as the "model:" line does, not the preset.
    assert summary.startswith(f"# Evaluation: {trained} on general\n") and f"- model: {trained}\n" in summary
    # Each model's results are kept for a rerun (reused while model and settings are the same).
    saved = json.loads((tmp_path / "general" / "compare.json").read_text())
    assert saved["settings"]["model"] == str(start) and saved["tasks"]["rolemrc_general_sample"]["value"] == \
        tasks["rolemrc_general_sample"]["compare"]
    # Every average is logged (csv logger): the model's, the compare's and Δ.
    logged = csv_scalars(tmp_path / "csv" / "metrics.csv")
    avg = doc["average"]
    assert logged["general/average_model"] == pytest.approx(avg["model"], abs=1e-9)
    assert logged["general/average_compare"] == pytest.approx(avg["compare"], abs=1e-9)
    assert logged["general/average_delta"] == pytest.approx(avg["delta"], abs=1e-9)
    assert logged["general/rolemrc_general_sample/delta"] == pytest.approx(tasks["rolemrc_general_sample"]["delta"],
                                                                          abs=1e-9)
    # Without compare.path (model results reused from the run above: no lm-eval pass), the model's
    # average is still logged, and nothing about a compare.
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "general").mkdir()
    (alone / "general" / "model.json").write_bytes((tmp_path / "general" / "model.json").read_bytes())
    cmd = [sys.executable, "evaluate.py", "benchmarks=general_sample", f"model.path={trained}",
           f"out_dir={alone}", "generation.cpu_threads=1", "logger=csv"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = csv_scalars(alone / "csv" / "metrics.csv")
    assert logged["general/average_model"] == pytest.approx(avg["model"], abs=1e-9)
    assert not any("compare" in k or "delta" in k for k in logged)


def csv_scalars(path: Path) -> dict[str, float]:
    """The non-empty metric columns of the csv logger's rows (the step column aside)."""
    import csv

    out: dict[str, float] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            out.update({k: float(v) for k, v in row.items() if k != "step" and v not in ("", None)})
    return out


def test_unreachable_dataset_is_one_error_line(tmp_path: Path) -> None:
    """A task whose data set is on the hub, offline and not cached: one ``error:`` line naming the
    task and the ways out, exit status 1, no traceback."""
    task = tmp_path / "unreachable.yaml"
    task.write_text("task: rolemrc_unreachable\ndataset_path: rolemrc-test/no-such-dataset\ntest_split: test\n"
                    "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
                    "doc_to_target: answer\nmetric_list:\n  - {metric: acc, aggregation: mean, higher_is_better: true}\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline",
               HF_DATASETS_CACHE=str(tmp_path / "datasets_cache"))
    cmd = [sys.executable, "evaluate.py", "benchmarks=general_sample", f"benchmarks.tasks=[{task}]",
           f"out_dir={tmp_path / 'out'}", "generation.cpu_threads=1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("error: benchmarks: task rolemrc_unreachable: its data set cannot be loaded "
                                "(Couldn't reach 'rolemrc-test/no-such-dataset'")
    assert "HF_DATASETS_OFFLINE=1" in errors[0] and "local task YAML" in errors[0]


def test_task_specs_resolve_shipped_yaml_and_refuse_bad_entries(tmp_path: Path) -> None:
    specs = task_specs([asset("lm_eval/general_sample.yaml"), {"task": "gsm8k", "metric": "exact_match"}])
    name, spec, metric = specs[0]
    assert name == "rolemrc_general_sample" and metric is None
    assert spec["dataset_kwargs"]["data_files"]["test"] == str(Path(asset("lm_eval/general_sample.jsonl")))
    assert specs[1] == ("gsm8k", "gsm8k", "exact_match")
    with pytest.raises(ConfigError, match=r"benchmarks.tasks\[0\]: a mapping needs 'task'"):
        task_specs([{"metric": "acc"}])
    bad = tmp_path / "t.yaml"
    bad.write_text("task: x\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: missing.jsonl\n")
    with pytest.raises(FileNotFoundError, match=r"data_files.test: not found: .*missing.jsonl"):
        task_specs([str(bad)])
    with pytest.raises(ConfigError, match="benchmarks.tasks is empty"):
        task_specs([])
