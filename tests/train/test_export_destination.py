"""export.py never deletes what it did not write: ``--out`` must be new, empty, or a previous
export (replaced only with ``--overwrite``); a run folder, a checkpoint's folder, a folder of
other files, a file and a read-only place are each one ``error:`` line, everything left as it
was. ``--adapter`` and ``--merge`` write beside the run's ``export/`` (never over it),
``--adapter`` on a full fine-tune is an error, and the printed path is absolute. Run through
export.py itself, in this process (``runpy``: no interpreter start-up), on run folders made
without training (a saved config and a checkpoint of a fresh tiny model)."""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from rolemrc.models.loading import load_model, load_tokenizer
from tests.conftest import ROOT, compose_train

TINY = ["trainer.accelerator=cpu", "data.max_length=96", "logger=csv"]
LORA = ["model.peft.enabled=true", "model.peft.r=4", "model.peft.merge_on_export=true"]


def make_run(where: Path, *overrides: str) -> Path:
    """A run folder as train.py leaves it, without training: .hydra/config.yaml and checkpoints/last.ckpt."""
    cfg = compose_train([*TINY, *overrides], run_dir=where)
    (where / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), where / ".hydra" / "config.yaml")
    torch.manual_seed(0)
    model = load_model(cfg.model, load_tokenizer(cfg.model))
    (where / "checkpoints").mkdir()
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "global_step": 1},
               where / "checkpoints" / "last.ckpt")
    return where


def export_py(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str, str]:
    """``python export.py <args>`` in this process: (exit status, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["export.py", *args])
    capsys.readouterr()
    code = 0
    try:
        runpy.run_path(str(ROOT / "export.py"), run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def one_error(result: tuple[int, str, str]) -> str:
    code, out, err = result
    assert code == 1, (code, out, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_out_replaces_only_a_previous_export(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    run = make_run(tmp_path / "run")
    ckpt = str(run / "checkpoints" / "last.ckpt")
    before = snapshot(run)

    # The run folder itself, its checkpoints/ folder, a folder above it: never, even with --overwrite.
    for out in (run, run / "checkpoints", tmp_path):
        for extra in ([], ["--overwrite"]):
            line = one_error(export_py(capsys, monkeypatch, ckpt, "--out", str(out), *extra))
            assert str(out) in line and "choose another folder" in line, line
    assert snapshot(run) == before

    # A folder of someone's files: refused, with or without --overwrite; nothing deleted.
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    for extra in ([], ["--overwrite"]):
        line = one_error(export_py(capsys, monkeypatch, ckpt, "--out", str(notes), *extra))
        assert line.startswith(f"error: {notes} is not empty and holds files no export wrote") and "todo.txt" in line
    assert (notes / "todo.txt").read_text() == "keep me"

    # A file, and a path below a file: one line each, the file untouched.
    a_file = tmp_path / "model.bin"
    a_file.write_text("x")
    for out in (a_file, a_file / "sub"):
        line = one_error(export_py(capsys, monkeypatch, ckpt, "--out", str(out)))
        assert f"{a_file} is a file, not a folder" in line, line
    assert a_file.read_text() == "x"

    # A read-only place: one line before any work.
    target = tmp_path / "ro" / "export"
    target.parent.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == target.parent else real_access(p, mode, **kw))
    line = one_error(export_py(capsys, monkeypatch, ckpt, "--out", str(target)))
    assert line.startswith(f"error: {target}: cannot write the export in {target.parent}") and "--out" in line
    monkeypatch.setattr(os, "access", real_access)

    # A new folder: written, with its manifest; the printed path is absolute. Again: --overwrite needed.
    monkeypatch.chdir(tmp_path)
    code, out, err = export_py(capsys, monkeypatch, ckpt, "--out", "exp")
    assert code == 0, err[-3000:]
    exported = tmp_path / "exp"
    assert f"exported model: {exported}" in out.splitlines()
    manifest = json.loads((exported / "rolemrc_export.json").read_text())
    assert manifest["complete"] and "model.safetensors" in manifest["files"] and manifest["kind"] == "model"
    line = one_error(export_py(capsys, monkeypatch, ckpt, "--out", "exp"))
    assert line == f"error: {exported} holds a previous export: pass --overwrite to replace it, or --out <another folder>"
    code, out, err = export_py(capsys, monkeypatch, ckpt, "--out", "exp", "--overwrite")
    assert code == 0, err[-3000:]
    # A file added to the export since: --overwrite does not delete it.
    (exported / "eval_notes.md").write_text("mine")
    line = one_error(export_py(capsys, monkeypatch, ckpt, "--out", "exp", "--overwrite"))
    assert "eval_notes.md" in line
    (exported / "eval_notes.md").unlink()
    # Writing clears <out>.old (the swap's twin): never someone's folder of that name.
    (tmp_path / "exp.old").mkdir()
    (tmp_path / "exp.old" / "data.csv").write_text("1,2")
    line = one_error(export_py(capsys, monkeypatch, ckpt, "--out", "exp", "--overwrite"))
    assert str(tmp_path / "exp.old") in line and "data.csv" in line
    assert (tmp_path / "exp.old" / "data.csv").read_text() == "1,2"
    assert snapshot(run) == before


def test_adapter_and_merge_write_beside_the_run_export(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    full = make_run(tmp_path / "full")
    line = one_error(export_py(capsys, monkeypatch, str(full), "--adapter"))
    assert line.startswith(f"error: --adapter: {full} is a full fine-tune (model.peft.enabled=false")
    assert not any(p.name.startswith("export") for p in full.iterdir())

    lora = make_run(tmp_path / "lora", *LORA)
    monkeypatch.chdir(tmp_path)
    code, out, err = export_py(capsys, monkeypatch, "lora")  # a relative run folder: the printed path is absolute
    assert code == 0, err[-3000:]
    assert f"exported model: {lora / 'export'}" in out.splitlines()
    export = snapshot(lora / "export")
    line = one_error(export_py(capsys, monkeypatch, "lora"))
    assert "holds a previous export: pass --overwrite" in line
    for flag, folder, weights in (("--adapter", "export-adapter", "adapter_model.safetensors"),
                                  ("--merge", "export-merged", "model.safetensors")):
        code, out, err = export_py(capsys, monkeypatch, "lora", flag)
        assert code == 0, err[-3000:]
        assert f"exported model: {lora / folder}" in out.splitlines()
        assert (lora / folder / weights).is_file()
    assert snapshot(lora / "export") == export  # the run's own export, untouched


def test_a_run_whose_export_dir_holds_other_files_stops_before_training(tmp_path: Path) -> None:
    """The end-of-run export replaces only a previous export: ``export.dir`` naming the run folder
    itself or a folder of other files is refused when the run starts, not after it trained."""
    from rolemrc.errors import ConfigError
    from rolemrc.run.train import run

    run_dir = tmp_path / "run"
    (run_dir / "notes").mkdir(parents=True)
    (run_dir / "notes" / "todo.txt").write_text("keep me")
    for where, says in (("notes", "holds files no export wrote"), (".", "holds a training run or checkpoint")):
        (run_dir / ".hydra").mkdir(exist_ok=True)
        cfg = compose_train([*TINY, f"export.dir={where}", "trainer.max_steps=1"], run_dir=run_dir)
        with pytest.raises(ConfigError) as err:
            run(cfg)
        assert str(err.value).startswith(f"export.dir={where}: ") and says in str(err.value), str(err.value)
    assert (run_dir / "notes" / "todo.txt").read_text() == "keep me"
    assert not (run_dir / "checkpoints").exists()


def test_a_hub_cache_base_is_named_by_its_hub_id() -> None:
    """An adapter's base given as a folder of the HF hub cache is written as its hub id and revision
    (loadable on any machine), not as this machine's path."""
    from rolemrc.models.export import _hub_snapshot

    snapshot_dir = Path("/home/u/.cache/huggingface/hub/models--Qwen--Qwen2.5-7B/snapshots/0123abc")
    assert _hub_snapshot(snapshot_dir) == ("Qwen/Qwen2.5-7B", "0123abc")
    assert _hub_snapshot(Path("/data/models/qwen")) is None
