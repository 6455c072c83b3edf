"""What synthesize.py writes trains as it is: `python train.py model=tiny data=local data.dir=<out>`."""

from __future__ import annotations

from pathlib import Path

import pytest

from rolemrc.data.readers import read_examples
from rolemrc.run.train import run
from tests.conftest import FAST, compose_train
from tests.train.helpers import series


@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_assembled_files_train_without_conversion(assembled_dir: Path, tmp_path: Path, objective: str) -> None:
    cfg = compose_train([*FAST, "model=tiny", "data=local", f"data.dir={assembled_dir}", f"objective={objective}",
                         "trainer.max_steps=2", "data.max_length=256", "data.max_prompt_length=192"],
                        run_dir=tmp_path / "run")
    out = run(cfg)
    assert len(series(Path(out["run_dir"]), "train/loss")) == 2
    assert (Path(out["export"]) / "model.safetensors").exists()
    tests, _ = read_examples([{"path": str(assembled_dir / "test.jsonl")}], "test")
    assert tests, "the held-out test split is readable by evaluate.py's reader"
