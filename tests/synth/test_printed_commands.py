"""The commands synthesize.py prints work when pasted into a shell (issue 34, item 4): the dry
run's real-run command, the finished run's ``train on it`` command, an incomplete run's rerun;
none points into the dry run's deleted scratch folder, none is broken across lines, and a run
that kept no record advises no training. Run without HF_HUB_OFFLINE in the environment: rolemrc
is offline by default (item 3)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from rolemrc.synth.config import load_config
from rolemrc.synth.pipeline import SynthIncomplete, run
from tests.synth.helpers import REPO, SynthServer, compose, small_overrides
from tests.synth.helpers import API_KEY
from tests.synth.test_roleplay import RolePlayServer, inputs, overrides  # noqa: F401  (inputs: a fixture)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "COLUMNS")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # `python`: this one
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), str(REPO)]))
    env["OMP_NUM_THREADS"] = "1"
    return env


def _shell(command: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``command`` pasted into bash, from the repository root (where the README's commands run)."""
    return subprocess.run(["bash", "-c", command], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _after(text: str, start: str) -> str:
    """The rest of the one line of ``text`` that holds ``start``."""
    [line] = [ln for ln in text.splitlines() if start in ln]
    return line.split(start, 1)[1]


def test_the_dry_run_and_the_finished_run_print_commands_that_work(tmp_path: Path, synth_inputs: dict[str, Path],
                                                                   fake_server: SynthServer) -> None:
    out = tmp_path / "synth out"  # a space: the printed commands quote their paths
    argv = [*small_overrides(fake_server.base_url, out, synth_inputs), f"hydra.run.dir={tmp_path / 'hydra'}"]
    dry = subprocess.run([sys.executable, "synthesize.py", *argv, "dry_run=true"], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=600)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "rolemrc-dry-" not in dry.stdout and "train on it" not in dry.stdout and not out.exists()
    real = "python " + _after(dry.stdout, f"the real run writes into {out}: python ")
    assert "dry_run=" not in real

    done = _shell(real)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert (out / "assemble" / "sft.jsonl").stat().st_size > 0
    train = _after(done.stdout, "train on it as it is: ")
    assert str(out / "assemble") in train
    trained = _shell(f"{train} trainer.max_steps=2 hydra.run.dir='{tmp_path / 'train'}'")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "run summary: 2 steps" in trained.stdout


def test_an_incomplete_run_prints_its_rerun_and_no_training_on_nothing(tmp_path: Path, inputs: dict[str, Path],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every generator request fails: nothing kept, so no ``train on it``; the rerun command is
    the one that was typed."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "out"
    argv = overrides(SimpleNamespace(base_url="http://127.0.0.1:9/v1"), out, inputs, "generator.max_retries=0",
                     "embedder.query_prefix=''")
    console = Console(width=80, force_terminal=False, record=True)
    with pytest.raises(SynthIncomplete) as err:
        run(load_config(compose(argv)), console=console, command=["synthesize.py", *argv])
    printed = console.export_text()
    assert "train on it" not in printed and "nothing to train on" in printed
    rerun = str(err.value).split("to ask only for the missing ones, rerun: ", 1)[1]
    assert rerun.startswith("python synthesize.py out_dir=") and "generator.max_retries=0" in rerun
    assert "'embedder.query_prefix='\"'\"''\"'\"''" in rerun  # the '' survives the shell


def test_a_roleplay_run_prints_its_train_command_whole(tmp_path: Path) -> None:
    """The RoleLLM stages' ``train on it`` command: one unbroken line naming the stage's sft.jsonl."""
    from rolemrc.synth.pipeline import train_commands

    out = tmp_path / "a long folder name that would wrap at eighty columns" / "out"
    (out / "rolegpt").mkdir(parents=True)
    (out / "rolegpt" / "sft.jsonl").write_text('{"task": "rolegpt"}\n')
    (out / "context_instruct").mkdir()
    (out / "context_instruct" / "sft.jsonl").write_text("")  # nothing kept: no command for it
    [command] = train_commands(out, {"rolegpt": {"rows": 1}, "context_instruct": {"kept": 0}})
    assert command == f"python train.py 'data.sft=[{{path: \"{out / 'rolegpt' / 'sft.jsonl'}\"}}]'"


def test_an_incomplete_runs_printed_rerun_and_train_commands_work(tmp_path: Path, inputs: dict[str, Path]) -> None:
    """The RoleLLM stages through synthesize.py: RoleGPT's out-of-character replies leave records
    missing (exit 1); the error's rerun command, pasted once the generator behaves, fills them in,
    and the ``train on it`` command it prints trains on the stage's sft.jsonl."""
    out = tmp_path / "out"
    with RolePlayServer(api_key=API_KEY) as server:
        argv = [*overrides(server, out, inputs), f"hydra.run.dir={tmp_path / 'hydra'}"]
        first = subprocess.run([sys.executable, "synthesize.py", *argv], cwd=REPO, env=_env(), capture_output=True,
                               text=True, timeout=600)
        assert first.returncode == 1, first.stderr[-3000:]
        error = first.stderr.strip().splitlines()[-1]
        assert error.startswith("error: synthesis incomplete: rolegpt 2 record(s) missing"), error
        rerun = _after(error, "to ask only for the missing ones, rerun: ")
        server.fixed = True
        again = _shell(rerun)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len((out / "rolegpt" / "sft.jsonl").read_text().splitlines()) == 6
    [train] = [ln.split("train on it as it is: ", 1)[1] for ln in again.stdout.splitlines()
               if "train on it as it is: " in ln and "rolegpt" in ln]
    trained = _shell(f"{train} trainer.max_steps=1 data.val_fraction=0 hydra.run.dir='{tmp_path / 'train'}'")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "run summary: 1 step," in trained.stdout
