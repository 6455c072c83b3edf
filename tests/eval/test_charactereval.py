"""CharacterEval on the shipped sample: the released files read (one-line errors naming file:line
and field), the authors' conversation layout, and scoring by a tiny reward model built from a
config: every score is the model's own output on the input the authors' format gives, x4 + 1."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from rolemrc import asset
from rolemrc.data.schemas import DataError
from rolemrc.eval.bench import charactereval as ce
from rolemrc.eval.run import run
from tests.eval.test_evaluate_run import compose_eval

pytestmark = pytest.mark.usefixtures("one_thread")
SAMPLE = Path(asset("sample/charactereval"))
FILE = ["data=charactereval_sample", "generation.backend=file", f"generation.path={SAMPLE / 'replies.jsonl'}"]


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-label sequence-classification Llama (random) with the shipped tiny tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tok = AutoTokenizer.from_pretrained(asset("tokenizers/tiny-llama3"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096, num_labels=1,
                      pad_token_id=tok.pad_token_id)
    out = tmp_path_factory.mktemp("rm")
    LlamaForSequenceClassification(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_sample_scored_by_a_local_reward_model_as_the_authors_format_it(tiny_rm: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path / "ce"
    res = run(compose_eval(*FILE, f"data.charactereval.reward_model.path={tiny_rm}", "report.reference=[GPT-4]",
                           f"out_dir={out}"))
    doc = json.loads((out / "metrics.json").read_text())["charactereval"]
    assert set(doc["metrics"]) == set(ce.METRICS) and all(v["n"] == 1 for v in doc["metrics"].values())
    assert doc["scored_examples"] == 4 and doc["scores"] == 12
    rows = [json.loads(x) for x in (out / "charactereval" / "scores.jsonl").read_text().splitlines()]
    # Each score is the reward model's logit x4 + 1 on <RoleInfo> profile <Context> ... <Dimension> metric,
    # the reply cut at its first line, the end-of-sequence token appended.
    tok = AutoTokenizer.from_pretrained(tiny_rm)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_rm).eval()
    profiles = json.loads((SAMPLE / "character_profiles.json").read_text())
    contexts = {r["id"]: r["context"] for r in json.loads((SAMPLE / "test_data.jsonl").read_text())}
    for r in rows:
        text = (f"<RoleInfo>\n\n{profiles[r['role']]}\n\n<Context>\n\n{contexts[r['id']]}\n\n<Response>\n\n"
                f"{r['reply']}\n\n<Dimension>\n\n{r['metric_zh']}")
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        with torch.no_grad():
            want = model(input_ids=torch.tensor([ids])).logits.item() * 4 + 1
        assert r["score"] == pytest.approx(want, abs=1e-5)
    assert next(r for r in rows if r["id"] == 101)["reply"] == "林晚舟：鸡蛋放船中间，我撑稳些，保准一个不碎。"
    fluency = next(r["score"] for r in rows if r["metric"] == "Fluency")
    assert doc["metrics"]["Fluency"]["mean"] == pytest.approx(fluency)
    dims = {d: sum(doc["metrics"][m]["mean"] for m in ms) / len(ms) for d, ms in ce.DIMENSIONS.items()}
    assert doc["dimensions"] == pytest.approx(dims)
    assert doc["overall"] == pytest.approx(sum(v["mean"] for v in doc["metrics"].values()) / 12)
    summary = (out / "summary.md").read_text()
    assert "| conversational_ability | Fluency |" in summary
    # The paper's row beside this run's (Table 4, shipped): Fluency ... Attr. avg, MBTI published only.
    assert "| GPT-4 | 3.332 | 3.669 | 3.343 | 3.448 | 2.250 |" in summary and "| 2.873 | 0.694 |" in summary
    assert res["scalars"]["charactereval/overall"] == pytest.approx(doc["overall"])
    # A rerun reads every score from the cache.
    again = run(compose_eval(*FILE, f"data.charactereval.reward_model.path={tiny_rm}", f"out_dir={out}"))
    assert again["results"]["charactereval"]["cache_hits"] == 12


def test_conversation_layout_and_hf_generation(tiny_rm: Path, tmp_path: Path) -> None:
    c = OmegaConf.create({"instruction": "Play {role}.", "acknowledgement": "OK, {role}.", "opening": " First: "})
    ex = ce.Example(102, "林晚舟", json.loads((SAMPLE / "test_data.jsonl").read_text())[1]["context"], "x", [])
    msgs = ce.conversation(c, ex, "P")
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
    assert msgs[0]["content"] == "P\nPlay 林晚舟.\n"
    assert msgs[1]["content"] == "OK, 林晚舟. First: （望着天）要下雨了，今天最后一趟。"
    assert msgs[2]["content"] == "陈先生：那我可赶巧了，多少钱？" and msgs[3]["content"] == "林晚舟：老价钱，两文。"
    assert msgs[4]["content"] == "陈先生：（掏兜）哎呀，我忘带钱袋了。"
    # The same suite through the hf backend (the tiny random model generates).
    out = tmp_path / "hf"
    res = run(compose_eval("data=charactereval_sample", "data.charactereval.limit=1", "generation.max_new_tokens=3",
                           "generation.progress=false", f"data.charactereval.reward_model.path={tiny_rm}",
                           f"out_dir={out}"))
    assert res["results"]["counts"]["generated"] == 1
    assert res["results"]["charactereval"]["scores"] == 2  # id 101: Fluency and Empathy


@pytest.mark.parametrize("edit, match", [
    (lambda rows: rows[1].pop("context"), r"test_data.jsonl:8: field 'context' is missing"),
    (lambda rows: rows[2].update(role="无名"), r"test_data.jsonl:14: role '无名' has no profile"),
    (lambda rows: rows[0].update(context="阿福：你好\n林晚舟：好"), r"test_data.jsonl:2: id 101: 'context' ends with a line"),
])
def test_a_copy_that_differs_is_one_line_naming_file_line_field(tmp_path: Path, edit, match) -> None:
    root = tmp_path / "ce"
    shutil.copytree(SAMPLE, root)
    rows = json.loads((root / "test_data.jsonl").read_text())
    edit(rows)
    (root / "test_data.jsonl").write_text(json.dumps(rows, ensure_ascii=False, indent=2))
    c = OmegaConf.create({"root": str(root), "metrics": None, "limit": None, "instruction": "{role}",
                          "acknowledgement": "{role}", "opening": ""})
    with pytest.raises(DataError, match=match):
        examples, profiles = ce.load(c)
        for ex in examples:
            ce.conversation(c, ex, "P")


def test_bad_id2metric_and_missing_reward_model(tmp_path: Path) -> None:
    root = tmp_path / "ce"
    shutil.copytree(SAMPLE, root)
    (root / "id2metric.jsonl").write_text(json.dumps({"101": [["Fluent", "对话流利度"]]}))
    c = OmegaConf.create({"root": str(root), "metrics": None, "limit": None})
    with pytest.raises(DataError, match=r"id2metric.jsonl: entry '101': unknown metric 'Fluent'"):
        ce.load(c)
    from rolemrc.errors import UserError

    with pytest.raises(UserError, match=r"data.charactereval.reward_model.path: not a folder: /nowhere"):
        run(compose_eval(*FILE, "data.charactereval.reward_model.path=/nowhere", f"out_dir={tmp_path / 'o'}"))


TINY_RM_CODE = '''
import torch
from transformers import LlamaModel, LlamaPreTrainedModel


class TinyCharRM(LlamaPreTrainedModel):
    """Its score is the second output, a sigmoid of a head on the last token (as the authors read theirs)."""

    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaModel(config)
        self.head = torch.nn.Linear(config.hidden_size, 1)
        self.post_init()

    def forward(self, input_ids, **kw):
        h = self.model(input_ids=input_ids).last_hidden_state[:, -1]
        return h, torch.sigmoid(self.head(h)).squeeze(-1)
'''


def test_reward_model_class_from_the_folders_own_code(tiny_rm: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """model_class names a class in the model folder's code (BaichuanCharRM's way); output 1 is read."""
    from transformers import AutoTokenizer, LlamaConfig, dynamic_module_utils

    from rolemrc.eval.bench.reward import RewardJudge

    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    folder = tmp_path / "charrm"
    folder.mkdir()
    (folder / "modeling_tinyrm.py").write_text(TINY_RM_CODE)
    cfg = LlamaConfig.from_pretrained(tiny_rm)
    namespace: dict = {}
    exec(TINY_RM_CODE, namespace)
    torch.manual_seed(1)
    namespace["TinyCharRM"](cfg).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_rm).save_pretrained(folder)
    c = OmegaConf.create({"path": str(folder), "model_class": "modeling_tinyrm.TinyCharRM", "tokenizer_class": None,
                          "output": 1, "scale": 4.0, "offset": 1.0, "max_length": 8, "dtype": "float32",
                          "device": "cpu"})
    rm = RewardJudge.load(c, "data.charactereval.reward_model")
    assert type(rm.model).__name__ == "TinyCharRM"
    text = "<RoleInfo>\n\n" + "很长的设定" * 20
    assert len(rm.encode(text)) == 8 and rm.encode(text)[-1] == rm.tokenizer.eos_token_id  # the last 8 kept
    ids = torch.tensor([rm.encode(text)])
    with torch.no_grad():
        want = rm.model(ids)[1].item() * 4 + 1
    assert 1 <= rm.score(text) <= 5 and rm.score(text) == pytest.approx(want)
    from rolemrc.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model_class=modeling_nope.X: expected '<module>.<Class>' with "
                                          r"<module>.py in the model folder"):
        RewardJudge.load(OmegaConf.merge(c, {"model_class": "modeling_nope.X"}), "data.charactereval.reward_model")
    with pytest.raises(ConfigError, match=r"output 0 holds \d+ numbers, not one score"):
        RewardJudge.load(OmegaConf.merge(c, {"output": 0}), "data.charactereval.reward_model").score(text)


def test_openai_generation_sends_the_authors_conversation(tiny_rm: Path, tmp_path: Path,
                                                          api_key_env: tuple[str, str]) -> None:
    from tests.fake_openai import FakeOpenAI, Request

    sent: list[list[dict]] = []

    def answer(req: Request) -> str:
        sent.append(req.body["messages"])
        return "老钟：慢慢来。\n多余的一行"

    with FakeOpenAI(api_key=api_key_env[1], answer=answer) as server:
        res = run(compose_eval("data=charactereval_sample", "generation.backend=openai", "generation.model=served",
                               f"generation.base_url={server.base_url}", f"generation.api_key_env={api_key_env[0]}",
                               f"data.charactereval.reward_model.path={tiny_rm}", f"out_dir={tmp_path / 'api'}"))
    assert len(sent) == 4 and res["results"]["charactereval"]["scores"] == 12
    profiles = json.loads((SAMPLE / "character_profiles.json").read_text())
    first = next(m for m in sent if "小梅：钟伯伯" in m[-1]["content"] or "小梅：您上个月" in m[-1]["content"])
    assert first[0] == {"role": "user", "content": f"{profiles['老钟']}\nPlay the character 老钟 described above and "
                                                    "continue the dialogue as 老钟.\n"}
    assert [m["role"] for m in first] == ["user", "assistant", "user", "assistant", "user"]
    assert first[2:] == [{"role": "user", "content": "小梅：钟伯伯，我爷爷的怀表又不走了。"},
                         {"role": "assistant", "content": "老钟：（戴上眼镜）拿来我瞧瞧。"},
                         {"role": "user", "content": "小梅：您上个月才修过呢。"}]
    rows = (tmp_path / "api" / "charactereval" / "scores.jsonl").read_text().splitlines()
    assert all(json.loads(r)["reply"] == "老钟：慢慢来。" for r in rows)
