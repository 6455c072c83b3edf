"""Checkpoint files that could run code or lose work (issue 35, items 1, 4 and 8):

- a sharded (DCP) checkpoint's ``.metadata`` is a plain pickle: a crafted one runs nothing when
  given as ``train.py ckpt_path=<folder>``, ``ckpt_path=last`` or ``model.path=<run>`` (a marker
  file its payload would create stays absent) and is one ``error:`` line naming it; the same for
  the other pickles read before loading (a shard's non-tensor entries, which torch's loader
  unpickles with ``weights_only=False``, and Lightning's ``meta.pt``);
- ``.last.ckpt.tmp<pid>`` left by a killed save is deleted at the next save (a live writer's is kept);
- a full disk during a checkpoint save is a one-line StorageError naming the checkpoint and the
  command that continues; the previous checkpoint stays whole and no temporary file is left;
- a sharded checkpoint's files must be inside its folder (links followed) and its ``.metadata``
  may declare no tensor larger than its shards hold.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rolemrc.checkpointing.io import AtomicCheckpointIO
from rolemrc.checkpointing.state import read_model_state
from rolemrc.checkpointing.verify import check_checkpoint
from rolemrc.errors import CheckpointError, StorageError, UserError
from rolemrc.models.source import hf_model_path
from tests.conftest import ROOT, compose_train
from tests.train.helpers import train_in_process

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
       "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
TINY = ["trainer.accelerator=cpu", "data.max_length=96", "data.val_fraction=0", "trainer.enable_progress_bar=false",
        "logger=csv", "export.enabled=false", "callbacks=none"]


class Payload:
    """Unpickling this creates ``marker``: what a crafted checkpoint would do with any code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def dcp_folder(path: Path) -> Path:
    """A sharded checkpoint as FSDP writes it: tensors and a non-tensor (bytes) entry."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"state_dict": {"model.w": torch.randn(8, 8)}, "optimizer": {"lr": 0.5, "betas": (0.9, 0.99)}},
             storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    return path


def crafted_run(root: Path, marker: Path) -> Path:
    """A run folder whose ``checkpoints/last.ckpt`` is a sharded checkpoint with a crafted ``.metadata``."""
    run = root / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("seed: 0\n")
    ckpt = dcp_folder(run / "checkpoints" / "last.ckpt")
    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    return run


def test_a_crafted_metadata_runs_nothing_through_the_entry_points(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    run = crafted_run(tmp_path, marker)
    ckpt = run / "checkpoints" / "last.ckpt"
    want = f"{ckpt / '.metadata'}: unreadable, the checkpoint is corrupt or not a checkpoint"

    # ckpt_path=last through train.py itself: the run folder is read before Hydra starts, then resolved
    done = subprocess.run([sys.executable, "train.py", *TINY, "strategy=fsdp", "ckpt_path=last",
                           f"hydra.run.dir={run}"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: {want}"), done.stderr[-3000:]
    assert "refused: unpickling it could run code" in done.stderr
    assert not marker.exists()

    from rolemrc.run.train import run as train

    for override in (f"ckpt_path={ckpt}", f"model.path={run}"):
        with pytest.raises(CheckpointError, match="unreadable, the checkpoint is corrupt"):
            train(compose_train([*TINY, "strategy=fsdp", override], run_dir=tmp_path / "other"))
        assert not marker.exists(), override
    for read in (hf_model_path, read_model_state, check_checkpoint):  # evaluate.py/probe.py, export.py
        with pytest.raises(CheckpointError, match="unreadable"):
            read(str(ckpt))
    assert not marker.exists()


def test_the_other_pickles_of_a_sharded_checkpoint_must_be_plain(tmp_path: Path) -> None:
    """Its bytes entries (torch's loader unpickles them with weights_only=False) and Lightning's
    meta.pt; a genuine folder with bytes entries passes and its weights read back."""
    from torch.distributed.checkpoint import FileSystemReader

    good = dcp_folder(tmp_path / "good")
    torch.save({"global_step": 3, "loops": {"fit_loop": {"epoch": 0}}}, good / "meta.pt")
    assert check_checkpoint(good) == good
    assert set(read_model_state(good)) == {"w"}

    marker = tmp_path / "marker"
    entry = tmp_path / "entry"  # the lr entry pointed at a crafted pickle in a new shard
    shutil.copytree(good, entry)
    meta = FileSystemReader(str(good)).read_metadata()  # our own, genuine file
    blob = io.BytesIO()
    torch.save(Payload(marker), blob)
    (entry / "evil.distcp").write_bytes(blob.getvalue())
    (index,) = [k for k in meta.storage_data if k.fqn == "optimizer.lr"]
    meta.storage_data[index].relative_path = "evil.distcp"
    meta.storage_data[index].offset, meta.storage_data[index].length = 0, len(blob.getvalue())
    (entry / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointError, match=r"evil.distcp: entry optimizer.lr is not plain data .* refused"):
        check_checkpoint(entry)

    outside = tmp_path / "outside"  # an entry pointing out of the folder
    shutil.copytree(good, outside)
    meta.storage_data[index].relative_path = "../good/__0_0.distcp"
    (outside / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointError, match="points outside the checkpoint folder"):
        check_checkpoint(outside)

    lightning = tmp_path / "meta_pt"
    shutil.copytree(good, lightning)
    torch.save({"global_step": Payload(marker)}, lightning / "meta.pt")
    with pytest.raises(CheckpointError, match=r"meta.pt: Lightning's meta.pt is not plain data"):
        check_checkpoint(lightning)
    assert not marker.exists()


def test_a_sharded_checkpoint_reads_only_its_own_files_within_their_sizes(tmp_path: Path) -> None:
    """A shard, ``meta.pt`` or ``.metadata`` that is a link to a file outside the folder is refused
    (a link inside it is not); a ``.metadata`` declaring a tensor larger than the bytes its shards
    hold for it (2^40 elements: a 4 TiB allocation) is refused before anything is allocated:
    one ``error:`` line through train.py, the same error from every reader."""
    from torch.distributed.checkpoint import FileSystemReader

    good = dcp_folder(tmp_path / "good")
    torch.save({"global_step": 3}, good / "meta.pt")
    (shard,) = [p.name for p in good.glob("*.distcp")]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in (shard, "meta.pt", ".metadata"):
        case = tmp_path / f"link{name}"
        shutil.copytree(good, case)
        (case / name).rename(elsewhere / name)
        (case / name).symlink_to(elsewhere / name)
        with pytest.raises(CheckpointError) as err:
            check_checkpoint(case)
        assert str(err.value).startswith(f"{case}: {name} is a link to {elsewhere / name}, outside the checkpoint "
                                         "folder; refused"), str(err.value)
    inside = tmp_path / "inside"  # linked within the folder: its own file
    shutil.copytree(good, inside)
    (inside / "meta.pt").rename(inside / "meta.pt.real")
    (inside / "meta.pt").symlink_to("meta.pt.real")
    assert check_checkpoint(inside) == inside

    marker = tmp_path / "marker"
    run = crafted_run(tmp_path / "big", marker)
    big = run / "checkpoints" / "last.ckpt"
    meta = FileSystemReader(str(good)).read_metadata()
    meta.state_dict_metadata["state_dict.model.w"].size = torch.Size([1 << 20, 1 << 20])  # 2^40 floats
    (big / ".metadata").write_bytes(pickle.dumps(meta))
    want = (f"{big / '.metadata'}: entry state_dict.model.w declares a tensor of shape [1048576, 1048576] (4.0 TiB "
            "of float32) but the shards hold ")
    done = subprocess.run([sys.executable, "train.py", *TINY, f"model.path={run}", f"hydra.run.dir={tmp_path / 'new'}"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: {want}"), done.stderr[-3000:]
    from rolemrc.run.train import run as train

    with pytest.raises(CheckpointError, match="declares a tensor of shape"):
        train(compose_train([*TINY, "strategy=fsdp", f"ckpt_path={big}"], run_dir=tmp_path / "other"))
    for read in (hf_model_path, read_model_state, check_checkpoint):  # evaluate.py/probe.py, export.py
        with pytest.raises(CheckpointError) as err:
            read(str(big))
        assert str(err.value).startswith(want), str(err.value)
    meta.state_dict_metadata["state_dict.model.w"].size = torch.Size([1 << 40])  # the chunk no longer fits it
    (big / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointError, match=r"entry state_dict.model.w has a chunk \(offsets \[0, 0\], sizes \[8, 8\]\) "
                                              r"outside its declared shape \[1099511627776\]"):
        check_checkpoint(big)


def test_a_killed_saves_temporary_file_is_removed_at_the_next_save(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    leaked = folder / f".last.ckpt.tmp{dead.pid}"  # a save SIGKILLed before its rename
    leaked.write_bytes(b"\0" * 4096)
    live = folder / f".last.ckpt.tmp{os.getppid()}"  # a writer still at work
    live.write_bytes(b"\0" * 16)
    hpc = folder / f".hpc_ckpt_1.ckpt.tmp{dead.pid}"  # a killed SLURM save (the next is hpc_ckpt_2)
    hpc.write_bytes(b"\0")
    summary = folder / f".run_summary.json.tmp{dead.pid}"  # not a checkpoint's: not this writer's to judge
    summary.write_bytes(b"{")
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(2)}}, folder / "last.ckpt")
    assert not leaked.exists() and not hpc.exists() and live.exists() and summary.exists()
    assert torch.load(folder / "last.ckpt", weights_only=True)["state_dict"]["w"].tolist() == [1.0, 1.0]


class _Full(io.RawIOBase):
    """A file on a disk with ``room`` bytes left: a larger write fails with ENOSPC."""

    def __init__(self, fh, room: int) -> None:
        self.fh, self.room = fh, room

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        if len(b) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(b)
        return self.fh.write(b)


def test_a_full_disk_during_a_checkpoint_save_is_one_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second save of a run finds the disk full: a StorageError naming the checkpoint and
    what to do (the entry scripts print it as one ``error:`` line); the first checkpoint stays."""
    import rolemrc.checkpointing.io as ckpt_io

    saves = []
    real_save = torch.save

    def save(obj, fh, *args, **kwargs):
        saves.append(fh)
        return real_save(obj, _Full(fh, 1 << 16) if len(saves) > 1 else fh, *args, **kwargs)

    monkeypatch.setattr(ckpt_io.torch, "save", save)
    run = tmp_path / "run"
    with pytest.raises(StorageError) as err:
        train_in_process(run, *TINY, "trainer.max_steps=2", "runtime.checkpoint_every_n_steps=1")
    ckpt = run / "checkpoints" / "last.ckpt"
    assert isinstance(err.value, UserError) and len(saves) == 2
    assert str(err.value) == (f"{ckpt}: saving the checkpoint failed: no space left on the device; free space there, "
                              f"or move the run folder to a disk with room; then continue it: python train.py "
                              f"hydra.run.dir={run} ckpt_path=last (with the folder's new path if moved)")
    monkeypatch.undo()
    assert torch.load(ckpt, weights_only=True)["global_step"] == 1
    assert not list(ckpt.parent.glob(".last.ckpt.tmp*"))


def test_a_model_folder_with_custom_code_is_refused_in_one_line(tmp_path: Path) -> None:
    """``model.path`` naming a folder whose config maps to its own code (``auto_map``): transformers'
    refusal (trust_remote_code off) is one ModelSourceError naming the key and what to do; the code never runs."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from rolemrc import asset
    from rolemrc.config import typed
    from rolemrc.errors import ModelSourceError
    from rolemrc.models.loading import load_model

    folder, marker = tmp_path / "custom", tmp_path / "marker"
    AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=512, hidden_size=16, intermediate_size=32,
                                                 num_hidden_layers=1, num_attention_heads=2,
                                                 num_key_value_heads=1)).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(asset("tokenizers/tiny-llama3"))
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="my_custom", auto_map={"AutoConfig": "custom.MyConfig",
                                                    "AutoModelForCausalLM": "custom.MyModel"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "custom.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                      "from transformers import LlamaConfig as MyConfig, LlamaForCausalLM as MyModel\n")
    cfg = compose_train([f"model.path={folder}"], run_dir=tmp_path / "run")
    with pytest.raises(ModelSourceError) as err:
        load_model(typed(cfg.model), tokenizer)
    assert str(err.value) == (f"model.path={folder}: its config names custom code (auto_map) that transformers would "
                              "have to run, refused: read that code, and only if you trust it set "
                              "model.trust_remote_code=true")
    assert not marker.exists()


def test_a_full_disk_on_one_rank_of_a_sharded_save_is_one_error(tmp_path: Path) -> None:
    """What torch.distributed.checkpoint raises when a rank's write fails (a CheckpointException
    holding each failed rank's exception) becomes the same StorageError; other failures stay as they are."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from rolemrc.checkpointing.io import _storage_fault

    final = tmp_path / "checkpoints" / "last.ckpt"
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    err = CheckpointException("save failed", {1: (full, traceback.StackSummary())})
    converted = _storage_fault(err, final, "saving the sharded checkpoint")
    assert isinstance(converted, StorageError) and str(converted).startswith(
        f"{final}: saving the sharded checkpoint failed: no space left on the device; free space there")
    bug = CheckpointException("save failed", {0: (KeyError("optimizer"), traceback.StackSummary())})
    assert _storage_fault(bug, final, "saving the sharded checkpoint") is None
    assert _storage_fault(OSError(errno.EIO, "I/O error"), final, "saving") is None
