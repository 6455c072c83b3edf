"""Report files: metrics.json, judge.jsonl, summary.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rolemrc.eval.judge import Verdict
from rolemrc.eval.metrics import compute_metrics
from rolemrc.eval.report import write_report
from rolemrc.eval.verifiers import agreement


def test_write_report(tmp_path):
    metrics = compute_metrics(
        ["Arr, it sailed in 1820.", "I cannot say."], ["Arr, she sailed in 1820.", "I can't tell."],
        metrics=["bleu", "rouge1", "rougeL"],
    )  # fmt: skip
    verdicts = [
        Verdict("0", "role_related_mrc_answer_with_narration", "KB", 1, "ok", "…\nVERDICT: 1", 1),
        Verdict("0", "role_related_mrc_answer_with_narration", "RS", 0, "ok", "VERDICT: 0", 2),
        Verdict("1", "role_related_mrc_answer_no_narration", "KB", None, "unparseable", "maybe", 1),
        Verdict("2", "role_related_mrc_answer_no_narration-special-format", "NI", 1, "ok", "VERDICT: 1", 1),
        Verdict("3", "role_related_mrc_answer_no_narration-special-format", "NI", None, "failed", None, 5,
                error="HTTP 503"),
        Verdict("4", "role_related_mrc_answer_no_narration-refused", "PI", None, "budget_exhausted", None, 0),
    ]  # fmt: skip
    ag = agreement(verdicts, {"2": True, "3": False})
    paths = write_report(
        tmp_path / "out", metrics=metrics, verdicts=verdicts, agreement=ag, meta={"name": "t", "judge_model": "j"}
    )

    doc = json.loads(paths["metrics.json"].read_text())
    assert set(doc) == {"meta", "metrics", "judge", "verifier_agreement"}
    assert doc["metrics"]["summary"]["bleu"]["n"] == 2 and len(doc["metrics"]["per_sample"]["rougeL"]) == 2
    assert doc["judge"]["KB"] == {
        "dimension": "KB", "accuracy": 1.0, "accuracy_unparseable_as_0": 0.5, "n_ok": 1, "n_unparseable": 1,
        "n_failed": 0,
        "paper_score": None, "n_paper_requests": 0, "n_paper_bad": 0,  # verdict protocol: no paper figure
        "n_budget_exhausted": 0, "n_total": 2, "by_task": doc["judge"]["KB"]["by_task"],
    }  # fmt: skip
    assert doc["judge"]["PI"]["accuracy"] is None and doc["judge"]["PI"]["n_budget_exhausted"] == 1
    assert doc["verifier_agreement"]["n"] == 1 and doc["verifier_agreement"]["n_without_verdict"] == 1

    assert [Verdict(**json.loads(ln)).to_dict() for ln in paths["judge.jsonl"].read_text().splitlines()] == [v.to_dict() for v in verdicts]

    md = paths["summary.md"].read_text()
    assert "| BLEU | " in md and "| ROUGE-L | " in md and " ± " in md
    # accuracy over parseable verdicts and with unparseable scored 0, side by side
    assert "| accuracy (parseable) | accuracy (unparseable = 0) |" in md
    assert "| Knowledge Boundary (KB) | 100.00% | 50.00% | 1 | 1 | 0 | 0 |" in md
    assert "| Nested Instruction-following (NI) | 100.00% | 100.00% | 1 | 0 | 1 | 0 |" in md
    assert "| Prioritized Instruction-following (PI) | n/a | n/a | 0 | 0 | 0 | 1 |" in md
    assert "Agreement 100.00% over 1 items" in md


def test_report_metrics_only(tmp_path):
    metrics = compute_metrics(["a b c d"], ["a b c d"], metrics=["bleu"])
    paths = write_report(tmp_path, metrics=metrics)
    assert set(paths) == {"metrics.json", "summary.md"}
    assert "LLM judge" not in paths["summary.md"].read_text()


def test_reference_tables_checked_and_logged(tmp_path: Path) -> None:
    """report.reference: an unknown name lists the known ones; a user's table in the wrong layout is
    one line naming file and key; its rows join the shipped benchmark's; W&B-style loggers get the
    ``reference`` table."""
    from rolemrc.errors import ConfigError
    from rolemrc.eval import reference
    from rolemrc.eval.report import log_to_loggers

    tables = reference.load_tables()
    with pytest.raises(ConfigError, match=r"report.reference: no published row named 'gpt-9'; known: .*personagym: "
                                          r"claude-3.5-sonnet"):
        reference.select(tables, ["gpt-9"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("benchmark: personagym\ntitle: t\ncolumns: [{key: persona_score, label: PS}]\n"
                   "rows: [{model: m, source: s, figures: {personascore: 4}}]\n")
    with pytest.raises(ConfigError, match=rf"^{bad}: rows\[0\]: figures.personascore is not a column; columns: persona_score$"):
        reference.load_tables([str(bad)])
    mine = tmp_path / "mine.yaml"
    mine.write_text("benchmark: personagym\ntitle: t\ncolumns: [{key: expected_action, label: EA}]\n"
                    "rows: [{model: my-model, source: my paper, figures: {expected_action: 4.0}}]\n")
    picked = reference.select(reference.load_tables([str(mine)]), ["my-model"])
    scalars = {"personagym/expected_action": 3.5}
    text = reference.section(picked, scalars)
    assert text is not None and "| this run | 3.50 | n/a | n/a | n/a | n/a | n/a |" in text
    assert "| my-model | 4.00 | n/a |" in text and "- my-model: my paper" in text

    class Logger:
        def __init__(self) -> None:
            self.tables: dict[str, list] = {}

        def log_metrics(self, metrics: dict, step: int) -> None:
            pass

        def log_table(self, key: str, columns: list, data: list) -> None:
            self.tables[key] = [columns, data]

        def finalize(self, status: str) -> None:
            pass

    lg = Logger()
    log_to_loggers([lg], scalars, [], ["metric"], tables=reference.logger_tables(picked, scalars))
    assert lg.tables["reference"] == [reference.COLUMNS, [["personagym", "this run", "Expected Action", 3.5, ""],
                                                          ["personagym", "my-model", "Expected Action", 4.0, "my paper"]]]
