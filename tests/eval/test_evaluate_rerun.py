"""``python evaluate.py <overrides>`` run again with the same command continues its own folder
(as training's ``ckpt_path=last``): a judge run that lost verdicts asks only for the rest, a
finished folder is reported again without loading the model, and a run that fails before it
has results leaves no folder. Through the real entry script, in a fresh working directory, the
judge behind the loopback fake server (tests/fake_openai.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.fake_openai import FakeOpenAI, Request

pytestmark = pytest.mark.slow

GEN = ["limit=2", "generation.max_new_tokens=4", "generation.progress=false", "generation.cpu_threads=1",
       "metrics.names=[rougeL]"]


def evaluate(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "evaluate.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def folders(cwd: Path) -> list[Path]:
    root = cwd / "outputs" / "evaluate"
    return sorted(p for p in root.iterdir()) if root.is_dir() else []


def test_the_same_command_continues_its_folder(api_key_env: tuple[str, str], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    lost = {"left": 3}
    lock = threading.Lock()

    def faults(req: Request) -> str | None:  # the first 3 judge requests fail (one attempt each)
        with lock:
            if lost["left"] > 0:
                lost["left"] -= 1
                return "server_error"
        return None

    # A run refused before it has results leaves no folder behind.
    bad = evaluate(tmp_path, *GEN, "judge=openai", "judge.api_key_env=ROLEMRC_TEST_NO_SUCH_KEY")
    assert bad.returncode == 1 and "error: " in bad.stderr, bad.stderr[-3000:]
    assert folders(tmp_path) == []

    with FakeOpenAI(api_key=api_key_env[1], answer=lambda req: "Consistent.\nVERDICT: 1", faults=faults) as server:
        cmd = [*GEN, "judge=openai", "judge.model=judge-test", f"judge.base_url={server.base_url}",
               f"judge.api_key_env={api_key_env[0]}", "judge.max_attempts=1", "judge.backoff_s=0.01"]
        first = evaluate(tmp_path, *cmd)
        assert first.returncode == 1, first.stderr[-3000:]
        assert "rerun the same command to ask only for the rest" in first.stderr
        [folder] = folders(tmp_path)
        judgements = json.loads((folder / "metrics.json").read_text())["counts"]["judgements"]
        served = server.total_served()
        assert served == judgements - 3 and server.requests == judgements

        again = evaluate(tmp_path, *cmd)  # the same command
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"continuing {folder.relative_to(tmp_path)} " in again.stdout
        assert folders(tmp_path) == [folder]
        assert server.total_served() == served + 3 and server.requests == judgements + 3  # only the rest
        doc = json.loads((folder / "metrics.json").read_text())
        assert doc["counts"]["resumed"] == 2 and doc["counts"]["generated"] == 0
        assert doc["counts"]["judge_requests"] == 3 and doc["counts"]["judgement_status"] == {"ok": judgements}
        assert "the model is not loaded" in again.stdout + again.stderr  # every reply was there

    # The lookup itself (in this process, in the same working directory): this command finds
    # that folder; another config (limit=1) or an explicit folder is left to Hydra.
    from rolemrc.eval.resume import continue_eval_argv

    monkeypatch.chdir(tmp_path)
    argv = ["evaluate.py", *cmd]
    assert continue_eval_argv(argv, ROOT / "conf") == [*argv, f'hydra.run.dir="{folder.relative_to(tmp_path)}"']
    for changed in ([*argv, "limit=1"], [*argv, f"out_dir={tmp_path / 'x'}"], [*argv, "--cfg", "job"]):
        assert continue_eval_argv(changed, ROOT / "conf") == changed
    assert continue_eval_argv([*argv, "generation.batch_size=1"], ROOT / "conf")[-1].startswith("hydra.run.dir=")
