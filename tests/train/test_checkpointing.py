"""Finding a run's checkpoint: ``last.ckpt``, its ``.old`` twin after a crash mid-swap, SLURM's
``hpc_ckpt_<n>.ckpt`` by age; what counts as a training checkpoint and which run folder owns it.
Real files and real (interrupted) atomic saves; no training."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from rolemrc.checkpointing import checkpoint_run_dir, find_checkpoint, is_training_checkpoint
from rolemrc.checkpointing.io import AtomicCheckpointIO
from rolemrc.fileio import atomic_dir, swap_in


def touch(path: Path, mtime: float, dcp: bool = False) -> Path:
    """A ``.ckpt`` file, or (``dcp``) a sharded checkpoint folder, last modified at ``mtime``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if dcp:
        path.mkdir()
        (path / ".metadata").write_bytes(b"meta")
        (path / "__0_0.distcp").write_bytes(b"shard")
    else:
        path.write_bytes(b"ckpt")
    os.utime(path, (mtime, mtime))
    return path


T = 1_700_000_000.0


def test_nothing_to_find(tmp_path: Path) -> None:
    assert find_checkpoint(tmp_path) is None
    assert find_checkpoint(tmp_path / "no-such-run") is None
    touch(tmp_path / "checkpoints" / "last.ckpt.partial", T)  # a half-written save is never a checkpoint
    touch(tmp_path / "checkpoints" / "epoch=0-step=5.ckpt", T)  # only ``last`` resumes a run
    assert find_checkpoint(tmp_path) is None


@pytest.mark.parametrize("dcp", [False, True])
def test_last_and_its_old_twin(tmp_path: Path, dcp: bool) -> None:
    ckpts = tmp_path / "checkpoints"
    old = touch(ckpts / "last.ckpt.old", T + 50, dcp)
    assert find_checkpoint(tmp_path) == old  # crash between the two renames: the previous one
    last = touch(ckpts / "last.ckpt", T, dcp)
    assert find_checkpoint(str(tmp_path)) == last  # a complete last wins over .old, even an older one


@pytest.mark.parametrize("dcp", [False, True])
def test_newest_of_last_and_slurm_checkpoints(tmp_path: Path, dcp: bool) -> None:
    last = touch(tmp_path / "checkpoints" / "last.ckpt", T + 10, dcp)
    touch(tmp_path / "hpc_ckpt_1.ckpt", T, dcp)
    assert find_checkpoint(tmp_path) == last
    hpc2 = touch(tmp_path / "hpc_ckpt_2.ckpt", T + 20, dcp)
    assert find_checkpoint(tmp_path) == hpc2
    hpc3 = touch(tmp_path / "hpc_ckpt_3.ckpt", T + 15, dcp)  # a higher number but older: age decides
    assert find_checkpoint(tmp_path) == hpc2
    os.utime(hpc3, (T + 30, T + 30))
    assert find_checkpoint(tmp_path) == hpc3


def test_old_twin_competes_with_slurm_checkpoints_by_age(tmp_path: Path) -> None:
    old = touch(tmp_path / "checkpoints" / "last.ckpt.old", T + 10)
    hpc = touch(tmp_path / "hpc_ckpt_1.ckpt", T)
    assert find_checkpoint(tmp_path) == old
    os.utime(hpc, (T + 20, T + 20))
    assert find_checkpoint(tmp_path) == hpc


def test_interrupted_folder_swap_leaves_the_old_checkpoint_findable(tmp_path: Path, monkeypatch) -> None:
    """The crash ``swap_in`` guards against: the old folder moved aside, the new one not yet in."""
    ckpts = tmp_path / "checkpoints"
    final = touch(ckpts / "last.ckpt", T, dcp=True)
    (final / "step").write_text("6")
    tmp = touch(ckpts / "last.ckpt.partial", T + 1, dcp=True)
    (tmp / "step").write_text("9")

    real_rename = Path.rename

    def crash_on_second(self: Path, target):
        if self == tmp:
            raise OSError("killed mid-swap")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", crash_on_second)
    with pytest.raises(OSError, match="killed mid-swap"):
        swap_in(tmp, final)
    monkeypatch.undo()
    found = find_checkpoint(tmp_path)
    assert found == ckpts / "last.ckpt.old" and (found / "step").read_text() == "6"
    assert is_training_checkpoint(found)

    swap_in(tmp, final)  # the next save puts a complete last.ckpt back, which wins over the twin
    assert find_checkpoint(tmp_path) == final and (final / "step").read_text() == "9"
    assert not tmp.exists()
    newer = touch(ckpts / "last.ckpt.partial", T + 2, dcp=True)
    (newer / "step").write_text("12")
    swap_in(newer, final)  # and the save after that clears the stale twin
    assert find_checkpoint(tmp_path) == final and (final / "step").read_text() == "12"
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt"]


def test_failed_single_file_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    io = AtomicCheckpointIO()
    last = tmp_path / "checkpoints" / "last.ckpt"
    io.save_checkpoint({"global_step": 6}, last)
    with pytest.raises(Exception):
        io.save_checkpoint({"global_step": 9, "bad": lambda: None}, last)  # cannot be pickled
    assert find_checkpoint(tmp_path) == last
    assert torch.load(last, weights_only=True)["global_step"] == 6


def test_is_training_checkpoint(tmp_path: Path) -> None:
    assert is_training_checkpoint(touch(tmp_path / "a.ckpt", T))
    assert is_training_checkpoint(touch(tmp_path / "sharded", T, dcp=True))
    assert not is_training_checkpoint(touch(tmp_path / "model.safetensors", T))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert not is_training_checkpoint(tmp_path / "hf")
    assert not is_training_checkpoint(tmp_path / "missing.ckpt")


def test_checkpoint_run_dir(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("seed: 0\n")
    assert checkpoint_run_dir(touch(run / "checkpoints" / "last.ckpt", T)) == run.resolve()
    assert checkpoint_run_dir(touch(run / "hpc_ckpt_2.ckpt", T)) == run.resolve()
    assert checkpoint_run_dir(touch(run / "checkpoints" / "sharded.ckpt", T, dcp=True)) == run.resolve()
    stray = touch(tmp_path / "elsewhere" / "x" / "last.ckpt", T)
    with pytest.raises(FileNotFoundError, match=r"no \.hydra/config\.yaml"):
        checkpoint_run_dir(stray)


def test_read_checkpoint_entries_without_the_weights(tmp_path: Path) -> None:
    """A checkpoint's other entries (the precomputed DPO reference's tables), from a ``.ckpt``
    file or a DCP folder's ``meta.pt``; tensors copied out of the memory map."""
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    from rolemrc.checkpointing import read_checkpoint_entries

    entries = {"reference_logps": {"train": torch.arange(6.0).reshape(3, 2)}, "reference_rows": {"train": "ab12"}}
    torch.save({"state_dict": {"model.w": torch.ones(2)}, **entries}, tmp_path / "last.ckpt")
    (tmp_path / "last-dcp").mkdir()
    torch.save({"epoch": 0, **entries}, tmp_path / "last-dcp" / _METADATA_FILENAME)
    for path in (tmp_path / "last.ckpt", tmp_path / "last-dcp"):
        got = read_checkpoint_entries(path, ("reference_logps", "reference_rows", "absent"))
        assert set(got) == {"reference_logps", "reference_rows"}
        assert torch.equal(got["reference_logps"]["train"], entries["reference_logps"]["train"])
        assert got["reference_rows"] == {"train": "ab12"}
    assert read_checkpoint_entries(tmp_path / "last.ckpt", ("absent",)) == {}
    with pytest.raises(FileNotFoundError):
        read_checkpoint_entries(tmp_path / "none.ckpt", ("reference_logps",))


def test_atomic_dir_swaps_a_finished_folder_in_and_leaves_out_alone_on_failure(tmp_path: Path) -> None:
    """Exports: ``<out>.partial`` swapped in complete; a failed write keeps the previous export."""
    out = tmp_path / "export"
    with atomic_dir(out) as tmp:
        assert tmp == tmp_path / "export.partial" and tmp.is_dir()
        (tmp / "model.safetensors").write_text("v1")
    assert (out / "model.safetensors").read_text() == "v1" and not tmp.exists()
    with pytest.raises(RuntimeError, match="killed"):
        with atomic_dir(out) as tmp:
            (tmp / "model.safetensors").write_text("half")
            raise RuntimeError("killed")
    assert (out / "model.safetensors").read_text() == "v1"
    with atomic_dir(out) as tmp:  # the next attempt clears the leftover partial folder
        assert list(tmp.iterdir()) == []
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]


def _fit_loop_state(epochs_done: int, epoch_ready: int, batches: int, is_last_batch: bool) -> dict:
    progress = lambda ready, done: {"ready": ready, "started": ready, "processed": done, "completed": done}  # noqa: E731
    return {"epoch": epochs_done, "global_step": batches, "loops": {"fit_loop": {
        "epoch_progress": {"current": progress(epoch_ready, epochs_done), "total": progress(epoch_ready, epochs_done)},
        "epoch_loop.batch_progress": {"current": progress(batches, batches), "is_last_batch": is_last_batch}}}}


def test_only_an_epoch_cut_short_by_max_steps_is_reopened() -> None:
    from rolemrc.run.state import reopen_epoch_stopped_by_max_steps

    # Lightning's checkpoint at the end of a run stopped by max_steps: epoch counted as finished.
    cut = _fit_loop_state(epochs_done=1, epoch_ready=1, batches=2, is_last_batch=False)
    assert reopen_epoch_stopped_by_max_steps(cut)
    assert cut["epoch"] == 0 and cut["loops"]["fit_loop"]["epoch_progress"]["current"] == {
        "ready": 1, "started": 1, "processed": 0, "completed": 0}
    # Resumed at the start of epoch 2 and stopped inside it: Lightning counts epoch 2 finished, never started.
    resumed = _fit_loop_state(epochs_done=3, epoch_ready=2, batches=1, is_last_batch=False)
    assert reopen_epoch_stopped_by_max_steps(resumed)
    assert resumed["epoch"] == 2 and resumed["loops"]["fit_loop"]["epoch_progress"]["current"] == {
        "ready": 3, "started": 3, "processed": 2, "completed": 2}
    # Left as they are: an epoch that ran to its last batch, a checkpoint saved inside an epoch.
    ended = _fit_loop_state(epochs_done=1, epoch_ready=1, batches=31, is_last_batch=True)
    inside = _fit_loop_state(epochs_done=0, epoch_ready=1, batches=2, is_last_batch=False)
    for state in (ended, inside, {"state_dict": {}}):
        before = repr(state)
        assert not reopen_epoch_stopped_by_max_steps(state) and repr(state) == before


def test_an_epoch_whose_last_step_was_checkpointed_counts_as_complete() -> None:
    from rolemrc.run.state import completed_epochs

    # Saved as epoch 2's last step ended (a checkpoint interval dividing the epoch), the end of training.
    progress = lambda ready, done: {"ready": ready, "started": ready, "processed": done, "completed": done}  # noqa: E731
    at_end = {"loops": {"fit_loop": {"epoch_progress": {"current": progress(3, 2), "total": progress(3, 2)},
                                     "epoch_loop.batch_progress": {
                                         "current": {**progress(2, 2), "completed": 1},
                                         "total": {**progress(6, 6), "completed": 5}, "is_last_batch": True}}}}
    assert completed_epochs(at_end) == 3
    at_end["loops"]["fit_loop"]["epoch_loop.batch_progress"]["is_last_batch"] = False  # inside the epoch
    assert completed_epochs(at_end) == 2


def test_reopening_reads_the_checkpoint_lightning_writes(tmp_path: Path) -> None:
    """reopen_epoch_stopped_by_max_steps reads Lightning's private loop state: on a checkpoint
    Lightning itself writes at the end of a run that max_steps stopped mid-epoch, it finds the
    epoch cut short; a change of Lightning's format fails here."""
    import lightning as L
    import torch

    from rolemrc.run.state import completed_epochs, reopen_epoch_stopped_by_max_steps

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def run(max_steps: int) -> dict:
        trainer = L.Trainer(max_steps=max_steps, max_epochs=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                            enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path)
        trainer.fit(Tiny(), torch.utils.data.DataLoader(torch.ones(6, 2), batch_size=1))
        path = tmp_path / f"{max_steps}.ckpt"
        trainer.save_checkpoint(path)
        return torch.load(path, weights_only=True)

    cut, whole = run(max_steps=2), run(max_steps=-1)
    assert completed_epochs(dict(whole)) == 1 and not reopen_epoch_stopped_by_max_steps(whole)
    assert cut["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] == 1  # Lightning: "finished"
    assert reopen_epoch_stopped_by_max_steps(cut) and cut["epoch"] == 0 and completed_epochs(cut) == 0
