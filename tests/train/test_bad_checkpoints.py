"""A truncated, empty or corrupt checkpoint, given as ``ckpt_path=``, ``model.path=`` or to
export.py (which reads it with ``read_model_state``), ends in one ``error: <path>: <what is wrong>`` line and exit status 1, found without
reading the tensors, and never with advice to turn off ``weights_only``."""

from __future__ import annotations

import os
import pathlib
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rolemrc.checkpointing.state import read_model_state
from rolemrc.checkpointing.verify import check_checkpoint
from rolemrc.errors import CheckpointError, ConfigError, InputNotFound
from rolemrc.models.source import hf_model_path
from tests.conftest import ROOT, compose_train
from tests.train.helpers import train_in_process

# The tests share one finished run (run_dir): on one xdist worker, so it is made once.
pytestmark = pytest.mark.xdist_group("bad_checkpoints")

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
       "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
TINY = ["trainer.accelerator=cpu", "data.max_length=96", "data.val_fraction=0", "trainer.enable_progress_bar=false",
        "logger=csv", "export.enabled=false"]
UNSAFE_ADVICE = ("weights_only=False", "`weights_only` set to `False`", "weights_only set to False")


def python(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, script, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=600)


def one_error_line(done: subprocess.CompletedProcess) -> str:
    """The process failed with exit status 1, no traceback, and its last stderr line is the error."""
    assert done.returncode == 1, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not any(advice in done.stdout + done.stderr for advice in UNSAFE_ADVICE)
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), done.stderr[-3000:]
    return last


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step SFT run with checkpoints/last.ckpt."""
    run = train_in_process(tmp_path_factory.mktemp("ckpt") / "run", *TINY, "trainer.max_steps=2",
                           "runtime.checkpoint_every_n_steps=2")
    assert (run / "checkpoints" / "last.ckpt").is_file()
    return run


def broken_copies(good: Path, where: Path) -> dict[str, Path]:
    where.mkdir(parents=True, exist_ok=True)
    data = good.read_bytes()
    variants = {
        "truncated": data[: len(data) // 2],
        "empty": b"",
        "garbage": os.urandom(4096),
        "pickle_flipped": data[:150] + b"\xff" * 200 + data[350:],  # inside data.pkl, zip directory intact
    }
    out = {}
    for name, content in variants.items():
        (where / f"{name}.ckpt").write_bytes(content)
        out[name] = where / f"{name}.ckpt"
    torch.save({"state_dict": {}, "path": pathlib.PurePosixPath("/x")}, where / "not_plain.ckpt")
    torch.save([1, 2, 3], where / "not_lightning.ckpt")
    out["not_plain"], out["not_lightning"] = where / "not_plain.ckpt", where / "not_lightning.ckpt"
    return out


def test_single_file_checkpoints(run_dir: Path, tmp_path: Path) -> None:
    good = run_dir / "checkpoints" / "last.ckpt"
    assert check_checkpoint(good) == good
    expected = {"truncated": "truncated", "empty": "empty file", "garbage": "truncated or not a PyTorch checkpoint",
                "pickle_flipped": "corrupt", "not_plain": "PurePosixPath", "not_lightning": "no state_dict"}
    for name, path in broken_copies(good, tmp_path).items():
        with pytest.raises(CheckpointError) as err:
            check_checkpoint(path)
        message = str(err.value)
        assert message.startswith(f"{path}: ") and expected[name] in message, message
        assert not any(advice in message for advice in UNSAFE_ADVICE)
    with pytest.raises(InputNotFound, match="checkpoint not found"):
        check_checkpoint(tmp_path / "missing.ckpt")


def test_sharded_checkpoints(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    good = tmp_path / "good"
    dcp.save({"state_dict": {"model.w": torch.randn(32, 32), "model.b": torch.randn(32)}},
             storage_writer=dcp.FileSystemWriter(str(good)), no_dist=True)
    assert check_checkpoint(good) == good
    (shard,) = good.glob("*.distcp")
    cases = {}
    for name in ("truncated", "no_metadata", "bad_metadata", "no_shard"):
        cases[name] = tmp_path / name
        shutil.copytree(good, cases[name])
    os.truncate(cases["truncated"] / shard.name, shard.stat().st_size // 2)
    (cases["no_metadata"] / ".metadata").unlink()
    os.truncate(cases["bad_metadata"] / ".metadata", 10)
    (cases["no_shard"] / shard.name).unlink()
    expected = {"truncated": f"{cases['truncated'] / shard.name}: truncated",
                "no_metadata": f"{cases['no_metadata']}: not a complete sharded checkpoint (no .metadata",
                "bad_metadata": f"{cases['bad_metadata'] / '.metadata'}: unreadable",
                "no_shard": f"{cases['no_shard']}: shard file {shard.name} is missing"}
    for name, path in cases.items():
        with pytest.raises(CheckpointError) as err:
            check_checkpoint(path)
        assert str(err.value).startswith(expected[name]), str(err.value)


def test_entry_scripts_name_a_truncated_checkpoint(run_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "run"  # a copy of the run whose last.ckpt lost its second half
    shutil.copytree(run_dir, broken, ignore=shutil.ignore_patterns("exports"))
    ckpt = broken / "checkpoints" / "last.ckpt"
    ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    want = f"error: {ckpt}: truncated or not a PyTorch checkpoint"

    resumed = python("train.py", *TINY, "trainer.max_steps=3", f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path / 'r'}")
    assert one_error_line(resumed).startswith(want)

    # What evaluate.py, probe.py and model.path= resolve, and what export.py reads (their one
    # error line for a damaged checkpoint: the next test).
    with pytest.raises(CheckpointError, match="truncated or not a PyTorch checkpoint"):
        hf_model_path(str(ckpt))
    with pytest.raises(CheckpointError, match="truncated or not a PyTorch checkpoint"):
        read_model_state(ckpt)


def overwrite_middle(path: Path, start: int | None = None, end: int | None = None, size: int = 1 << 20) -> None:
    """``size`` random bytes written over the middle of ``path`` (or of its bytes ``start:end``);
    the file keeps its length, so only reading the tensors can notice."""
    data = bytearray(path.read_bytes())
    start, end = start or 0, end or len(data)
    size = min(size, end - start)
    first = (start + end) // 2 - size // 2
    data[first:first + size] = random.Random(0).randbytes(size)
    path.write_bytes(bytes(data))


def only_error_line(done: subprocess.CompletedProcess) -> str:
    last = one_error_line(done)
    assert sum(line.startswith("error:") for line in (done.stdout + done.stderr).splitlines()) == 1, done.stderr
    return last


def test_entry_scripts_name_a_checkpoint_overwritten_in_the_middle(run_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "run"  # the run's last.ckpt, of its right size, with 1 MB overwritten in the middle
    shutil.copytree(run_dir, broken, ignore=shutil.ignore_patterns("exports"))
    ckpt = broken / "checkpoints" / "last.ckpt"
    size = ckpt.stat().st_size
    overwrite_middle(ckpt)
    assert ckpt.stat().st_size == size and check_checkpoint(ckpt) == ckpt  # the cheap check cannot see it
    want = f"error: {ckpt}: corrupt, cannot be read ("

    resumed = python("train.py", *TINY, "trainer.max_steps=3", f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path / 'r'}")
    assert only_error_line(resumed).startswith(want)
    evaluated = python("evaluate.py", f"model.path={ckpt}", "limit=1", "generation.max_new_tokens=2",
                       "metrics.names=[bleu]", f"out_dir={tmp_path / 'e'}")
    assert only_error_line(evaluated).startswith(want)
    exported = python("export.py", str(ckpt), "--out", str(tmp_path / "x"))
    assert only_error_line(exported).startswith(want)
    assert not (tmp_path / "x").exists()


def test_a_damaged_shard_of_a_sharded_checkpoint_is_one_error_line(tmp_path: Path) -> None:
    """FSDP2 on one CPU process writes the DCP folder a multi-GPU run writes (one shard here)."""
    from torch.distributed.checkpoint import FileSystemReader

    fsdp = [*TINY, "strategy=fsdp", "strategy.param_dtype=null", "trainer.devices=1"]
    run = tmp_path / "run"
    done = python("train.py", *fsdp, "trainer.max_steps=1", f"hydra.run.dir={run}")
    assert done.returncode == 0, done.stderr[-3000:]
    ckpt = run / "checkpoints" / "last.ckpt"
    (shard,) = ckpt.glob("*.distcp")
    # The shard holds the model's weights (all that export.py and model.path= read) and the
    # optimizer states: the damage goes into the middle of the bytes the weights take.
    storage = FileSystemReader(str(ckpt)).read_metadata().storage_data
    spans = [(s.offset, s.offset + s.length) for k, s in storage.items() if k.fqn.startswith("state_dict.model.")]
    overwrite_middle(shard, min(a for a, _ in spans), max(b for _, b in spans))
    assert check_checkpoint(ckpt) == ckpt
    want = f"error: {ckpt}: corrupt, cannot be read ("

    resumed = python("train.py", *fsdp, "trainer.max_steps=2", f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path / 'r'}")
    assert only_error_line(resumed).startswith(want)
    exported = python("export.py", str(ckpt), "--out", str(tmp_path / "x"))
    assert only_error_line(exported).startswith(want)
    with pytest.raises(CheckpointError, match="corrupt, cannot be read"):  # what model.path=<checkpoint> reads
        read_model_state(ckpt)
    # Resuming it without strategy=fsdp names the mismatch rather than calling the folder corrupt
    # (a ConfigError: entry scripts print it as the one error line above).
    from rolemrc.run.train import run

    with pytest.raises(ConfigError, match=r"is a sharded \(FSDP\) checkpoint: resume it with strategy=fsdp"):
        run(compose_train([*TINY, "trainer.max_steps=2", f"ckpt_path={ckpt}"], run_dir=tmp_path / "s"))
