"""The encoded-row store (rolemrc.data.store): the same rows, batches, report and step-1 loss
with and without it; a second start encodes nothing; a changed input rebuilds; a damaged store is
detected and rebuilt; concurrent builders do not corrupt each other. (Two DDP ranks share one build:
tests/distributed/test_strategies.py.)"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from rolemrc import asset
from rolemrc.data import store as store_mod
from rolemrc.data.datamodule import ChatDataModule
from rolemrc.data.templates import ChatFormat
from rolemrc.run.train import run
from tests.conftest import FAST, ROOT, compose_train
from tests.train.helpers import series


@pytest.fixture(scope="module")
def chat() -> ChatFormat:
    return ChatFormat(AutoTokenizer.from_pretrained(asset("tokenizers/tiny-llama3")))


def data_cfg(kind: str, cache_dir: Path, cache: bool = True, packing: bool = False, path: str | None = None, **kw):
    src = path or asset(f"sample/{'sft' if kind == 'sft' else 'pairs'}.jsonl")
    # weight 1.5: duplicates and a seeded subsample; val_fraction: a holdout
    cfg = {"name": "t", kind: [{"path": str(src), "weight": 1.5}], "val_fraction": 0.1, "max_length": 384,
           "max_prompt_length": 256, "packing": packing, "batch_size": 3, "cache": cache, "cache_dir": str(cache_dir)}
    return OmegaConf.create({**cfg, **kw})


def loaded(dm: ChatDataModule) -> dict:
    """Everything a run reads from a datamodule: items, their step weights, batches, report."""
    train, val = dm.items("train"), dm.items("val")
    batches = [{k: v.tolist() for k, v in b.items()} for b in dm.train_dataloader()]
    return {"train": [train[i] for i in range(len(train))], "val": [val[i] for i in range(len(val))],
            "weights": dm._item_weights("train", train).tolist(), "batches": batches, "report": dm.report}


@pytest.mark.parametrize("kind,packing,share", [("sft", False, False), ("sft", True, False), ("pairs", False, False),
                                                ("pairs", True, True), ("pairs", False, True)])
def test_same_rows_batches_and_report_with_and_without_the_store(chat, tmp_path: Path, kind, packing, share) -> None:
    seen = []
    for cache in (False, True, True):  # in memory, building, reusing
        dm = ChatDataModule(data_cfg(kind, tmp_path / "cache", cache, packing), kind, chat, share_prompt=share,
                            report_dir=str(tmp_path / f"run{len(seen)}"))
        dm.setup()
        assert (dm.store is not None) == cache
        seen.append(loaded(dm))
        seen[-1]["report_file"] = (tmp_path / f"run{len(seen) - 1}" / f"data_report_{kind}.json").read_text()
    assert seen[0] == seen[1] == seen[2]
    assert seen[0]["val"] and seen[0]["batches"]


def test_data_cache_false_writes_nothing(chat, tmp_path: Path) -> None:
    ChatDataModule(data_cfg("sft", tmp_path / "cache", cache=False), "sft", chat).setup()
    assert not (tmp_path / "cache").exists()


def test_the_second_start_encodes_nothing(chat, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = ChatDataModule(data_cfg("pairs", tmp_path), "pairs", chat)
    first.setup()
    builds = store_mod.BUILDS["count"]

    def refuse(*args, **kwargs):
        raise AssertionError("encoded on the second start")

    for name in ("encode_pair", "encode_pairs", "encode_conversation", "encode_conversations", "tokenize", "tokenize_many"):
        monkeypatch.setattr(ChatFormat, name, refuse)
    second = ChatDataModule(data_cfg("pairs", tmp_path), "pairs", chat)
    second.setup()
    assert store_mod.BUILDS["count"] == builds
    assert second.store.folder == first.store.folder
    assert list(second.train_rows) == list(first.train_rows)


def test_a_changed_input_or_setting_rebuilds(chat, tmp_path: Path) -> None:
    data = tmp_path / "sft.jsonl"
    lines = Path(asset("sample/sft.jsonl")).read_text().splitlines()
    data.write_text("\n".join(lines[:30]) + "\n")
    folder = lambda **kw: ChatDataModule(data_cfg("sft", tmp_path / "c", path=str(data), **kw), "sft", chat)  # noqa: E731
    dm = folder()
    dm.setup()
    again = folder()
    again.setup()
    assert again.store.folder == dm.store.folder
    data.write_text("\n".join(lines[:31]) + "\n")  # one more record
    grown = folder()
    grown.setup()
    assert grown.store.folder != dm.store.folder and len(grown.train_rows) > len(dm.train_rows)
    shorter = folder(max_length=64)
    shorter.setup()
    assert shorter.store.folder != grown.store.folder
    assert max(len(r["input_ids"]) for r in shorter.train_rows) <= 64
    reseeded = ChatDataModule(data_cfg("sft", tmp_path / "c", path=str(data)), "sft", chat, seed=7)
    reseeded.setup()
    assert reseeded.store.folder != grown.store.folder


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_meta"])
def test_a_damaged_store_is_detected_and_rebuilt(chat, tmp_path: Path, caplog, damage: str) -> None:
    dm = ChatDataModule(data_cfg("sft", tmp_path), "sft", chat)
    dm.setup()
    rows = list(dm.train_rows)
    folder = dm.store.folder
    del dm
    ids = folder / "ids.bin"
    if damage == "truncate":  # cut by hand
        with ids.open("r+b") as fh:
            fh.truncate(ids.stat().st_size // 2)
    elif damage == "flip":  # same size, one byte changed
        data = bytearray(ids.read_bytes())
        data[len(data) // 3] ^= 0xFF
        ids.write_bytes(bytes(data))
    else:  # what a build killed before its rename would leave, had it been renamed
        (folder / "meta.json").unlink()
    builds = store_mod.BUILDS["count"]
    with caplog.at_level(logging.INFO, logger="rolemrc.data.store"):
        again = ChatDataModule(data_cfg("sft", tmp_path), "sft", chat)
        again.setup()
    assert any("damaged" in r.getMessage() and "rebuilding" in r.getMessage() for r in caplog.records), caplog.text
    assert store_mod.BUILDS["count"] == builds + 1
    assert list(again.train_rows) == rows


def test_a_killed_builds_leftovers_are_never_read_and_are_cleared(chat, tmp_path: Path) -> None:
    dm = ChatDataModule(data_cfg("sft", tmp_path), "sft", chat)
    dm.setup()
    key = dm.store.folder.name
    stale = tmp_path / "data_leftover"
    stale.mkdir()
    (tmp_path / f"{key}.tmp-99999").mkdir()  # a build killed half-way
    (tmp_path / f"{key}.tmp-99999" / "ids.bin").write_bytes(b"\0" * 10)
    import shutil

    shutil.rmtree(dm.store.folder)
    again = ChatDataModule(data_cfg("sft", tmp_path), "sft", chat)
    again.setup()
    assert not (tmp_path / f"{key}.tmp-99999").exists()
    assert list(again.train_rows) == list(dm.train_rows)


BUILD_SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
from omegaconf import OmegaConf
from transformers import AutoTokenizer
from rolemrc import asset
from rolemrc.data.datamodule import ChatDataModule
from rolemrc.data.templates import ChatFormat
chat = ChatFormat(AutoTokenizer.from_pretrained(asset("tokenizers/tiny-llama3")))
cfg = OmegaConf.create({"name": "t", "sft": [{"path": asset("sample/sft.jsonl")}], "cache_dir": sys.argv[1],
                        "max_length": 256})
dm = ChatDataModule(cfg, "sft", chat)
dm.setup()
print("ROWS", len(dm.train_rows), sum(len(r["input_ids"]) for r in dm.train_rows))
"""


def test_two_runs_starting_at_once_build_once_and_agree(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", BUILD_SCRIPT, str(tmp_path)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum(o.count("data store: encoded") for o in outs) == 1, outs
    assert sum(o.count("reusing") for o in outs) == 1, outs
    rows = [next(line for line in o.splitlines() if line.startswith("ROWS")) for o in outs]
    assert rows[0] == rows[1]


def test_step_totals_come_from_the_store(chat, tmp_path: Path) -> None:
    """The per-row totals stored at build equal what the collator-side function computes."""
    from rolemrc.data.datamodule import item_totals

    for kind in ("sft", "pairs"):
        dm = ChatDataModule(data_cfg(kind, tmp_path), kind, chat)
        dm.setup()
        stored = dm.store.totals("train")
        assert stored.tolist() == [list(item_totals(r)) for r in dm.train_rows]
        assert stored.dtype == np.int64


# ---------------------------------------------------------------------------------------- training

FIRST_STEP = ["trainer.max_steps=1", "export.enabled=false", "data.max_length=192", "data.max_prompt_length=96"]


@pytest.mark.parametrize("objective", [["objective=sft", "data.packing=true"],
                                       ["objective=dpo", "objective.reference=precomputed", "objective.share_prompt=true"]])
def test_step_one_loss_is_identical_with_and_without_the_store(tmp_path: Path, objective) -> None:
    losses = []
    for i, cache in enumerate(("false", "true", "true")):  # in memory, building, reusing
        cfg = compose_train([*FAST, *FIRST_STEP, *objective, f"data.cache={cache}",
                             f"data.cache_dir={tmp_path / 'store'}"], run_dir=tmp_path / f"run{i}")
        out = run(cfg)
        losses.append(series(Path(out["run_dir"]), "train/loss"))
    assert len(losses[0]) == 1
    assert losses[0] == losses[1] == losses[2]  # float equality


# Two DDP ranks share one build: checked in the DDP run of tests/distributed/test_strategies.py
# (one 2-process train.py launch serves both).


def test_checkpoints_hold_the_sampler_place_in_stored_rows(tmp_path: Path) -> None:
    """The train loader's state (saved once, in Lightning's fit-loop state) says where the sampler stands:
    the epoch, this rank's micro-batches trained in it, and the layout (the store's rows) they count."""
    import torch

    cfg = compose_train([*FAST, "trainer.max_steps=3", "export.enabled=false", "data.max_length=96",
                         "data.val_fraction=0", "trainer.accumulate_grad_batches=2",
                         f"data.cache_dir={tmp_path / 'store'}"], run_dir=tmp_path / "run")
    out = run(cfg)
    ckpt = torch.load(Path(out["run_dir"]) / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert "ChatDataModule" not in ckpt  # saved once: not a second time as the DataModule's state
    (loader,) = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    place = loader["sampler_place"]
    assert place["epoch"] == 0 and place["batches"] == 6  # 3 steps of 2 micro-batches
    (meta_file,) = (tmp_path / "store").glob("sft-*/meta.json")
    meta = json.loads(meta_file.read_text())
    assert place["layout"]["rows"] == meta["fingerprints"]["train"]
    assert place["layout"]["items"] == meta["report"]["train"]["examples"]
