"""Evaluation's test prompts from the data store (rolemrc.data.store.open_or_build_prompts): the
same prompt ids with and without the store, building and reusing; a second start encodes nothing;
a changed question or tokenizer gets its own store; a damaged one is rebuilt; data.cache=false
writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer

from rolemrc import asset
from rolemrc.config import Replier
from rolemrc.run.build import build_chat
from rolemrc.data import store as store_mod
from rolemrc.data.templates import ChatFormat
from rolemrc.data.test_items import generation_prompts, load_test_items
from rolemrc.eval.generation import item_id, prepare_generation
from tests.conftest import CONF
from tests.data.test_bad_input import STRICT


def compose_eval(*overrides: str) -> DictConfig:
    """``conf/evaluate.yaml`` (tiny model, sample test data) as ``python evaluate.py`` composes it."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("evaluate", overrides=list(overrides))


@pytest.fixture(scope="module")
def chat() -> ChatFormat:
    return ChatFormat(AutoTokenizer.from_pretrained(asset("tokenizers/tiny-llama3")))


def data_cfg(cache_dir: Path, cache: bool = True, path: str | None = None) -> DictConfig:
    return OmegaConf.create({"test": [{"path": path or asset("sample/test.jsonl")}], "on_error": "raise",
                             "cache": cache, "cache_dir": str(cache_dir)})


def forbid_encoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("encoded a prompt on the second start")

    for name in ("encode_prompt", "encode_prompts", "tokenize", "tokenize_many", "render"):
        monkeypatch.setattr(ChatFormat, name, refuse)


def test_prepare_generation_gives_the_same_prompts_with_and_without_the_store(tmp_path: Path) -> None:
    seen = []
    for k, cache in enumerate((False, True, True)):  # in memory, building, reusing
        cfg = compose_eval(f"out_dir={tmp_path / f'eval{k}'}", f"data.cache={str(cache).lower()}",
                           f"data.cache_dir={tmp_path / 'cache'}")
        items, _ = load_test_items(cfg.data, cfg.limit)
        chat = build_chat(cfg.model)
        builds = store_mod.BUILDS["count"]
        gen_items, stops = prepare_generation(Replier.of(cfg), items, [item_id(i, it.task, it.question) for i, it in enumerate(items)],
                                              chat.tokenizer, chat)
        assert store_mod.BUILDS["count"] - builds == (1 if k == 1 else 0)
        seen.append(([(g.id, g.task, g.prompt_ids) for g in gen_items], stops))
        if k == 0:  # the in-memory path is encode_prompt of each question
            assert [g.prompt_ids for g in gen_items] == [chat.encode_prompt(it.question) for it in items]
            assert not (tmp_path / "cache").exists()
    assert seen[0] == seen[1] == seen[2]
    assert len(seen[0][0]) == 54
    assert [p.name.split("-")[0] for p in (tmp_path / "cache").iterdir() if p.is_dir()] == ["prompts"]


def test_a_second_start_encodes_no_prompt(chat, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    items, _ = load_test_items(data_cfg(tmp_path))
    first = generation_prompts(data_cfg(tmp_path), items, chat)
    builds = store_mod.BUILDS["count"]
    forbid_encoding(monkeypatch)
    again, _ = load_test_items(data_cfg(tmp_path))  # a new start reads the items again
    second = generation_prompts(data_cfg(tmp_path), again, chat)
    assert store_mod.BUILDS["count"] == builds
    assert second == first and len(first) == len(items)


def test_a_changed_question_or_tokenizer_gets_its_own_store(chat, tmp_path: Path) -> None:
    records = [json.loads(line) for line in Path(asset("sample/test.jsonl")).read_text().splitlines()]
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records[:5]))
    items, _ = load_test_items(data_cfg(tmp_path / "c", path=str(data)))
    before = generation_prompts(data_cfg(tmp_path / "c"), items, chat)
    records[2]["question"][-1]["content"] += " Answer briefly."
    data.write_text("".join(json.dumps(r) + "\n" for r in records[:5]))
    changed, _ = load_test_items(data_cfg(tmp_path / "c", path=str(data)))
    builds = store_mod.BUILDS["count"]
    after = generation_prompts(data_cfg(tmp_path / "c"), changed, chat)
    assert store_mod.BUILDS["count"] == builds + 1
    assert after[2] == chat.encode_prompt(changed[2].question) != before[2]
    assert after[:2] + after[3:] == before[:2] + before[3:]
    qwen = ChatFormat(AutoTokenizer.from_pretrained(asset("tokenizers/tiny-chatml")))
    other = generation_prompts(data_cfg(tmp_path / "c"), changed, qwen)
    assert store_mod.BUILDS["count"] == builds + 2
    assert other == [qwen.encode_prompt(it.question) for it in changed]
    assert len([p for p in (tmp_path / "c").iterdir() if p.is_dir()]) == 3


def test_a_damaged_prompt_store_is_rebuilt(chat, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    items, _ = load_test_items(data_cfg(tmp_path))
    first = generation_prompts(data_cfg(tmp_path), items, chat)
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    ids = folder / "prompt.bin"
    with ids.open("r+b") as fh:  # truncated by hand
        fh.truncate(ids.stat().st_size // 2)
    builds = store_mod.BUILDS["count"]
    with caplog.at_level("WARNING", logger="rolemrc.data.store"):
        again = generation_prompts(data_cfg(tmp_path), items, chat)
    assert again == first and store_mod.BUILDS["count"] == builds + 1
    assert "is damaged (prompt.bin has" in caplog.text


@pytest.mark.parametrize("template", [None, "chatml", "strict"])
def test_the_batch_encoders_give_the_one_by_one_ids(tmp_path: Path, template: str | None) -> None:
    """What the store's build calls (one batch per chunk) equals encode_conversation/encode_prompt/
    encode_pair per record, cut at the lengths, with a record the template refuses given as its
    error in place."""
    from rolemrc.data.schemas import PARSERS
    from rolemrc.data.schemas import DataError
    from rolemrc.data.templates import TemplateRenderError

    tok = AutoTokenizer.from_pretrained(asset("tokenizers/tiny-llama3"))
    if template == "strict":
        (tmp_path / "strict.jinja").write_text(STRICT)
        template = str(tmp_path / "strict.jinja")
    chat = ChatFormat(tok, template=template)
    lines = Path(asset("sample/sft.jsonl")).read_text().splitlines()[:24]
    convs = [PARSERS["sft"](json.loads(line)).messages for line in lines]
    convs.insert(3, [{"role": "assistant", "content": "Ahoy!"}, {"role": "user", "content": "Fog?"},
                     {"role": "assistant", "content": ""}])  # opened by the assistant; an empty turn
    for max_length in (None, 200):
        batch = chat.encode_conversations(convs, max_length)
        assert len(batch) == len(convs)
        for conv, got in zip(convs, batch):
            try:
                want = chat.encode_conversation(conv, max_length)
            except TemplateRenderError as err:
                assert isinstance(got, TemplateRenderError) and str(got) == str(err)
                continue
            assert got == want
        assert any(isinstance(b, TemplateRenderError) for b in batch) == (template is not None and "strict" in template)
    questions = [c[:-1] for c in convs if c[0]["role"] != "assistant"]
    assert chat.encode_prompts(questions) == [chat.encode_prompt(q) for q in questions]
    pairs = [(p.prompt, p.chosen, p.rejected) for p in (PARSERS["pairs"](json.loads(line)) for line in
                                                         Path(asset("sample/pairs.jsonl")).read_text().splitlines()[:12])]
    pairs.insert(2, ([{"role": "assistant", "content": "Ahoy!"}, {"role": "user", "content": "Fog?"}], "Thick.", "No."))
    for max_length, max_prompt_length in ((4096, 3072), (160, 120)):  # nothing cut; prompts and responses cut
        batch = chat.encode_pairs(pairs, max_length, max_prompt_length)
        for (prompt, chosen, rejected), got in zip(pairs, batch, strict=True):
            try:
                want = chat.encode_pair(prompt, chosen, rejected, max_length, max_prompt_length)
            except TemplateRenderError as err:
                assert isinstance(got, TemplateRenderError) and str(got) == str(err)
                continue
            assert got == want
        assert any(isinstance(b, TemplateRenderError) for b in batch) == (template is not None and "strict" in template)
        assert any(b.prompt_truncated or b.response_truncated for b in batch if not isinstance(b, TemplateRenderError)) \
            == (max_length == 160)
    assert chat.tokenize_many(["", "a b", "", "<|eot_id|> x"]) == [chat.tokenize(t) for t in ["", "a b", "", "<|eot_id|> x"]]


def test_the_judge_callback_reads_its_prompts_from_the_store(chat, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """callbacks=judge_scores takes its test prompts from the run's data store too: built at the
    first start, and a second start (a resumed run) encodes nothing."""
    from types import SimpleNamespace

    from rolemrc.callbacks.judge_scores import JudgeScores

    data = data_cfg(tmp_path / "cache")
    trainer = SimpleNamespace(datamodule=SimpleNamespace(chat=chat, cfg=data), default_root_dir=str(tmp_path / "run"),
                              is_global_zero=True)
    builds = store_mod.BUILDS["count"]
    JudgeScores(n_items=6, metrics=[], judge={"backend": "none"}).setup(trainer, None, "fit")
    assert store_mod.BUILDS["count"] == builds + 1
    assert [p.name.split("-")[0] for p in (tmp_path / "cache").iterdir() if p.is_dir()] == ["prompts"]
    forbid_encoding(monkeypatch)
    JudgeScores(n_items=6, metrics=[], judge={"backend": "none"}).setup(trainer, None, "fit")
    assert store_mod.BUILDS["count"] == builds + 1


def test_grpo_prompt_rows_come_from_their_store(chat, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt rows (data kind prompts, objective=grpo) with data.cache: built once into a store of
    their own (ids, messages and reward columns; keyed by the sources' files, as sft and pairs
    stores are), the same rows as encoded in memory (data.cache=false), and read back at the next
    start with no reading, rendering or tokenising. A record the template cannot render is named by
    file and line and stores nothing; with on_error=skip it is dropped and counted, and stored so."""
    from rolemrc.data import datamodule
    from rolemrc.data.datamodule import ChatDataModule
    from rolemrc.data.schemas import DataError
    from rolemrc.data.templates import TemplateRenderError

    def rows(cache: bool, cache_dir: Path, path: str | None = None, on_error: str = "raise"):
        cfg = OmegaConf.create({"prompts": [{"path": path or asset("sample/rl.jsonl")}], "prompts_val": [],
                                "val_fraction": 0.0 if path else 0.2, "max_prompt_length": 64, "cache": cache,
                                "cache_dir": str(cache_dir), "on_error": on_error})
        dm = ChatDataModule(cfg, "prompts", chat)
        dm.prepare_data()
        dm.setup("fit")
        return list(dm.train_rows), list(dm.val_rows), dm.report

    memory = rows(False, tmp_path / "none")
    assert not (tmp_path / "none").exists() and len(memory[0]) > 10 and memory[1]
    builds = store_mod.BUILDS["count"]
    first = rows(True, tmp_path / "cache")
    assert store_mod.BUILDS["count"] == builds + 1 and first == memory
    assert first[2]["train"]["prompt_truncated"] > 0  # cut to max_prompt_length, as in memory
    with monkeypatch.context() as m:
        forbid_encoding(m)
        m.setattr(datamodule, "read_examples", lambda *a, **k: pytest.fail("read the records on the second start"))
        second = rows(True, tmp_path / "cache")
    assert store_mod.BUILDS["count"] == builds + 1 and second == memory
    assert [p.name.split("-")[0] for p in (tmp_path / "cache").iterdir() if p.is_dir()] == ["promptrows"]

    records = Path(asset("sample/rl.jsonl")).read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(records[:3]) + "\n")
    real_render = ChatFormat.render
    refused = json.loads(records[1])

    def render(self, messages, add_generation_prompt=False):  # the second record's prompt cannot be rendered
        if messages[-1]["content"] == refused["prompt"][-1]["content"]:
            raise TemplateRenderError("the template refuses this conversation")
        return real_render(self, messages, add_generation_prompt)

    monkeypatch.setattr(ChatFormat, "render", render)
    with pytest.raises(DataError, match=r"bad\.jsonl:2"):
        rows(True, tmp_path / "bad", str(bad))
    assert not [p for p in (tmp_path / "bad").iterdir() if p.is_dir()]  # a failed build stores nothing
    skipped, _, report = rows(True, tmp_path / "bad", str(bad), on_error="skip")
    assert len(skipped) == 2 and report["train"]["dropped_template_error"] == 1
    assert rows(True, tmp_path / "bad", str(bad), on_error="skip")[0] == skipped
