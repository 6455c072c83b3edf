"""Unpaired preference records (data kind ``unpaired``, objective=kto): TRL's conversational
``{prompt, completion, label}`` shape, file:line errors, their encoding, collation and step totals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rolemrc import asset
from rolemrc.config import DataConfig, source_group
from rolemrc.data.collate import STEP_TOTALS, UnpairedCollator, row_totals
from rolemrc.data.datamodule import ChatDataModule, encode_pairs, encode_unpaired
from rolemrc.data.readers import read_examples
from rolemrc.data.schemas import DataError, Unpaired
from rolemrc.objectives import IGNORE_INDEX

USER = [{"role": "User", "content": "How do you fold butter into dough?"}]


def write(tmp_path: Path, records: list[Any], name: str = "unpaired.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def split_sample_pairs(tmp_path: Path, keep: int | None = None) -> Path:
    """The sample pairs as unpaired records (TRL's unpair_preference_dataset: both sides of each);
    ``keep``: only the first ``keep`` pairs' chosen sides and every rejected one (unbalanced)."""
    pairs = [json.loads(line) for line in Path(asset("sample/pairs.jsonl")).read_text().splitlines() if line.strip()]
    records = []
    for i, p in enumerate(pairs):
        if keep is None or i < keep:
            records.append({"prompt": p["prompt"], "completion": [{"role": "assistant", "content": p["chosen"]}],
                            "label": True})
        records.append({"prompt": p["prompt"], "completion": p["rejected"], "label": False})
    return write(tmp_path, records)


def test_trls_conversational_shapes(tmp_path: Path) -> None:
    path = write(tmp_path, [
        {"prompt": USER, "completion": [{"role": "assistant", "content": "Gently, mon ami."}], "label": True},
        {"prompt": USER, "completion": "With a hammer.", "label": False, "task": "t1"},
        {"prompt": [{"role": "system", "content": "You are a baker."}], "completion": "Bonjour!", "label": True},
    ])
    items, report = read_examples([{"path": str(path)}], "unpaired")
    assert all(isinstance(i, Unpaired) for i in items) and report.kept[str(path)] == 3
    first, second, third = items
    assert first.prompt == [{"role": "user", "content": USER[0]["content"]}] and first.completion == "Gently, mon ami."
    assert first.label is True and second.label is False and second.task == "t1"
    assert third.prompt[0]["role"] == "system" and second.origin == f"{path}:2"


def test_bad_records_name_file_line_and_field(tmp_path: Path) -> None:
    good = {"prompt": USER, "completion": "Gently.", "label": True}
    path = write(tmp_path, [
        good,
        {"prompt": USER, "completion": "Gently."},
        {**good, "label": 1},
        {**good, "label": "true"},
        {**good, "completion": "  "},
        {**good, "prompt": "How do you fold butter?"},
        {"prompt": USER, "chosen": "a", "rejected": "b"},
        {**good, "completion": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]},
        {**good, "prompt": USER + [{"role": "assistant", "content": "x"}]},
        {**good, "completion": [{"role": "user", "content": "a"}]},
        "{not json",
        {**good, "label": None},
    ])
    with pytest.raises(DataError) as err:
        read_examples([{"path": str(path)}], "unpaired")
    msg = str(err.value)
    assert "11 invalid unpaired record(s)" in msg
    assert f"{path}:2: missing field 'label'" in msg
    assert f"{path}:3: field 'label' must be true (desirable) or false (undesirable), got int 1" in msg
    assert f"{path}:4: field 'label' must be true (desirable) or false (undesirable), got str 'true'" in msg
    assert f"{path}:5: field 'completion' is empty" in msg
    assert f"{path}:6: field 'prompt' is a string: give it as messages" in msg
    assert f"{path}:7: a preference pair (chosen/rejected), not an unpaired example: put pairs in data.pairs" in msg
    assert f"{path}:8: field 'completion' must be one assistant message, got 2 message(s) (assistant, user)" in msg
    assert f"{path}:9: prompt: last message must be user, got assistant" in msg
    assert f"{path}:10: field 'completion' must be one assistant message, got 1 message(s) (user)" in msg
    assert f"{path}:11: invalid JSON" in msg
    assert f"{path}:12: field 'label' is null; it must be true (desirable) or false (undesirable)" in msg
    items, report = read_examples([{"path": str(path)}], "unpaired", on_error="skip")
    assert len(items) == 1 and report.skipped[str(path)] == 11


def test_encoding_is_a_pair_sides_encoding(tmp_path: Path) -> None:
    """An unpaired example's tokens are those of the same pair side (same cuts at max_length /
    max_prompt_length), so unpaired records and pairs split train on the same rows."""
    from tests.data.test_templates import chat_format  # the shipped tiny tokenizer and template

    chat = chat_format("llama3")
    pairs, _ = read_examples([{"path": str(asset("sample/pairs.jsonl"))}], "pairs")
    unpaired, _ = read_examples([{"path": str(split_sample_pairs(tmp_path))}], "unpaired")
    pair_rows, _ = encode_pairs(pairs, chat, 160, 96)
    rows, report = encode_unpaired(unpaired, chat, 160, 96)
    assert report["examples"] == 2 * len(pair_rows) == report["desirable"] + report["undesirable"]
    assert report["prompt_truncated"] > 0 and report["completion_truncated"] > 0  # the cuts are exercised
    for i, pair in enumerate(pair_rows):
        good, bad = rows[2 * i], rows[2 * i + 1]
        assert good["prompt_ids"] == bad["prompt_ids"] == pair["prompt_ids"]
        assert (good["completion_ids"], good["label"]) == (pair["chosen_ids"], True)
        assert (bad["completion_ids"], bad["label"]) == (pair["rejected_ids"], False)
        assert len(good["prompt_ids"]) <= 96 and len(good["prompt_ids"] + good["completion_ids"]) <= 160


def test_collator_and_step_totals() -> None:
    rows = [{"prompt_ids": [1, 2], "completion_ids": [3], "label": True, "index": 4},
            {"prompt_ids": [5], "completion_ids": [6, 7, 8], "label": False, "index": 9}]
    batch = UnpairedCollator(0)(rows)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [5, 6, 7, 8]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX, IGNORE_INDEX, 3, IGNORE_INDEX], [IGNORE_INDEX, 6, 7, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert batch["label"].tolist() == [True, False] and batch["index"].tolist() == [4, 9]
    assert STEP_TOTALS["unpaired"] == ("examples", "desirable")
    assert [row_totals(r) for r in rows] == [(1, 1), (1, 0)]


def test_the_kind_reads_unpaired_when_given_else_the_pairs(tmp_path: Path) -> None:
    pairs = [{"path": str(asset("sample/pairs.jsonl"))}]
    assert source_group("unpaired", DataConfig(name="x", pairs=pairs)) == "pairs"
    given = DataConfig(name="x", pairs=pairs, unpaired=[{"path": str(split_sample_pairs(tmp_path, keep=10))}])
    assert source_group("unpaired", given) == "unpaired" and source_group("sft", given) == "sft"


def test_datamodule_serves_unpaired_batches_with_their_step_totals(tmp_path: Path) -> None:
    from tests.data.test_templates import chat_format

    path = split_sample_pairs(tmp_path, keep=10)  # 10 desirable, 80 undesirable
    cfg = DataConfig(name="x", unpaired=[{"path": str(path)}], pairs=[{"path": str(asset("sample/pairs.jsonl"))}],
                     val_fraction=0.1, max_length=160, max_prompt_length=96, batch_size=4, cache=True,
                     cache_dir=str(tmp_path / "cache"))
    dm = ChatDataModule(cfg, "unpaired", chat_format("chatml"), seed=3)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.kind == "unpaired" and dm.store is not None and dm.store.kind == "unpairedrows"
    assert len(dm.train_rows) + len(dm.val_rows) == 90 and len(dm.val_rows) == 9
    batches = list(dm.train_dataloader())
    labels = torch.cat([b["label"] for b in batches])
    assert len(labels) == len(dm.train_rows) and int(labels.sum()) == sum(r["label"] for r in dm.train_rows)
    for b in batches:  # accumulate 1: each micro-batch is its step
        assert float(b["step_examples"]) == b["index"].shape[0]
        assert float(b["step_desirable"]) == int(b["label"].sum())
    val = next(iter(dm.val_dataloader()))
    assert set(val) >= {"input_ids", "labels", "attention_mask", "label", "index"}


def test_unpaired_rows_come_from_their_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """data.unpaired with data.cache: the rows built once into a store of their own (keyed by the
    sources' files), the rows, batches (KL rows included) and report of the in-memory encoding
    (data.cache=false), read back by the next start with no reading or tokenising. A bad record is
    named by file and line and stores nothing; with on_error=skip it is dropped, counted, and stored so."""
    from rolemrc.data import datamodule
    from rolemrc.data import store as store_mod
    from rolemrc.data.templates import ChatFormat
    from rolemrc.modules.kto import _kl_rows, fixed_kl_completions
    from tests.data.test_templates import chat_format

    chat = chat_format("chatml")
    path = split_sample_pairs(tmp_path, keep=10)

    def start(cache: bool, cache_dir: Path, source: Path = path, on_error: str = "raise") -> ChatDataModule:
        cfg = DataConfig(name="x", unpaired=[{"path": str(source)}], val_fraction=0.1, max_length=160,
                         max_prompt_length=96, batch_size=4, cache=cache, cache_dir=str(cache_dir), on_error=on_error)
        dm = ChatDataModule(cfg, "unpaired", chat, seed=3)
        dm.prepare_data()
        dm.setup("fit")
        return dm

    def batches(dm: ChatDataModule) -> list[dict[str, torch.Tensor]]:  # with each row's fixed KL row
        out = list(dm.train_dataloader()) + list(dm.val_dataloader())
        for b, rows in zip(out, [dm.train_rows] * (len(out) - 1) + [dm.val_rows]):
            b.update({f"kl_{k}": v for k, v in _kl_rows(b, fixed_kl_completions(
                rows, b["index"].tolist(), 4, False)).items()})
        return out

    def same(a: list[dict], b: list[dict]) -> None:
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)

    memory = start(False, tmp_path / "none")
    assert memory.store is None and not (tmp_path / "none").exists()
    builds = store_mod.BUILDS["count"]
    first = start(True, tmp_path / "cache")
    assert store_mod.BUILDS["count"] == builds + 1 and first.store is not None
    assert list(first.train_rows) == list(memory.train_rows) and list(first.val_rows) == list(memory.val_rows)
    assert first.report == memory.report and len(memory.val_rows) == 9
    expected = batches(memory)
    same(batches(first), expected)
    with monkeypatch.context() as m:
        for name in ("tokenize", "tokenize_many", "render"):
            m.setattr(ChatFormat, name, lambda *a, **k: pytest.fail("encoded on the second start"))
        m.setattr(datamodule, "read_examples", lambda *a, **k: pytest.fail("read the records on the second start"))
        second = start(True, tmp_path / "cache")
        assert store_mod.BUILDS["count"] == builds + 1 and second.report == memory.report
        same(batches(second), expected)
    # a reference table's and a sampler place's rows: the stored checksums', one per stage
    assert second.train_rows.fingerprint == first.train_rows.fingerprint != first.val_rows.fingerprint
    assert [p.name.split("-")[0] for p in (tmp_path / "cache").iterdir() if p.is_dir()] == ["unpairedrows"]

    records = path.read_text().splitlines()
    bad = write(tmp_path, records[:4] + ['{"prompt": "x", "completion": "y", "label": true}'] + records[4:8],
                "bad.jsonl")
    with pytest.raises(DataError, match=r"bad\.jsonl:5: field 'prompt' is a string"):
        start(True, tmp_path / "bad", bad)
    assert not [p for p in (tmp_path / "bad").iterdir() if p.is_dir()]  # a failed build stores nothing
    skipped = start(True, tmp_path / "bad", bad, on_error="skip")
    again = start(True, tmp_path / "bad", bad, on_error="skip")
    assert skipped.report["skipped"] == again.report["skipped"] == {str(bad): 1}
    assert len(again.train_rows) + len(again.val_rows) == 8 and again.store is not None


def test_tokens_equal_trls_for_the_llama3_template(tmp_path: Path) -> None:
    """TRL 1.16's KTOTrainer tokenizes a conversational record as the prompt with the generation
    prompt, and the completion as the rest of prompt + completion: the same tokens as ours with
    Llama-3's template (ChatML writes a newline after <|im_end|>, which TRL's completion keeps and
    ours, ending at the end-of-turn token as pairs do, does not: docs/preference.md#kto)."""
    from transformers import AutoTokenizer
    from trl.trainer.kto_trainer import _tokenize, common_prefix_length

    from rolemrc.data.templates import ChatFormat

    tokenizer = AutoTokenizer.from_pretrained(asset("tokenizers/tiny-llama3"))
    examples, _ = read_examples([{"path": str(split_sample_pairs(tmp_path, keep=5))}], "unpaired")
    rows, _ = encode_unpaired(examples, ChatFormat(tokenizer), 100_000, 90_000)
    assert len(rows) == len(examples) == 85
    for ex, row in zip(examples, rows):
        prompt_ids = _tokenize(tokenizer, ex.prompt, add_generation_prompt=True)["input_ids"]
        full = _tokenize(tokenizer, ex.prompt + [{"role": "assistant", "content": ex.completion}])["input_ids"]
        cut = common_prefix_length(prompt_ids, full)
        assert (prompt_ids[:cut], full[cut:]) == (row["prompt_ids"], row["completion_ids"]), ex.origin
