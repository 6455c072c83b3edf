"""judge=paper computes what RoleMRC's evaluation/llm_judge.py computes (issue 30), and the judge's
console report speaks in sentences (issue 34, item 6).

The authors' figure, as facts of their script: per answer, every "Score:" removed, then Python's
``int()``; an answer that fails (an empty or null one included) scores 0 and is counted as bad;
per dimension the mean over the requests as they send them (instruction-priority items twice).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from rolemrc.errors import ConfigError
from rolemrc.eval import judge as J
from rolemrc.eval.report import unparseable_warning
from rolemrc.eval.run import run
from rolemrc.tasks import Dimension, dimensions_of
from rolemrc.data.schemas import parse_test_item
from rolemrc.eval.generation import item_id
from tests.eval.test_evaluate_file import rolemrc_rows
from tests.eval.test_evaluate_run import compose_eval
from tests.fake_openai import FakeOpenAI, Request

# (answer, what the authors' int() reading gives; None: their script scores 0 and counts it bad)
ANSWERS: list[tuple[str | None, int | None]] = [
    ("1", 1), ("0", 0), ("Score: 1", 1), ("Score:0", 0), (" 1\n", 1), ("01", 1), ("+1", 1), ("-1", -1),
    ("2", 2), ("\uff11", 1), ("1_0", 10), ("Score: Score: 1", 1), ("", None), (None, None), ("yes", None),
    ("1.", None), ("Score: 1.0", None), ("1 0", None), ("The reply", None), ("0\n\nIt refuses.", None),
]


def write_replies(path: Path, rows: list[dict]) -> list[str]:
    """One reply per test row, keyed by rolemrc's item id; some with surrounding whitespace."""
    replies = [["Aye, I will answer.\n", "", "  I cannot say.", "Line one\nline two"][i % 4] for i in range(len(rows))]
    with path.open("w") as f:
        for i, (r, reply) in enumerate(zip(rows, replies)):
            it = parse_test_item(r)
            f.write(json.dumps({"id": item_id(i, it.task, it.question), "reply": reply}) + "\n")
    return replies


def authors_reading(answer: str | None) -> int:
    """The peer: llm_judge.py's per-answer score (written out from its documented behaviour)."""
    try:
        if "Score:" in answer:  # type: ignore[operator]  # None raises TypeError there: scored 0
            answer = answer.replace("Score:", "")  # type: ignore[union-attr]
        return int(answer)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0


def test_the_authors_parse_on_the_listed_answers() -> None:
    for answer, expected in ANSWERS:
        assert J.paper_int(answer) == expected, answer
        assert (J.paper_int(answer) or 0) == authors_reading(answer), answer
        # The strict reading behind `accuracy` takes only exactly 0 or 1.
        strict = J.parse_score(answer)
        assert strict is None or (strict in (0, 1) and strict == expected), answer


class CannedJudge(FakeOpenAI):
    """Answers picked from ANSWERS by the prompt (and the attempt, so the PI repeat may differ);
    ``None`` is sent as a null content. One prompt gets an HTTP 500 first (a transport fault)."""

    def fault(self, req: Request) -> str | None:
        k = self.pick(req)
        if ANSWERS[k][0] is None:
            return "null_content"
        if k == 3 and req.attempt == 1:
            return "server_error"
        return super().fault(req)

    def pick(self, req: Request) -> int:
        return (zlib.crc32(req.last_content.encode()) + req.attempt) % len(ANSWERS)

    def chat_content(self, req: Request) -> str:
        return ANSWERS[self.pick(req)][0] or ""


def _dimension_of_prompt(content: str) -> str:
    for dim in Dimension:
        if f"Rate the reply on {dim.title}." in content:
            return dim.short
    raise AssertionError(f"no dimension in prompt {content[:200]!r}")


def test_paper_judge_reports_the_authors_figure(api_key_env: tuple[str, str], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    rows = rolemrc_rows(54)
    write_replies(tmp_path / "replies.jsonl", rows)
    out = tmp_path / "eval"
    with CannedJudge(api_key=api_key_env[1]) as server:
        sent: list[tuple[dict, int]] = []  # (body, HTTP status)
        real = server._decide

        def record(path: str, auth: str, raw: bytes):
            got = real(path, auth, raw)
            sent.append((json.loads(raw), got[0]))
            return got

        server._decide = record  # type: ignore[method-assign]
        res = run(compose_eval("data=sample", "generation.backend=file", f"generation.path={tmp_path / 'replies.jsonl'}",
                               "metrics.names=[]", "judge=paper", f"judge.base_url={server.base_url}",
                               f"judge.api_key_env={api_key_env[0]}", "judge.backoff_s=0.01", "logger=csv",
                               f"out_dir={out}"))
    assert sum(status == 500 for _, status in sent) >= 1

    # Empty and null answers are answers: scored, not retried, and the run ends normally.
    verdicts = [json.loads(x) for x in (out / "judge.jsonl").read_text().splitlines()]
    assert {v["status"] for v in verdicts} == {"ok", "unparseable"}
    assert any(v["raw"] in ("", None) for v in verdicts)
    assert [v["attempts"] for v in verdicts].count(2) >= 1  # the HTTP 500: retried once, then answered
    assert all(v["attempts"] == 1 for v in verdicts if v["raw"] in ("", None))

    # The requests as the authors send them: one per (item, dimension), PI items twice.
    n_pi = sum(Dimension.PI in dimensions_of(r["task"]) for r in rows)
    assert n_pi > 0
    assert len(verdicts) == sum(len(dimensions_of(r["task"])) for r in rows) + n_pi
    assert sum(v["repeat"] for v in verdicts) == n_pi

    # The figure, per dimension, recomputed from what the server answered (the 500 not included).
    by_dim: dict[str, list[int]] = {}
    for v in verdicts:
        by_dim.setdefault(v["dimension"], []).append(authors_reading(v["raw"]))
    doc = json.loads((out / "metrics.json").read_text())
    md = (out / "summary.md").read_text()
    assert "| dimension | paper score (Figure 4) |" in md and "instruction-priority items asked twice" in md
    differs = False
    for dim, scores in by_dim.items():
        s = doc["judge"][dim]
        assert s["paper_score"] == pytest.approx(sum(scores) / len(scores), abs=1e-12), dim
        assert s["n_paper_requests"] == len(scores)
        assert s["n_paper_bad"] == sum(J.paper_int(v["raw"]) is None for v in verdicts if v["dimension"] == dim)
        assert f"| {s['paper_score']:.4f} ({len(scores)} requests) |" in md
        differs |= s["paper_score"] != s["accuracy_unparseable_as_0"]
        # accuracy stays one judgement per (item, dimension), strict 0/1
        assert s["n_total"] == sum(1 for v in verdicts if v["dimension"] == dim and not v["repeat"])
    assert differs  # "+1", "2", "-1", ... are numbers to the authors, not to the strict reading
    assert all(f"judge/{dim}/paper_score" in (out / "csv" / "metrics.csv").read_text() for dim in by_dim)
    assert res["judge_stats"].prompts == len(verdicts)
    assert "rejected" not in capsys.readouterr().err


TEMPLATES = {
    "KB": "Dialogue:\n{conversations}Reply: \"{response}\"\nThe question is {range} the role's knowledge.\nScore:",
    "RS": "Dialogue:\n{conversations}Reply: \"{response}\"\nStyle?\nScore:",
    "NI": "Rule (**{content}**):\n{conversations}Reply: \"{response}\"\nScore:",
    "MT": "Dialogue:\n{conversations}Last reply: \"{response}\" should be {type}.\nScore:",
    "PI": "Priority:\n{conversations}Reply: \"{response}\"\nScore:",
}


def test_templates_are_the_prompts_and_are_checked_first(api_key_env: tuple[str, str], tmp_path: Path) -> None:
    rows = rolemrc_rows(54)
    replies = write_replies(tmp_path / "replies.jsonl", rows)
    path = tmp_path / "templates.yaml"
    path.write_text(json.dumps(TEMPLATES))  # JSON is YAML
    base = ["data=sample", "generation.backend=file", f"generation.path={tmp_path / 'replies.jsonl'}",
            "metrics.names=[]", "judge=paper", f"judge.api_key_env={api_key_env[0]}"]
    with CannedJudge(api_key=api_key_env[1]) as server:
        sent: list[list[dict]] = []
        real = server._decide

        def record(path_: str, auth: str, raw: bytes):
            sent.append(json.loads(raw)["messages"])
            return real(path_, auth, raw)

        server._decide = record  # type: ignore[method-assign]
        res = run(compose_eval(*base, f"judge.base_url={server.base_url}", f"judge.templates={path}",
                               f"out_dir={tmp_path / 'eval'}"))
    assert res["generation"].replies == replies  # judged exactly as in the file, not stripped
    items = J.judge_items([parse_test_item(r) for r in rows], res["generation"].replies, res["ids"])
    proto = J.protocol_of("paper", templates=path)
    # What was sent is the templates filled in, one user message per request.
    assert {m[0]["content"] for m in sent} == {proto.messages(it, False)[0]["content"] for it in items}
    seen_ni = False
    for it in items:
        (msg,) = proto.messages(it, False)
        conv = "".join(f'{ {"system": "System Instruction", "user": "User Query", "assistant": "LLM Response"}[r]}: '
                       f'"{c}"\n' for r, c in it.messages)
        assert msg["role"] == "user" and msg["content"].startswith(TEMPLATES[it.dimension.short].split("{")[0])
        assert conv in msg["content"] and f'"{it.reply}"' in msg["content"]
        if it.dimension is Dimension.NI:
            seen_ni = True
            assert f"(**{J.nested_rule(it)}**)" in msg["content"] and J.nested_rule(it).strip()
        if it.dimension is Dimension.MT:
            assert ("unanswerable" if "2ndrefused" in it.task else " answerable.") in msg["content"]
    assert seen_ni

    # A bad template is one error naming the file and the key, before anything is read or sent.
    for text, match in ((dict(TEMPLATES, NI="{response} {range}"), r"NI: unknown placeholder\(s\) \{range\}"),
                        ({"XX": "{response}"}, "key 'XX' is not a dimension"),
                        ({"RS": "no reply here"}, r"RS: the template never shows the reply"),
                        ({"RS": "{response"}, "RS: bad braces")):
        path.write_text(json.dumps(text))
        with pytest.raises(ConfigError, match=rf"judge.templates={path}: .*{match}"):
            run(compose_eval(*base, "judge.base_url=http://127.0.0.1:9", f"judge.templates={path}",
                             f"out_dir={tmp_path / 'bad'}"))
    assert not (tmp_path / "bad" / "generations.jsonl").exists()
    with pytest.raises(ConfigError, match="judge.templates asks for score-only prompts"):
        J.judge_config({"backend": "openai", "model": "m", "templates": str(path)})


def test_nested_rule_is_the_second_sentence_without_the_phrase() -> None:
    item = J.JudgeItem("0", "role_related_mrc_answer_no_narration-special-format", Dimension.NI,
                       (("system", "You are Ahab, a whaler. You must end every reply with an exclamation mark. "
                                   "Stay in role."), ("user", "Hi")), "Hello!")
    assert J.nested_rule(item) == " end every reply with an exclamation mark"
    assert J.nested_rule(J.JudgeItem("0", item.task, Dimension.NI, (("system", "No second sentence"),), "x")) == ""


def _verdict(status: str, dim: str = "KB") -> J.Verdict:
    return J.Verdict("0", "role_related_mrc_answer_no_narration", dim, 1 if status == "ok" else None, status,
                     "VERDICT: 1" if status == "ok" else "hm", 1)


def test_console_report_speaks_in_sentences() -> None:
    line = J.no_verdict_line([_verdict("unparseable")] * 60)
    assert line == "judge: 60 of 60 judgements have no verdict: 60 unparseable; none of them is scored"
    mixed = J.no_verdict_line([_verdict("ok")] * 3 + [_verdict("unparseable")] * 2 + [_verdict("failed")])
    assert mixed is not None and "3 of 6" in mixed and "2 unparseable, 1 failed" in mixed and "{" not in mixed
    assert J.no_verdict_line([_verdict("ok")]) is None
    # No verdict at all: no claim that accuracies "rest on few verdicts".
    none = unparseable_warning(J.aggregate([_verdict("unparseable")] * 4))
    assert none is not None and "all 4 answers were unparseable, so there is no accuracy" in none
    assert "rest on" not in none
    few = unparseable_warning(J.aggregate([_verdict("unparseable")] * 3 + [_verdict("ok")]))
    assert few is not None and "rest on those 1 verdicts" in few
    stats = J.RunStats(faults={"rejected": 4, "timeout": 1})
    assert stats.fault_text() == "timeout 1, unparseable 4"


def test_evaluate_console_reports_the_judge_in_sentences(tmp_path: Path) -> None:
    """Through the entry script: the tiny model judging itself gives no verdict at all; the console
    says so in words (no raw dict, no "rest on few verdicts", one word: unparseable)."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT)]))}
    done = subprocess.run(
        [sys.executable, "evaluate.py", "judge=hf", "limit=2", "generation.max_new_tokens=2", "judge.max_tokens=2",
         "generation.progress=false", "metrics.names=[]", f"out_dir={tmp_path / 'eval'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    n = len([x for x in (tmp_path / "eval" / "judge.jsonl").read_text().splitlines() if x.strip()])
    console = done.stdout + done.stderr
    assert f"judge: {n} of {n} judgements have no verdict: {n} unparseable; none of them is scored" in console
    assert f"warning: judge: all {n} answers were unparseable, so there is no accuracy" in console
    assert "{'unparseable'" not in console and "rest on few" not in console and "rejected" not in console
