"""``assemble.test_fraction`` > 0 that holds out no test item says so (and why) instead of
silently writing an empty test.jsonl."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

from rich.console import Console


def test_a_test_fraction_that_rounds_to_nothing_says_so(synth_run: Any, tmp_path: Path) -> None:
    from rolemrc.synth.config import load_config
    from rolemrc.synth.pipeline import run
    from tests.synth.helpers import compose

    out = tmp_path / "out"
    shutil.copytree(synth_run.out_dir / "dialogues", out / "dialogues")
    items = out / "dialogues" / "items.jsonl"
    one_per_task: dict[str, str] = {}
    for line in items.read_text(encoding="utf-8").splitlines():
        one_per_task.setdefault(json.loads(line)["task"], line)
    items.write_text("".join(line + "\n" for line in one_per_task.values()), encoding="utf-8")

    printed = io.StringIO()
    cfg = load_config(compose([*synth_run.overrides, f"out_dir={out}", "stages=[assemble]"]))
    stats = run(cfg, console=Console(file=printed, width=400, force_terminal=False))
    text = " ".join(printed.getvalue().split())
    assert stats["assemble"]["test"] == 0
    assert (out / "assemble" / "test.jsonl").read_text() == ""
    assert "warning: assemble.test_fraction=0.25 holds out nothing: every test task has fewer than 2 items" in text
    assert "test.jsonl is empty" in text
