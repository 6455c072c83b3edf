"""``python evaluate.py out_dir=<dir>`` alone resumes with the config saved in that folder
(model, data, judge, generation, metrics, limit); an override that changes a saved value of a
folder holding results is an error naming the key, and the results stay as they were. Through
the real entry script, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

# The tiny random-init model (seeded) judging itself: real files, a judge table, fast.
FIRST = ["limit=4", "generation.max_new_tokens=5", "generation.batch_size=2", "generation.progress=false",
         "generation.cpu_threads=1", "judge.max_tokens=3", "metrics.names=[rougeL]"]


def evaluate(tmp_path: Path, hydra_dir: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "evaluate.py"), *args, f"hydra.run.dir={tmp_path / hydra_dir}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_out_dir_alone_resumes_with_the_saved_config_and_refuses_conflicts(tmp_path: Path) -> None:
    out = tmp_path / "eval"
    first = evaluate(tmp_path, "h1", *FIRST, "judge=hf", f"out_dir={out}")
    assert first.returncode == 0, first.stderr[-3000:]
    generations = lines(out / "generations.jsonl")
    metrics = json.loads((out / "metrics.json").read_text())
    summary = (out / "summary.md").read_bytes()
    assert len(generations) == 4 and metrics["judge"], "a judged run"

    # Conflicting overrides: one error line naming every key; nothing finished is rewritten.
    conflicts = (("judge=none", "judge (saved 'hf', given 'none')"),
                 ("generation.max_new_tokens=7", "generation.max_new_tokens (saved 5, given 7)"),
                 ("limit=3", "limit (saved 4, given 3)"))
    refused = evaluate(tmp_path, "h2", f"out_dir={out}", *(override for override, _ in conflicts))
    assert refused.returncode == 1, refused.stderr[-3000:]
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: out_dir={out} holds results made with another config"), last
    for _, key in conflicts:
        assert key in last, last
    assert "Traceback" not in refused.stderr
    assert (out / "summary.md").read_bytes() == summary

    # Interrupted after two replies (a kill leaves generations.jsonl as it was written):
    # `out_dir=` alone finishes it with the saved model, data, limit, generation and judge.
    (out / "generations.jsonl").write_text("".join(line + "\n" for line in generations[:2]), encoding="utf-8")
    (out / "metrics.json").unlink()
    (out / "summary.md").unlink()
    resumed = evaluate(tmp_path, "h3", f"out_dir={out}", "generation.batch_size=1")  # runtime keys may change
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming {out} with its saved config (run_config.yaml)" in resumed.stdout
    assert lines(out / "generations.jsonl") == generations  # same model, same greedy replies
    again = json.loads((out / "metrics.json").read_text())
    assert again["counts"]["items"] == 4 and again["counts"]["resumed"] == 2 and again["counts"]["generated"] == 2
    assert again["judge"].keys() == metrics["judge"].keys()  # the judge table is kept
    assert again["metrics"] == metrics["metrics"]
    assert (out / "summary.md").read_bytes() == summary


def test_folder_from_hydra_run_dir_resumes_and_can_add_a_judge(tmp_path: Path) -> None:
    # out_dir left at its default (Hydra's run folder): its .hydra/config.yaml is what older
    # runs left; a judge can be added to a folder evaluated without one (nothing is rewritten).
    out = tmp_path / "run"
    first = evaluate(tmp_path, "run", *FIRST, "limit=2")
    assert first.returncode == 0, first.stderr[-3000:]
    (out / "run_config.yaml").unlink()  # as a folder written before run_config.yaml existed
    generations = lines(out / "generations.jsonl")
    assert not json.loads((out / "metrics.json").read_text()).get("judge")

    judged = evaluate(tmp_path, "h2", f"out_dir={out}", "judge=hf")
    assert judged.returncode == 0, judged.stderr[-3000:]
    assert f"resuming {out} with its saved config (.hydra/config.yaml)" in judged.stdout
    doc = json.loads((out / "metrics.json").read_text())
    assert doc["counts"]["items"] == 2 and doc["counts"]["generated"] == 0  # limit=2 came from the saved config
    assert doc["judge"] and lines(out / "generations.jsonl") == generations
    assert "judge:\n    backend: hf" in (out / "run_config.yaml").read_text()
