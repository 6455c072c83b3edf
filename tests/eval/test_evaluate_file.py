"""generation.backend=file through evaluate.py: replies produced elsewhere, scored as usual.

- a folder in RoleBench's public GitHub layout (test files + rolegpt_baseline.jsonl, no profiles,
  no RAW answers): RoleGPT's replies matched by role + question, CUS/SPE ROUGE-1/2/L/Lsum equal
  direct rouge_score calls with the setting the report states, RAW left out with a warning;
- RoleMRC test items matched by id, by conversation or by question; missing replies are an
  error naming how many (or, with on_missing=skip, left out and counted);
- judge=paper (score-only protocol) against the loopback fake server: parsing, one try per
  judgement, both accuracies in summary.md, a console warning when most answers do not parse;
- the report's stated metric settings recompute a sample.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from rouge_score import rouge_scorer

from rolemrc import asset
from rolemrc.eval import generation as G
from rolemrc.eval.generation import GenerationIncomplete, item_id
from rolemrc.eval.run import run
from tests.eval.test_evaluate_run import compose_eval
from tests.fake_openai import FakeOpenAI, Request

RB = Path(asset("sample/rolebench"))
TYPES = ["rouge1", "rouge2", "rougeL", "rougeLsum"]
TESTS = ["rolebench-eng/instruction-generalization/general", "rolebench-eng/instruction-generalization/role_specific",
         "rolebench-eng/role-generalization/general", "rolebench-eng/role-generalization/role_specific",
         "rolebench-zh/general", "rolebench-zh/role_specific"]


def rolegpt_reply(role: str, question: str, refs: list[str]) -> str:
    """A stand-in 'RoleGPT' reply: deterministic in (role, question), overlapping the references."""
    words = refs[-1].split()
    return f"{role}:\n" + " ".join(words[: max(1, len(words) // 2)]) + f"\n{question[:12]}"


@pytest.fixture
def public_rolebench(tmp_path: Path) -> Path:
    """RoleBench as released on GitHub: test files and rolegpt_baseline.jsonl per folder, nothing else."""
    root = tmp_path / "RoleBench"
    for folder in TESTS:
        (root / folder).mkdir(parents=True)
        rows = [json.loads(x) for x in (RB / folder / "test.jsonl").read_text().splitlines()]
        shutil.copy(RB / folder / "test.jsonl", root / folder / "test.jsonl")
        with (root / folder / "rolegpt_baseline.jsonl").open("w") as f:
            for r in reversed(rows):  # another order than the test file
                f.write(json.dumps({"role": r["role"], "question": r["question"],
                                    "generated": [rolegpt_reply(r["role"], r["question"], r["generated"])]},
                                   ensure_ascii=False) + "\n")
    return root


def rb_overrides(root: Path, out: Path, *extra: str) -> list[str]:
    paths = ",".join(str(root / f / "rolegpt_baseline.jsonl") for f in TESTS)
    return ["data=rolebench", f"data.rolebench.root={root}", "generation.backend=file", f"generation.path=[{paths}]",
            "generation.reply_field=generated", f"out_dir={out}", *extra]


def spell(text: str, vocab: dict[str, str]) -> str:
    """Chinese characters as ASCII words, so rouge_score's default tokenizer scores them per character."""
    return " ".join(vocab.setdefault(c, f"w{len(vocab)}") for c in text if not c.isspace())


def test_rolegpt_replies_on_the_public_rolebench_layout(public_rolebench: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    def no_model(*a, **k):
        raise AssertionError("generation.backend=file must not load a model")

    monkeypatch.setattr(G, "load_eval_model", no_model)
    out = tmp_path / "eval"
    with caplog.at_level("WARNING"):
        res = run(compose_eval(*rb_overrides(public_rolebench, out)))
    rb = json.loads((out / "metrics.json").read_text())["rolebench"]
    # RAW: the public files hold no RAW answers: left out with one warning per language, counted.
    assert set(rb["raw_absent"]) == {"eng", "zh"}
    assert sum("RAW answers not found" in r.message for r in caplog.records) == 2
    folders = {"InstEng": ("eng", TESTS[0], TESTS[1]), "RoleEng": ("eng", TESTS[2], TESTS[3]),
               "InstZh": ("zh", TESTS[4], TESTS[5])}
    setting = rb["rouge"]
    assert setting["eng"]["use_stemmer"] is True and setting["eng"]["target"] == "reply"
    assert "use_stemmer=True).score(reply, reference)" in setting["eng"]["call"]
    for split, (lang, general, specific) in folders.items():
        row = rb["splits"][split]
        n_general = len((RB / general / "test.jsonl").read_text().splitlines())
        assert row["RAW"] is None and row["raw_missing"] == n_general
        for kind, folder in (("CUS", general), ("SPE", specific)):
            tests = [json.loads(x) for x in (RB / folder / "test.jsonl").read_text().splitlines()]
            want = {t: 0.0 for t in TYPES}
            for r in tests:
                reply = rolegpt_reply(r["role"], r["question"], r["generated"])
                if lang == "eng":  # the stated setting: Porter stemming, the reply as rouge_score's target
                    scorer = rouge_scorer.RougeScorer(TYPES, use_stemmer=setting["eng"]["use_stemmer"])
                    scores = [scorer.score(reply, ref) for ref in r["generated"]]
                else:  # one token per character, no stemming
                    vocab: dict[str, str] = {}
                    scorer = rouge_scorer.RougeScorer(TYPES)
                    scores = [scorer.score(spell(reply, vocab), spell(ref, vocab)) for ref in r["generated"]]
                for t in TYPES:
                    want[t] += max(s[t].fmeasure for s in scores) / len(tests)
            assert row[kind]["n"] == len(tests)
            for t in TYPES:
                assert row[kind][t] == pytest.approx(want[t], abs=1e-12), (split, kind, t)
    summary = (out / "summary.md").read_text()
    assert "| split | set | n | ROUGE-1 | ROUGE-2 | ROUGE-L | ROUGE-Lsum |" in summary
    assert "RAW left out (eng): RAW answers not found" in summary
    inst = rb["splits"]["InstZh"]
    assert f"| InstZh | n/a | {100 * inst['CUS']['rougeL']:.2f} | {100 * inst['SPE']['rougeL']:.2f} |" in summary
    assert res["results"]["counts"]["generated"] == 0
    # The replies are recorded in the run folder's usual file.
    assert len((out / "rolebench" / "generations.jsonl").read_text().splitlines()) == len(rb["per_item"])


def test_missing_rolebench_replies_are_an_error_or_skipped_and_counted(public_rolebench: Path, tmp_path: Path) -> None:
    f = public_rolebench / TESTS[5] / "rolegpt_baseline.jsonl"
    rows = f.read_text().splitlines()
    f.write_text("\n".join(rows[1:]) + "\n")  # one zh role-specific reply gone
    gone = json.loads(rows[0])
    with pytest.raises(GenerationIncomplete, match=r"generation.path: 1 of \d+ test items have no reply") as e:
        run(compose_eval(*rb_overrides(public_rolebench, tmp_path / "a")))
    assert repr(gone["question"].strip()[:60]) in str(e.value) and "generation.on_missing=skip" in str(e.value)
    run(compose_eval(*rb_overrides(public_rolebench, tmp_path / "b", "generation.on_missing=skip")))
    doc = json.loads((tmp_path / "b" / "metrics.json").read_text())
    n_spe = len((RB / TESTS[5] / "test.jsonl").read_text().splitlines())
    assert doc["rolebench"]["replies_missing"] == 1 and doc["counts"]["replies_missing"] == 1
    assert doc["rolebench"]["splits"]["InstZh"]["SPE"]["n"] == n_spe - 1
    assert "1 item(s) had no reply in the replies file and were left out" in (tmp_path / "b" / "summary.md").read_text()


# ---------------------------------------------------------------- RoleMRC items, judge=paper


def rolemrc_rows(n: int = 6) -> list[dict]:
    return [json.loads(x) for x in Path(asset("sample/test.jsonl")).read_text().splitlines()[:n]]


def write_replies(path: Path, rows: list[dict], skip: int | None = None) -> list[str]:
    """Replies keyed every way the backend matches: rolemrc's item id, the whole conversation,
    the last user turn. Returns the replies in item order."""
    from rolemrc.data.schemas import parse_test_item

    replies = []
    with path.open("w") as f:
        for i, r in enumerate(rows):
            reply = f"Aye, shipmate. Item {i} answered.\nThe tide turns." if i % 2 else ""
            replies.append(reply)
            if i == skip:
                continue
            it = parse_test_item(r)
            if i % 3 == 0:
                key = {"id": item_id(i, it.task, it.question)}
            elif i % 3 == 1:
                key = {"question": r["question"]}
            else:
                key = {"question": r["question"][-1]["content"]}
            f.write(json.dumps({**key, "reply": reply}) + "\n")
    return replies


class PaperJudge(FakeOpenAI):
    """Score-only answers: the first three parse ("1", "Score: 0", " 1\n"), every later one does not."""

    def chat_content(self, req: Request) -> str:
        good = ["1", "Score: 0", " 1\n"]
        return good[req.index - 1] if req.index <= len(good) else ["maybe", "I'd give it a 1"][req.index % 2]


def test_file_replies_scored_and_judged_with_the_paper_protocol(api_key_env: tuple[str, str], tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from rolemrc.eval.judge import parse_score

    rows = rolemrc_rows()
    replies = write_replies(tmp_path / "replies.jsonl", rows)
    out = tmp_path / "eval"
    with PaperJudge(api_key=api_key_env[1]) as server:
        seen: list[dict] = []
        real = server._decide

        def record(path: str, auth: str, raw: bytes):
            seen.append(json.loads(raw))
            return real(path, auth, raw)

        server._decide = record  # type: ignore[method-assign]
        overrides = ["data=sample", "limit=6", "generation.backend=file", f"generation.path={tmp_path / 'replies.jsonl'}",
                     "metrics.names=[bleu,rouge1,rouge2,rougeL,rougeLsum]", "judge=paper",
                     f"judge.base_url={server.base_url}", f"judge.api_key_env={api_key_env[0]}", f"out_dir={out}"]
        res = run(compose_eval(*overrides))
        assert res["generation"].replies == replies  # exactly as in the file

        # The paper protocol: one user message per judgement, temperature 0.7, 4 tokens, score only.
        assert seen and all(b["temperature"] == 0.7 and b["max_tokens"] == 4 for b in seen)
        assert all(b["model"] == "gpt-4-turbo-2024-04-09" and len(b["messages"]) == 1 for b in seen)
        prompt = seen[0]["messages"][0]
        assert prompt["role"] == "user" and prompt["content"].endswith("Score:")
        assert 'System Instruction: "' in prompt["content"] and 'User Query: "' in prompt["content"]
        verdicts = [json.loads(x) for x in (out / "judge.jsonl").read_text().splitlines()]
        assert len(seen) == len(verdicts)  # an unparseable answer is not asked again
        for v in verdicts:
            assert v["attempts"] == 1 and v["verdict"] == parse_score(v["raw"])
            assert v["status"] == ("ok" if v["verdict"] is not None else "unparseable")
        bad = sum(v["status"] == "unparseable" for v in verdicts)
        assert bad == len(verdicts) - 3 and bad * 2 > len(verdicts)

        doc = json.loads((out / "metrics.json").read_text())
        md = (out / "summary.md").read_text()
        for dim, s in doc["judge"].items():
            vs = [v for v in verdicts if v["dimension"] == dim]
            ok = [v["verdict"] for v in vs if v["status"] == "ok"]
            assert s["accuracy"] == (sum(ok) / len(ok) if ok else None)
            assert s["accuracy_unparseable_as_0"] == pytest.approx(sum(ok) / len(vs))
        assert "| accuracy (parseable) | accuracy (unparseable = 0) |" in md and "Protocol: paper." in md
        # Most answers did not parse: a warning line with the counts on the console.
        assert f"warning: judge: {bad} of {len(verdicts)} answers were unparseable (3 parseable)" in capsys.readouterr().err

        # The report states each metric's setting; one sample recomputed with it.
        info, per = doc["metrics"]["info"], doc["metrics"]["per_sample"]
        r = info["rouge"]
        scorer = rouge_scorer.RougeScorer(r["types"], use_stemmer=r["use_stemmer"])
        k = 1
        got = scorer.score(res["generation"].replies[k], rows[k]["reference"]) if r["target"] == "reply" else \
            scorer.score(rows[k]["reference"], res["generation"].replies[k])
        for t in r["types"]:
            assert per[t][k] == got[t].fmeasure
        assert r["use_stemmer"] is True and "use_stemmer=True" in md
        assert info["bleu"]["undefined"] == "skip" and per["bleu"][0] is None  # empty reply: left out
        assert doc["metrics"]["summary"]["bleu"]["n_undefined"] == 3
        assert "left out of the mean (the authors' script)" in md

        # Rerun: the parsed answers come from the cache; only the unparseable ones are asked again.
        before = len(seen)
        run(compose_eval(*overrides))
        assert len(seen) - before == bad


def test_rolemrc_items_missing_a_reply(tmp_path: Path) -> None:
    rows = rolemrc_rows()
    write_replies(tmp_path / "replies.jsonl", rows, skip=4)
    base = ["data=sample", "limit=6", "generation.backend=file", f"generation.path={tmp_path / 'replies.jsonl'}",
            "metrics.names=[rougeL]"]
    with pytest.raises(GenerationIncomplete, match=r"1 of 6 test items have no reply .* \(first: 00004-"):
        run(compose_eval(*base, f"out_dir={tmp_path / 'a'}"))
    res = run(compose_eval(*base, "generation.on_missing=skip", f"out_dir={tmp_path / 'b'}",
                           "report.reference=[qwen2.5-7b-rolemrc-sft]"))
    doc = json.loads((tmp_path / "b" / "metrics.json").read_text())
    # report.reference: Table 3's row beside this run's ROUGE-L (the only metric computed here)
    summary = (tmp_path / "b" / "summary.md").read_text()
    rouge_l = doc["metrics"]["summary"]["rougeL"]["mean"]
    assert f"| this run | n/a | n/a | n/a | {rouge_l:.4f} | n/a | n/a | n/a |" in summary
    assert "| Qwen2.5-7B-RoleMRC-SFT | 0.1963 | 0.4764 | 0.2744 | 0.3959 | 0.3968 | 0.4337 | 0.9063 |" in summary
    assert "- Qwen2.5-7B-RoleMRC-SFT: RoleMRC paper (arXiv 2502.11387), Table 3" in summary
    assert doc["counts"]["replies_missing"] == 1 and doc["meta"]["items"] == 5
    assert doc["metrics"]["summary"]["rougeL"]["n"] == 5 and len(res["ids"]) == 5
    assert "1 of 6 test items have no reply" in doc["meta"]["replies_missing"]
    # A row no key can match, or two replies for one item: file:line errors.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"reply": "x"}\n{"id": "a", "reply": "y"}\n{"id": "a", "reply": "z"}\n')
    with pytest.raises(Exception, match=rf"{bad}:1: a reply row needs an 'id' or a 'question'"):
        run(compose_eval(*base[:3], base[4], f"generation.path={bad}", f"out_dir={tmp_path / 'c'}"))
    with pytest.raises(Exception, match=rf"{bad}:3: a different reply for the same item as {bad}:2"):
        run(compose_eval(*base[:3], base[4], f"generation.path={bad}", f"out_dir={tmp_path / 'c'}"))


# Replies as a model may leave them: a trailing hyphen-newline, surrounding blanks, abbreviations
# (Punkt vs a naive sentence split), CRLF, empty, unicode.
RAW_REPLIES = [
    "(replaced by the first item's reference + a hyphen-newline)",
    "  Mr. Smith met Dr. Jones at 5 p.m. today. He left.  \n",
    "",
    "Line one\r\nLine two, e.g. this one.\r\n",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u2013 d\u00e9j\u00e0 vu!",
    "\n\nArr, the ship sailed in 1820-\n",
]


def test_defaults_score_file_replies_as_the_authors_script(tmp_path: Path) -> None:
    """evaluate.py's default metrics on a replies file = the authors' per-sample calls on the replies
    exactly as in the file: evaluate's bleu (13a + nmt BLEU), rouge_score with stemming
    score(reply, reference), evaluate's meteor (word_tokenize with NLTK's Punkt data)."""
    from nltk.tokenize import word_tokenize
    from nltk.translate.meteor_score import single_meteor_score

    from tests.eval.test_metrics_parity import _evaluate_bleu, _evaluate_tokens

    rows = rolemrc_rows(len(RAW_REPLIES))
    # The first reply is its reference with a hyphen-newline left at the end by the model.
    replies = [rows[0]["reference"] + "-\n", *RAW_REPLIES[1:]]
    path = tmp_path / "replies.jsonl"
    from rolemrc.data.schemas import parse_test_item

    with path.open("w") as f:
        for i, (r, reply) in enumerate(zip(rows, replies)):
            it = parse_test_item(r)
            f.write(json.dumps({"id": item_id(i, it.task, it.question), "reply": reply}) + "\n")
    base = ["data=sample", f"limit={len(rows)}", "generation.backend=file", f"generation.path={path}",
            "metrics.names=[bleu,rouge1,rouge2,rougeL,rougeLsum,meteor]"]
    res = run(compose_eval(*base, f"out_dir={tmp_path / 'a'}"))
    assert res["generation"].replies == replies
    assert [json.loads(x)["reply"] for x in (tmp_path / "a" / "generations.jsonl").read_text().splitlines()] == replies
    per = json.loads((tmp_path / "a" / "metrics.json").read_text())["metrics"]["per_sample"]
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=True)
    for k, (reply, row) in enumerate(zip(replies, rows)):
        ref = row["reference"]
        bleu = _evaluate_bleu(reply, [ref]) if _evaluate_tokens(reply) and _evaluate_tokens(ref) else None
        assert per["bleu"][k] == (None if bleu is None else pytest.approx(bleu, abs=1e-9)), reply
        for t, score in scorer.score(reply, ref).items():
            assert per[t][k] == pytest.approx(score.fmeasure, abs=1e-9), (t, reply)
        meteor = single_meteor_score(word_tokenize(ref), word_tokenize(reply), alpha=0.9, beta=3, gamma=0.5)
        assert per["meteor"][k] == pytest.approx(meteor, abs=1e-9), reply
    assert "replies scored as generated (not stripped)" in (tmp_path / "a" / "summary.md").read_text()
    # The hyphen-newline reply: 13a removes "-\n" (so it equals its reference); stripped first, the hyphen stays.
    assert per["bleu"][0] == pytest.approx(1.0) and per["bleu"][0] > _evaluate_bleu(replies[0].strip(), [rows[0]["reference"]])

    # Normalising is an explicit option, reported; the file's replies stay as they were.
    res = run(compose_eval(*base, "generation.strip_replies=true", f"out_dir={tmp_path / 'b'}"))
    assert res["generation"].replies == [r.strip() for r in replies]
    stripped = json.loads((tmp_path / "b" / "metrics.json").read_text())["metrics"]["per_sample"]
    assert stripped["bleu"][0] == pytest.approx(_evaluate_bleu(replies[0].strip(), [rows[0]["reference"]]), abs=1e-9)
    assert "generation.strip_replies=true" in (tmp_path / "b" / "summary.md").read_text()
    assert [json.loads(x)["reply"] for x in (tmp_path / "b" / "generations.jsonl").read_text().splitlines()] == replies
