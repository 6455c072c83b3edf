"""The GPU check's dry run on CPU (``benchmarks/gpu_check.py --device cpu --tiny``): every part runs
on a tiny model and lands in the results file part by part (the CUDA tests skip here, there is no
device memory to measure and no MFU); a rerun skips what is done; a part cut short by its budget is
recorded as such and the script does not exit 0. Its ``speed`` part is benchmarks/gpu.py's pipeline
end to end (FSDP2 on one device, bf16-mixed, packed SFT and shared-prompt DPO rows, the FLOP count
behind MFU). No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gpu_check")]


def check(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env_extra or {})}
    return subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--tiny", *args], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=900)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path, Path]:
    work = tmp_path_factory.mktemp("gpu_check")
    out = work / "gpu_check.json"
    return check("--work", str(work), "--out", str(out)), out, work


def test_dry_run_writes_every_part(dry_run) -> None:
    proc, out, _ = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["tiny"] is True and result["device"].startswith("cpu")
    assert result["versions"]["torch"] and result["versions"]["hydra-core"] == "1.3.8"
    assert result["command"].startswith("python benchmarks/gpu_check.py --device cpu --tiny")
    parts = result["parts"]
    assert [parts[n]["status"] for n in ("tests", "memory", "speed")] == ["done"] * 3
    # the CUDA tests: collected, each skipped here (no CUDA), at least the 8 the issue asks for
    counts = parts["tests"]["counts"]
    assert counts["skipped"] >= 8 and counts["passed"] == counts["failed"] == 0
    (case,) = parts["memory"]["cases"]
    assert case["status"] == "done" and case["measured_gib"] is None  # no CUDA: never a made-up figure
    assert case["simulated_gib"] > 0 and case["simulated"]["where"] == "simulated in this run"
    # the real run trained the rows the simulation assumes: every row full (2 x 256 tokens)
    assert case["measured"]["tokens_per_step"] == [512.0] * 4
    assert case["simulated"]["micro_batch"] == {"rows": 2, "tokens": 512}
    assert case["measured"]["executed_flops_last_step"] > 0 and case["measured"]["mfu"] is None
    assert out.with_suffix(".log").is_file()


def test_speed_part_runs_the_gpu_benchmark_pipeline(dry_run) -> None:
    proc, out, _ = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    speed = json.loads(out.read_text())["parts"]["speed"]
    bench = json.loads(Path(speed["bench_json"]).read_text())
    assert set(speed["rows"]) == set(bench["rows"]) == {"sft/ours", "dpo/ours"}
    assert bench["trl"] == "TRL rows skipped (--no-trl)" and speed["ratios"]["sft_ours_over_best_trl"] is None
    for key, row in bench["rows"].items():
        assert "error" not in row, row
        assert "strategy=fsdp" in row["overrides"] and "trainer.precision=bf16-mixed" in row["overrides"]
        assert row["steps"] == 1 and row["tokens"] > 0 and row["attended_pairs"] > 0
        assert row["mfu"] is None  # no device peak on CPU: never a made-up MFU
        assert row["model_tflops_per_s"] >= 0 and row["flop_per_s"] > 0 and "executed_tflops_per_s" in row
        assert row["flops_counted_on"] == "every timed step"  # CPU: no counter overhead to avoid
    sft, dpo = bench["rows"]["sft/ours"], bench["rows"]["dpo/ours"]
    assert "data.packing=true" in sft["overrides"] and sft["padding_fraction"] == 0.0
    assert "objective.share_prompt=true" in dpo["overrides"] and dpo["samples"] == bench["spec"]["dpo_batch"]
    assert "FSDP2 on 1 device" in bench["table"][0] and "figures mean nothing" in bench["table"][0]


def test_rerun_skips_what_is_done_and_a_cut_part_is_not_done(dry_run, tmp_path: Path) -> None:
    proc, out, work = dry_run
    assert proc.returncode == 0
    again = check("--work", str(work), "--out", str(out), "--parts", "tests,memory")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "tests: done in an earlier run" in again.stdout and "memory: done in an earlier run" in again.stdout
    assert len(json.loads(out.read_text())["runs"]) == 2
    cut = tmp_path / "cut.json"
    short = check("--work", str(tmp_path / "w"), "--out", str(cut), "--parts", "tests", "--budget", "tests=1",
                  "--copy-to", str(tmp_path / "copied"))
    assert short.returncode != 0 and "parts not done: tests (rerun to continue)" in short.stderr
    assert json.loads(cut.read_text())["parts"]["tests"]["status"] == "timeout"
    assert json.loads((tmp_path / "copied" / "cut.json").read_text())["parts"]["tests"]["status"] == "timeout"
    assert (tmp_path / "copied" / "cut.log").is_file()
