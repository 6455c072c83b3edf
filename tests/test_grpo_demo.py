"""``make demo-rl`` (benchmarks/grpo_demo.py) writes its figures into its own run folder and leaves
the checkout's published ``benchmarks/results/grpo_demo.{json,png}`` alone unless ``--json`` names
them. The two GRPO runs are replaced by a stand-in here (the demo itself takes minutes)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


def test_the_demo_writes_into_its_own_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("grpo_demo", ROOT / "benchmarks" / "grpo_demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    published = [ROOT / "benchmarks" / "results" / f"grpo_demo.{ext}" for ext in ("json", "png")]
    before = [p.stat().st_mtime_ns if p.exists() else None for p in published]

    def run(args, sft, work):
        return {"reward_per_step": [0.2, 0.5, 0.8], "completions_per_s": 1.0, "generate_tokens_per_s": 10.0}

    monkeypatch.setattr(demo, "sft_export", lambda args, work: tmp_path / "sft")
    monkeypatch.setattr(demo, "run_trl", run)
    monkeypatch.setattr(demo, "run_ours", run)
    monkeypatch.setattr(sys, "argv", ["grpo_demo.py", "--work", str(tmp_path / "work"), "--window", "2"])
    assert demo.main() == 0
    results = json.loads((tmp_path / "work" / "grpo_demo.json").read_text())
    assert results["ours"]["last_2_mean"] == pytest.approx(0.65)
    assert (tmp_path / "work" / "grpo_demo.png").is_file()
    assert [p.stat().st_mtime_ns if p.exists() else None for p in published] == before
