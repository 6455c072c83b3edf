"""CharacterLLM Single/Turns: interviews generated (multi-turn sessions see their own earlier
replies), judged 1-7 per dimension by an OpenAI-compatible server on loopback (the shared fake)
or the local hf judge; unparseable scores counted and never scored, a rerun asks only for them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rolemrc.eval.characterllm import CRITERIA, parse_score
from rolemrc.eval.judge import NoScores
from rolemrc.eval.run import JudgeIncomplete, run
from tests.eval.test_evaluate_run import compose_eval
from tests.fake_openai import FakeOpenAI, Request

FAST = ["data=characterllm_sample", "generation.max_new_tokens=4", "generation.progress=false",
        "data.characterllm.questions=1"]
SCORES = {"Memorization": "SCORE: 6", "Values": "SCORE: 3", "Hallucination": "**SCORE: 7**", "Stability": "SCORE: 5"}


pytestmark = pytest.mark.usefixtures("one_thread")


def test_parse_score_is_strict() -> None:
    assert parse_score("The replies are vivid.\nSCORE: 5") == 5
    assert parse_score("fine\n**SCORE: 7**\n") == 7
    assert parse_score("SCORE: 9") is None  # off the 1-7 scale
    assert parse_score("SCORE: 0") is None
    assert parse_score("SCORE: 5\nHope this helps") is None  # the score must be the last line
    assert parse_score("I would give it a 4.") is None
    assert parse_score("") is None and parse_score(None) is None


def _criterion(req: Request) -> str:
    text = req.last_content
    return text.split("[Criterion]\n", 1)[1].split(" (1-7)", 1)[0]


def test_characterllm_openai_judge_means_unparseable_counted_and_rerun(
        tmp_path: Path, api_key_env: tuple[str, str]) -> None:
    fixed = {"personality": False}
    seen: list[str] = []

    def answer(req: Request) -> str:
        seen.append(req.last_content)
        crit = _criterion(req)
        if crit == "Personality":
            return "Reasoned about it.\nSCORE: 4" if fixed["personality"] else "The character seems lively overall."
        return f"Checked the interview.\n{SCORES[crit]}"

    def faults(req: Request) -> str | None:  # the first request of each Stability prompt fails
        return "server_error" if _criterion(req) == "Stability" and req.attempt == 1 else None

    out = tmp_path / "cl"
    with FakeOpenAI(api_key=api_key_env[1], answer=answer, faults=faults) as server:
        over = [*FAST, "judge=openai", "judge.model=fake-judge", f"judge.base_url={server.base_url}",
                f"judge.api_key_env={api_key_env[0]}", "judge.max_attempts=2", "judge.backoff_s=0",
                "judge.max_backoff_s=0", "judge.timeout_s=10", "logger=csv", f"out_dir={out}"]
        with pytest.raises(JudgeIncomplete, match=r"missing 4 unparseable"):
            run(compose_eval(*over))
        doc = json.loads((out / "metrics.json").read_text())["characterllm"]
        n_single, n_turns = 2, 2  # two characters, questions=1: one question / one session each
        single, turns = doc["settings"]["single"], doc["settings"]["turns"]
        assert single["memorization"]["mean"] == 6 and single["values"]["mean"] == 3
        assert single["hallucination"]["mean"] == 7 and single["stability"]["mean"] == 5
        assert single["personality"] == {"mean": None, "n_ok": 0, "n_unparseable": n_single, "n_failed": 0,
                                         "n_budget_exhausted": 0}
        assert turns["personality"]["n_unparseable"] == n_turns
        assert single["mean"] == pytest.approx((6 + 3 + 7 + 5) / 4) and turns["mean"] == single["mean"]
        # Multi-turn sessions: three questions, each round asked with the earlier replies in the prompt.
        sessions = [iv for iv in doc["interviews"] if iv["setting"] == "turns"]
        assert len(sessions) == n_turns and all(len(s["turns"]) == 3 for s in sessions)
        assert all((out / "characterllm" / "turns" / f"round_{r}" / "generations.jsonl").is_file() for r in (1, 2, 3))
        # The judge saw the profile and the whole interview.
        assert any("Halvard Stone was a clockmaker" in t and t.count("Interviewer:") == 3 for t in seen)
        assert any("Ottilie Varga was a balloonist" in t and t.count("Interviewer:") == 1 for t in seen)
        summary = (out / "summary.md").read_text()
        assert "| Single | 6.00 | 3.00 | n/a | 7.00 | 5.00 | 5.25 |" in summary
        assert "| Single | Personality | 0 | 2 | 0 | 0 |" in summary
        assert "characterllm/single/memorization" in (out / "csv" / "metrics.csv").read_text()
        sent = server.requests
        # 5 dimensions x 4 interviews; personality asked twice (max_attempts), stability's first 500 retried.
        assert sent == 4 * (len(CRITERIA) - 2) + 4 * 2 + 4 * 2
        # Rerun after the judge is fixed: only the personality prompts are asked, nothing is regenerated.
        fixed["personality"] = True
        res = run(compose_eval(*over))
        assert server.requests - sent == 4
        assert res["results"]["counts"]["generated"] == 0
        doc = json.loads((out / "metrics.json").read_text())["characterllm"]
        assert doc["settings"]["single"]["personality"]["mean"] == 4
        assert doc["settings"]["single"]["mean"] == pytest.approx((6 + 3 + 4 + 7 + 5) / 5)
        assert doc["judge"]["cache_hits"] == 16


def test_characterllm_needs_a_judge_and_hf_judge_counts_unparseable(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="data.characterllm is scored by a judge"):
        run(compose_eval(*FAST, f"out_dir={tmp_path / 'none'}"))
    out = tmp_path / "hf"
    # The random tiny model judging itself writes no score: the report is written, and the run
    # does not end as a success on a table of n/a (issue 34 item 6).
    with pytest.raises(NoScores, match=rf"CharacterLLM judge: all {2 * len(CRITERIA)} answers were unparseable .*, so there is no score"):
        run(compose_eval(*FAST, "judge=hf", "judge.max_tokens=3", "data.characterllm.settings=[single]",
                         "logger=wandb", f"out_dir={out}"))
    doc = json.loads((out / "metrics.json").read_text())["characterllm"]
    row = doc["settings"]["single"]
    # Every answer counted, none scored as 0.
    assert all(row[d]["n_ok"] == 0 and row[d]["n_unparseable"] == 2 for d in CRITERIA)
    # The same numbers went to W&B (offline run in the evaluation folder).
    from tests.callbacks.helpers import wandb_history

    (logged,) = [r for r in wandb_history(out) if "characterllm/single/memorization/n_unparseable" in r]
    for d in CRITERIA:
        assert logged[f"characterllm/single/{d}/n_unparseable"] == row[d]["n_unparseable"]
        assert (f"characterllm/single/{d}" in logged) == (row[d]["mean"] is not None)
    assert all(s["score"] is None or 1 <= s["score"] <= 7 for s in doc["scores"])
    assert "turns" not in doc["settings"]
