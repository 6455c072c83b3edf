"""Synthesis under faults, and its dry run on a fresh clone (no hub, no key), as a user runs them.

- A record whose answer stays unusable after every retry is reported (stage, record id, reason)
  in ``<stage>/missing.jsonl``; the run finishes the rest and ends non-zero; the same command
  run again asks only for the missing records and then equals an undisturbed run.
- ``python synthesize.py dry_run=true`` (the README's command) works offline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.synth.helpers import API_KEY, REPO, SynthServer, run_pipeline, small_overrides


def _synthesize(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "synthesize.py"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})})


def test_records_that_keep_failing_are_reported_and_a_rerun_fills_them_in(tmp_path: Path, synth_inputs: dict[str, Path],
                                                                          synth_run: Any) -> None:
    out = tmp_path / "out"
    with SynthServer(glitch_times=10**6) as server:  # the GLITCH personas' profiles never parse
        ov = small_overrides(server.base_url, out, synth_inputs)
        proc = _synthesize([*ov, f"hydra.run.dir={tmp_path / 'hydra'}"], tmp_path)
        assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
        err = proc.stderr.strip().splitlines()[-1]
        assert err.startswith("error: synthesis incomplete: profiles 2 record(s) missing after every retry"), err
        assert "Traceback" not in proc.stderr
        missing = [json.loads(line) for line in (out / "profiles" / "missing.jsonl").read_text().splitlines()]
        assert [(m["stage"], m["reason"], m["attempts"]) for m in missing] == [("profiles", "rejected", 5)] * 2
        personas = {p["id"]: p["persona"] for p in map(json.loads, (out / "personas" / "personas.jsonl").read_text().splitlines())}
        assert all("GLITCH" in personas[m["id"]] for m in missing)
        assert "profiles: 2 record(s) without a usable answer" in proc.stdout
        # The rest was finished: every later stage ran on the ten profiles there are.
        assert (out / "assemble" / "sft.jsonl").stat().st_size > 0
        assert json.loads((out / "profiles" / "_stage.json").read_text())["stats"]["missing"] == 2
        # The API key went into the Authorization header only: not into a file, the cache or the log.
        assert server.unauthorized == 0
        assert not [p for p in out.rglob("*") if p.is_file() and API_KEY.encode() in p.read_bytes()]
        assert API_KEY not in proc.stdout + proc.stderr

        # The server behaves again: the same command asks only for the two profiles and what
        # depends on them, and the result is the undisturbed run's.
        server.glitch_times = 0
        served = dict(server.served)
        stats = run_pipeline(ov)
        assert stats["profiles"]["missing"] == 0 and stats["profiles"]["profiles"] == 12
        assert not any(n > 1 for n in (server.served - __import__("collections").Counter(served)).values())
        assert all(server.served[k] == 1 for k in served)  # nothing answered before was asked again
    for name in ("sft.jsonl", "pairs.jsonl", "test.jsonl"):
        assert (out / "assemble" / name).read_bytes() == (synth_run.out_dir / "assemble" / name).read_bytes(), name


def test_readme_dry_run_works_offline_on_a_fresh_clone(tmp_path: Path) -> None:
    """``python synthesize.py dry_run=true`` with the shipped config (hub sources), no network to
    the hub and no API key: stand-in inputs, the real request counts, nothing written but Hydra's log."""
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run([sys.executable, str(REPO / "synthesize.py"), "dry_run=true"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = " ".join(proc.stdout.split())
    assert "planning with stand-in personas" in log and "planning with stand-in MRC items" in log
    assert "dry run: requests a real run would make" in log
    # The shipped quotas: 10200 profiles, 24000 dialogue requests.
    assert "[profiles] personas=10200 profiles=10200" in log and "requests 24000 (cached 0, would send 24000)" in log
    # Captured (no terminal), the cost table is printed whole: every column, no cell cut, the USD total.
    table = proc.stdout[proc.stdout.index("dry run: requests a real run would make"):]
    assert "…" not in table and "est. completion tokens" in table and "est. cost (USD)" in table
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.split("│")[1:-1]]
                                          for line in table.splitlines() if line.startswith("│"))}
    assert set(rows) == {"profiles", "dialogues", "total"}
    assert rows["total"][1] == str(10200 + 24000)
    assert abs(float(rows["total"][6]) - float(rows["profiles"][6]) - float(rows["dialogues"][6])) <= 0.011
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]  # Hydra's run folder only
    assert not list(tmp_path.glob("outputs/**/cache"))


def test_a_missing_key_stops_the_run_before_any_stage(tmp_path: Path, synth_inputs: dict[str, Path], monkeypatch: Any) -> None:
    import pytest

    from rolemrc.errors import MissingAPIKey

    monkeypatch.delenv("ROLEMRC_NO_SUCH_KEY", raising=False)
    ov = small_overrides("http://127.0.0.1:9/v1", tmp_path / "out", synth_inputs)
    with pytest.raises(MissingAPIKey, match="generator: the API key is read from the environment variable ROLEMRC_NO_SUCH_KEY"):
        run_pipeline([*ov, "generator.api_key_env=ROLEMRC_NO_SUCH_KEY"])
    assert not (tmp_path / "out" / "personas").exists()

