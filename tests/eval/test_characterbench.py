"""CharacterBench on the shipped sample: judge prompts filled as the authors' scripts fill them,
scores read from the answer's first line (3.0 for an answer that is not a number, as theirs),
per-file figures scaled by the file's largest annotation score; a tiny local chat judge built
from a config runs the whole path, a scripted loopback judge checks the numbers."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from rolemrc import asset
from rolemrc.data.schemas import DataError
from rolemrc.errors import ConfigError
from rolemrc.eval.bench import characterbench as cb
from rolemrc.eval.run import run
from tests.eval.test_evaluate_run import compose_eval
from tests.fake_openai import FakeOpenAI, Request

pytestmark = pytest.mark.usefixtures("one_thread")
SAMPLE = Path(asset("sample/characterbench"))
FILE = ["data=characterbench_sample", "generation.backend=file", f"generation.path={SAMPLE / 'replies.jsonl'}"]


@pytest.fixture(scope="module")
def tiny_judge(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny chat model (ChatML template) saved as a folder, standing in for CharacterJudge."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(asset("tokenizers/tiny-chatml"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    out = tmp_path_factory.mktemp("judge")
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_parse_score_reads_the_first_line() -> None:
    assert cb.parse_score("4") == 4.0 and cb.parse_score(" 2.5 \nbecause ...") == 2.5
    assert cb.parse_score("Score: 4") is None and cb.parse_score("") is None and cb.parse_score(None) is None


def test_scripted_judge_prompts_and_authors_aggregation(tmp_path: Path, api_key_env: tuple[str, str]) -> None:
    seen: list[dict] = []

    def answer(req: Request) -> str:
        seen.append(req.body)
        text = req.last_content
        if "趣味性" in text:  # zh engagement: 4 and an answer that is no number
            return "4" if "尝吧" in text else "很有趣"
        if "engaging" in text:
            return "5\nvivid"
        return "2"

    out = tmp_path / "cb"
    with FakeOpenAI(api_key=api_key_env[1], answer=answer) as server:
        judge = ["judge=openai", "judge.model=CharacterJudge", f"judge.base_url={server.base_url}",
                 f"judge.api_key_env={api_key_env[0]}", "judge.max_attempts=1"]
        res = run(compose_eval(*FILE, *judge, f"out_dir={out}"))
        # An empty reply is not judged, and the scale is the largest annotation score of the rows judged
        # (the authors' results file): zh engagement's row with score 4 left out, the other (2) answered 3.0.
        replies = tmp_path / "replies.jsonl"
        replies.write_text((SAMPLE / "replies.jsonl").read_text().replace("（倒茶）尝吧，第一口先闻香。", ""))
        small = run(compose_eval("data=characterbench_sample", "generation.backend=file", f"generation.path={replies}",
                                 "generation.on_missing=skip", "data.characterbench.languages=[zh]",
                                 "data.characterbench.dimensions=[engagement]", *judge, f"out_dir={tmp_path / 'small'}"))
    small = small["results"]["characterbench"]
    assert small["replies_empty"] == 1
    assert small["languages"]["zh"]["dimensions"]["engagement"]["score"] == pytest.approx(3.0 / 2 * 5)
    doc = res["results"]["characterbench"]
    zh, en = doc["languages"]["zh"]["dimensions"], doc["languages"]["en"]["dimensions"]
    # engagement's largest annotation score is 4: zh (4 + 3.0 fallback) / 2 / 4 * 5; strict: 4 / 4 * 5
    assert zh["engagement"]["score"] == pytest.approx(3.5 / 4 * 5) and zh["engagement"]["score_strict"] == 5.0
    assert zh["engagement"]["n_unparseable"] == 1 and en["engagement"]["score"] == pytest.approx(5 / 4 * 5)
    # memory_consistency: largest annotation 3; behavior_consistency_human: 3; attribute_consistency_bot: 4
    assert zh["memory_consistency"]["score"] == pytest.approx(2 / 3 * 5)
    assert zh["attribute_consistency_bot"]["score"] == pytest.approx(2 / 4 * 5)
    avg = sum(d["score"] for d in zh.values()) / 4
    assert doc["languages"]["zh"]["average"] == pytest.approx(avg)
    # The prompts: the judge's system message, the user's template filled as the authors' scripts fill it.
    bodies = {b["messages"][1]["content"]: b for b in seen}
    eng = next(b for t, b in bodies.items() if "趣味性" in t and "尝吧" in t)
    assert eng["messages"][0] == {"role": "system", "content": "You are a helpful assistant."}
    text = eng["messages"][1]["content"]
    assert "[多轮对话]\n用户：乔老板，今年春茶怎么样？\n乔木：（笑）头一批芽嫩，像刚醒的孩子。\n\n" in text
    assert "[用户发言]\n用户：那我能尝尝吗？\n" in text and "[角色回复]\n乔木：（倒茶）尝吧，第一口先闻香。" in text
    mem = next(t for t in bodies if "此前说过" in t and "老枞水仙，香得很" in t)
    assert "[角色此前的话]\n乔木：半山腰那块种的是老枞水仙。\n" in mem and "[多轮对话]" not in mem
    style = next(t for t in bodies if "Style" in t and "shortcut" in t)
    assert "[Character]\n" + json.loads((SAMPLE / "behavior_consistency_human_test.json").read_text())[1][
        "translation_en"]["character_profile"] + "Quick-tongued, tells odd road stories.\n" in style
    summary = (out / "summary.md").read_text()
    assert "| engagement | 4.375 | 5.000 | 1/2 | 6.250 | 6.250 | 0/2 |" in summary


def test_local_judge_and_hf_generation_end_to_end(tiny_judge: Path, tmp_path: Path) -> None:
    # File backend + the local chat judge: real calls; its random answers are no number (3.0 each, counted).
    out = tmp_path / "file"
    res = run(compose_eval(*FILE, "judge=hf", f"judge.model={tiny_judge}", "judge.max_tokens=3", f"out_dir={out}"))
    zh = res["results"]["characterbench"]["languages"]["zh"]["dimensions"]
    for dim, top in {"engagement": 4, "memory_consistency": 3, "attribute_consistency_bot": 4,
                     "behavior_consistency_human": 3}.items():
        d = zh[dim]
        assert d["n"] == 2 and d["n_ok"] + d["n_unparseable"] == 2 and d["max_gold"] == top
        if d["n_ok"] == 0:
            assert d["score"] == pytest.approx(3.0 / top * 5) and d["score_strict"] is None
    rows = (out / "characterbench" / "judgements.jsonl").read_text().splitlines()
    assert len(rows) == 16
    # The hf backend generates (default chat layout: a system message, the greeting as the first assistant turn).
    out = tmp_path / "hf"
    res = run(compose_eval("data=characterbench_sample", "data.characterbench.dimensions=[engagement]",
                           "data.characterbench.limit=1", "generation.max_new_tokens=3", "generation.progress=false",
                           "judge=hf", f"judge.model={tiny_judge}", "judge.max_tokens=3", f"out_dir={out}"))
    assert res["results"]["counts"]["generated"] == 2  # one session, zh and en
    gen = [json.loads(x) for x in (out / "characterbench" / "generations.jsonl").read_text().splitlines()]
    assert len(gen) == 2


def test_templates_and_rows_that_differ_are_one_line_errors(tmp_path: Path) -> None:
    bad = tmp_path / "t.yaml"
    bad.write_text("zh:\n  engagement: '{character_profile} {reply}'\n")
    c = OmegaConf.create({"templates": str(bad)})
    with pytest.raises(ConfigError, match=r"zh.engagement: unknown placeholder\(s\) \{reply\}"):
        cb.load_templates(c, ["zh"], ["engagement"])
    with pytest.raises(ConfigError, match=r"en.engagement: missing|no 'en' mapping"):
        cb.load_templates(c, ["en"], ["engagement"])
    root = tmp_path / "cb"
    shutil.copytree(SAMPLE, root)
    rows = json.loads((root / "engagement_test.json").read_text())
    rows[1]["dialogue"][1]["speaker"] = "路人"
    (root / "engagement_test.json").write_text(json.dumps(rows, ensure_ascii=False, indent=2))
    c = OmegaConf.create({"root": str(root), "languages": ["zh"], "dimensions": ["engagement"], "limit": None})
    sessions, dropped = cb.load(c)  # left out (both languages), as the authors' process.py leaves it out
    assert [s.id for s in sessions] == ["zh/engagement/1"]
    assert len(dropped) == 1 and re.search(r"engagement_test.json:\d+: dialogue\[1\]: speaker '路人' is neither",
                                            dropped[0])
    rows[1]["dialogue"][1]["speaker"] = "character"
    del rows[0]["annotation_score"]
    (root / "engagement_test.json").write_text(json.dumps(rows, ensure_ascii=False, indent=2))
    with pytest.raises(DataError, match=r"engagement_test.json:2: field 'annotation_score' is missing"):
        cb.load(c)


def test_prompt_template_and_json_replies(tmp_path: Path) -> None:
    tpl = tmp_path / "rp.yaml"
    tpl.write_text('zh: "[角色]{character_profile}[用户]{user_profile}[对话]{dialogue} 输出 {{\\"response\\": ...}}"\n')
    c = OmegaConf.create({"root": str(SAMPLE), "languages": ["zh"], "dimensions": ["engagement"], "limit": 1,
                          "prompt_template": str(tpl)})
    s = cb.load(c)[0][0]
    msgs = cb.conversation(s, cb.load_prompt_template(c, ["zh"])["zh"])
    # The greeting opens as the character's turn, after an empty user turn (the authors' normalisation).
    assert msgs == [{"role": "user", "content": "[角色]" + s.profile + "[用户]无[对话]user: \nassistant: 客人来啦，先坐，"
                     "水快开了。\nuser: 乔老板，今年春茶怎么样？\nassistant: （笑）头一批芽嫩，像刚醒的孩子。\nuser: 那我能尝尝吗？"
                     ' 输出 {"response": ...}'}]
    assert cb.json_response('```json\n{"response": "（倒茶）尝吧"}\n```') == "（倒茶）尝吧"
    assert cb.json_response("尝吧") is None and cb.json_response('{"reply": "x"}') is None
    tpl.write_text('zh: "{character_profile} {history}"\n')
    with pytest.raises(ConfigError, match=r"prompt_template=.*: zh: unknown placeholder\(s\) \{history\}"):
        cb.load_prompt_template(c, ["zh"])
