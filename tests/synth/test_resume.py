"""`python synthesize.py` killed (SIGKILL) mid-stage resumes without repeating finished requests."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.synth.helpers import REPO, SynthServer, small_overrides


def _start(ov: list[str], cwd: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, str(REPO / "synthesize.py"), *ov, f"hydra.run.dir={cwd / 'hydra'}", "hydra.output_subdir=null"]
    return subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _cache_files(out: Path) -> int:
    """Answers in the run's SQLite cache."""
    path = out / "cache" / "api_cache.sqlite"
    if not path.exists():
        return 0
    db = sqlite3.connect(path, timeout=30)
    try:
        return int(db.execute("SELECT COUNT(*) FROM answers").fetchone()[0])
    except sqlite3.OperationalError:  # created, table not yet there
        return 0
    finally:
        db.close()


def _kill_when_held(proc: subprocess.Popen[bytes], server: SynthServer, out: Path, timeout: float = 90) -> None:
    """SIGKILL once the server parks a request and every answer it gave is in the cache."""
    deadline = time.monotonic() + timeout
    while not (server.parked and _cache_files(out) == server.total_served()):
        if proc.poll() is not None:
            raise AssertionError(f"synthesize.py ended (rc {proc.returncode}) before being killed:\n{proc.stdout.read().decode()}")  # type: ignore[union-attr]
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"timed out: parked={server.parked} cached={_cache_files(out)} served={server.total_served()}")
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    server.release()


def test_killed_run_resumes_without_repeating_requests(tmp_path: Path, synth_inputs: dict[str, Path], synth_run: Any) -> None:
    out = tmp_path / "out"
    with SynthServer() as server:
        ov = small_overrides(server.base_url, out, synth_inputs, **{"generator.concurrency": 2})

        # 1) killed inside the profiles stage (12 requests)
        server.hold(5)
        _kill_when_held(_start(ov, tmp_path), server, out)
        assert not (out / "profiles" / "_stage.json").exists()

        # 2) killed inside the dialogues stage: after 12 profiles, 7 embedding batches and 20 of
        #    the 44 dialogue requests (counts are cumulative over both runs)
        server.hold(12 + 7 + 20)
        _kill_when_held(_start(ov, tmp_path), server, out)
        assert (out / "match" / "_stage.json").exists()
        assert not (out / "dialogues" / "_stage.json").exists()

        # 3) runs to the end
        proc = _start(ov, tmp_path)
        log = proc.communicate(timeout=120)[0].decode()
        assert proc.returncode == 0, log
        assert "[assemble] sft=" in log
        # Nothing answered before a kill was asked again; every request was answered once.
        assert server.repeated() == {}
        assert len(server.served) == _cache_files(out)

        # 4) a rerun of the finished pipeline sends nothing
        before = server.total_served()
        proc = _start([*ov, "force=true"], tmp_path)
        log = proc.communicate(timeout=120)[0].decode()
        assert proc.returncode == 0, log
        assert server.total_served() == before

    # Same config, same answers: identical to the uninterrupted run.
    for name in ("sft.jsonl", "pairs.jsonl", "test.jsonl"):
        assert (out / "assemble" / name).read_bytes() == (synth_run.out_dir / "assemble" / name).read_bytes(), name
