"""Every encoded row fits data.max_length; a pair layout that cannot is refused before anything
loads, naming both keys."""

from __future__ import annotations

import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from rolemrc import asset
from rolemrc.data.readers import read_examples
from rolemrc.data.templates import ChatFormat
from rolemrc.run.train import run
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def chat() -> ChatFormat:
    return ChatFormat(AutoTokenizer.from_pretrained(asset("tokenizers/tiny-llama3")))


@pytest.mark.parametrize("max_length,max_prompt_length", [(64, 48), (40, 39), (200, 16)])
def test_pair_rows_fit(chat: ChatFormat, max_length: int, max_prompt_length: int) -> None:
    pairs, _ = read_examples([{"path": asset("sample/pairs.jsonl")}], "pairs")
    for p in pairs:
        enc = chat.encode_pair(p.prompt, p.chosen, p.rejected, max_length, max_prompt_length)
        assert len(enc.prompt_ids) <= max_prompt_length
        assert len(enc.prompt_ids) + max(len(enc.chosen_ids), len(enc.rejected_ids)) <= max_length


def test_sft_rows_fit(chat: ChatFormat) -> None:
    convs, _ = read_examples([{"path": asset("sample/sft.jsonl")}], "sft")
    for c in convs:
        assert len(chat.encode_conversation(c.messages, 50).input_ids) <= 50


def test_prompt_as_long_as_the_row_is_refused(chat: ChatFormat, train_cfg) -> None:
    pairs, _ = read_examples([{"path": asset("sample/pairs.jsonl")}], "pairs")
    with pytest.raises(ValueError, match=r"data.max_prompt_length=64 must be below data.max_length=64"):
        chat.encode_pair(pairs[0].prompt, pairs[0].chosen, pairs[0].rejected, 64, 64)
    with pytest.raises(ValueError, match=r"data.max_prompt_length=2000 must be below data.max_length=1000"):
        run(train_cfg("objective=dpo", "data.max_prompt_length=2000", "data.max_length=1000",
                      "model.path=/nonexistent/so/nothing/may/load"))


def test_config_check_reports_it_without_training() -> None:
    """``python -m rolemrc.memory <overrides>`` (the pre-flight check that replaced the
    ``--cfg job --resolve`` resolver) names both keys and exits non-zero."""
    out = subprocess.run([sys.executable, "-m", "rolemrc.memory", "objective=dpo", "data.max_prompt_length=2000",
                          "data.max_length=1000"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "data.max_prompt_length=2000 must be below data.max_length=1000" in " ".join(out.stderr.split())


@pytest.mark.parametrize("cache", [False, True], ids=["in memory", "store"])
def test_data_that_leaves_nothing_to_train_on_stops_naming_the_length(chat: ChatFormat, tmp_path, cache: bool) -> None:
    """Rows cut to nothing trainable (the config refuses data.max_length=1; a datamodule built
    without the config check gets it): one error naming data.max_length, never a run training on
    nothing (train/loss 0 and an export)."""
    from omegaconf import OmegaConf

    from rolemrc.data.datamodule import ChatDataModule
    from rolemrc.data.schemas import DataError

    cfg = OmegaConf.create({"sft": [{"path": asset("sample/sft.jsonl")}], "val_fraction": 0.0, "max_length": 1,
                            "max_prompt_length": 1, "batch_size": 2, "cache": cache, "cache_dir": str(tmp_path / "c")})
    with pytest.raises(DataError, match=r"^no sft example left to train on: all \d+ had no token left to train on after "
                                        r"truncation to data.max_length=1 \(e.g. .*sft.jsonl:1.*\): raise data.max_length"):
        ChatDataModule(cfg, "sft", chat).setup()
