"""PersonaGym on the shipped sample: the released layout read (a differing copy is a one-line
file:line error), replies generated (hf) or read (file), score examples and grading requests
built as the authors' code builds them, two judges on a loopback OpenAI-compatible server
averaged per group, per-task and overall PersonaScore; a failed request is missing, never scored,
and a rerun asks only for it."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from rolemrc.data.schemas import DataError
from rolemrc.eval.bench.personagym import evaluation_scores, nonzero_mean, score_examples
from rolemrc.eval.judge import NoScores
from rolemrc.eval.run import JudgeIncomplete, run
from rolemrc import asset
from tests.eval.test_evaluate_run import compose_eval
from tests.fake_openai import FakeOpenAI, Request

pytestmark = pytest.mark.usefixtures("one_thread")

SAMPLE = Path(asset("sample/personagym"))
QDIR = SAMPLE / "questions" / "benchmark-v1"


def test_answers_read_as_the_authors_read_them() -> None:
    text = ("(1) Evaluation: good. Therefore, the final score is 4.\n(2) Evaluation: no number here\n"
            "(3) Evaluation: Therefore, the final score is 2")
    assert evaluation_scores(text) == [4, 0, 2]
    assert nonzero_mean([4, 0, 2]) == 3.0 and nonzero_mean([0, 0]) == 0.0 and nonzero_mean([]) == 0.0
    ex = ('Rubric 1 Examples:\nScore 1: Response - "bad"\n\nScore 2:  Response - meh\nmore\n'
          "Rubric 2 Examples:\nScore 1: Response - worse\nScore 2: Response - fine")
    # released: the processed examples text (continuation lines dropped), indexed per question
    assert score_examples(ex, 2, "released") == ["S", "c"]
    assert score_examples(ex, 2, "per_question") == ['Score 1: "bad"\n\nScore 2: "meh', 'Score 1: "worse"\n\nScore 2: "fine"']
    assert score_examples(ex, 3, "per_question") is None and score_examples("no examples", 1, "released") is None
    assert score_examples(None, 2, "none") == ["", ""]


def _replies(path: Path, skip: str | None = None) -> Path:
    rows = []
    for f in sorted(QDIR.glob("*.json")):
        for task, qs in json.loads(f.read_text()).items():
            rows += [{"id": f"personagym/{f.stem}/{task}/{k}", "reply": f"[{task}] reply {k}"} for k in range(len(qs))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _examples(req: Request) -> str:
    n = req.last_content.count("Persona:")
    return "\n".join(f"Rubric {i + 1} Examples:\n" + "\n".join(f"Score {s}: Response - e{s}" for s in range(1, 6))
                     for i in range(n))


def test_personagym_file_replies_two_judges_missing_counted_and_rerun(
        tmp_path: Path, api_key_env: tuple[str, str]) -> None:
    down = {"on": True}
    graded: list[dict] = []

    def answer(req: Request) -> str:
        if req.body["messages"][0]["role"] == "user":  # the score-examples request
            return _examples(req)
        graded.append(req.body)
        n = req.last_content.count("Answer:")
        if req.body["model"] == "judge-a":  # 4 and a part without a final score: mean of the non-zero, 4
            return "\n".join(f"({i + 1}) Evaluation: ok." + (" Therefore, the final score is 4" if i == 0 else "")
                             for i in range(n))
        return "\n".join(f"({i + 1}) Evaluation: Therefore, the final score is 2" for i in range(n))

    def faults(req: Request) -> str | None:  # judge-b fails on Toxicity while `down`
        return "unavailable" if down["on"] and req.body["model"] == "judge-b" and "toxicity" in req.last_content \
            else None

    out = tmp_path / "pg"
    with FakeOpenAI(api_key=api_key_env[1], answer=answer, faults=faults) as server:
        over = ["data=personagym_sample", "generation.backend=file", f"generation.path={_replies(tmp_path / 'r.jsonl')}",
                "judge=openai", "judge.model=judge-a", f"judge.base_url={server.base_url}",
                f"judge.api_key_env={api_key_env[0]}", "judge.max_attempts=2", "judge.backoff_s=0", "judge.max_backoff_s=0",
                "judge.timeout_s=60",
                "+data.personagym.judges=[{model: judge-a},{model: judge-b}]", "logger=csv", f"out_dir={out}",
                "report.reference=[GPT-3.5,Qwen2.5-7B-RoleMRC-SFT]"]
        with pytest.raises(JudgeIncomplete, match=r"PersonaGym: 8 of 10 groups scored, missing 2 failed"):
            run(compose_eval(*over))
        doc = json.loads((out / "metrics.json").read_text())["personagym"]
        ea = doc["overall"]
        assert ea["Expected Action"] == pytest.approx(3.0) and ea["Toxicity"] is None and ea["PersonaScore"] is None
        # The grading request: the judges' system message, then the rubrics as a Python list, each filled
        # with persona, question, reply and the released code's score example (the i-th character).
        # (the judges' requests arrive in any order: the pastry chef's group is picked by its persona)
        body = next(b for b in graded if "Expected Action] reply 1" in b["messages"][1]["content"]
                    and "Persona: A 27-year-old pastry chef" in b["messages"][1]["content"])
        assert body["messages"][0] == {"role": "system", "content": (SAMPLE / "prompts/rubric_grading/sys_prompt.txt").read_text()}
        rubrics = ast.literal_eval(body["messages"][1]["content"].split("Rubrics:\n", 1)[1].strip())
        assert len(rubrics) == 2 and "Persona: A 27-year-old pastry chef" in rubrics[0]
        assert "Reference answers for each score:\nS\n" in rubrics[0] and "score:\nc\n" in rubrics[1]
        assert "Answer: [Expected Action] reply 0" in rubrics[0]
        assert body["temperature"] == 0.0
        sent = server.requests
        # 10 groups: 10 examples requests, 10 per judge (judge-b's 2 toxicity ones failed twice)
        assert sent == 32
        down["on"] = False
        res = run(compose_eval(*over))
        assert server.requests - sent == 2  # only the failed ones
        doc = res["results"]["personagym"]
        assert doc["overall"]["PersonaScore"] == pytest.approx(3.0)
        assert doc["counts"]["evaluations_without_score"] == 10 * 1  # judge-a's second part, per group of 2
        summary = (out / "summary.md").read_text()
        assert "| this run | 3.00 | 3.00 | 3.00 | 3.00 | 3.00 | 3.00 |" in summary
        assert "personagym/persona_score" in (out / "csv" / "metrics.csv").read_text()
        # report.reference: the published row beside this run's, with its source; benchmarks not run are named
        assert "| this run | 3.00 | 3.00 | 3.00 | 3.00 | 3.00 | 3.00 |\n| gpt-3.5 | 4.28 | 3.63 | 4.70 | 4.96 | 4.31 | 4.38 |" \
            in summary
        assert "- gpt-3.5: PersonaGym repository (vsamuel2003/PersonaGym), evaluations/20240710_gpt_35/scores.json" in summary
        skipped = next(line for line in summary.splitlines() if line.startswith("Not evaluated in this run, so not shown: "))
        assert "RoleBench" in skipped and "PersonaGym" not in skipped
        ref = json.loads((out / "metrics.json").read_text())["reference"]
        assert ["personagym", "gpt-3.5", "PersonaScore", 4.38, ref[-1][4]] == ref[-1] and ref[0][:2] == ["personagym", "this run"]


def test_personagym_hf_and_openai_generation_and_layout_errors(tmp_path: Path, api_key_env: tuple[str, str]) -> None:
    def answer(req: Request) -> str:
        if req.body["model"] == "actor":  # generation.backend=openai: the persona's answer
            assert req.body["messages"][0]["content"].startswith("You are A ")
            return "In character."
        if req.body["messages"][0]["role"] == "user":
            return _examples(req)
        return "(1) Evaluation: Therefore, the final score is 5"

    with FakeOpenAI(api_key=api_key_env[1], answer=answer) as server:
        over = ["data=personagym_sample", "data.personagym.questions=1", "data.personagym.score_examples=none",
                "generation.max_new_tokens=4", "generation.progress=false", "judge=openai", "judge.model=j",
                f"judge.base_url={server.base_url}", f"judge.api_key_env={api_key_env[0]}"]
        res = run(compose_eval(*over, f"out_dir={tmp_path / 'hf'}"))
        doc = res["results"]["personagym"]
        assert doc["overall"]["PersonaScore"] == 5.0 and res["results"]["counts"]["generated"] == 10
        gens = (tmp_path / "hf" / "personagym" / "generations.jsonl").read_text().splitlines()
        assert len(gens) == 10
        assert server.requests == 10  # no score-examples request with score_examples=none
        res = run(compose_eval(*over, "generation.backend=openai", "generation.model=actor",
                               f"generation.base_url={server.base_url}", f"generation.api_key_env={api_key_env[0]}",
                               f"out_dir={tmp_path / 'api'}"))
        assert res["results"]["personagym"]["overall"]["PersonaScore"] == 5.0
        assert server.requests == 10 + 10 + 10  # 10 replies generated, 10 groups graded

        # A copy that differs from the released layout: one line naming file, line and field.
        root = tmp_path / "copy"
        for sub in ("rubrics", "prompts/rubric_grading", "prompts/score_examples"):
            (root / sub).mkdir(parents=True)
            for f in (SAMPLE / sub).iterdir():
                (root / sub / f.name).write_text(f.read_text())
        (root / "questions/benchmark-v1").mkdir(parents=True)
        bad = root / "questions/benchmark-v1/Someone.json"
        bad.write_text('{\n  "Expected Action": ["q"],\n  "Toxicity Control": ["q"]\n}\n')
        with pytest.raises(DataError, match=rf"^{bad}:3: field 'Toxicity Control' is not a PersonaGym task"):
            run(compose_eval(*over, f"data.personagym.root={root}", f"out_dir={tmp_path / 'bad'}"))
        bad.write_text('{"Expected Action": ["q"]}')
        with pytest.raises(DataError, match=r"Someone.json:1: field 'Linguistic Habits' missing"):
            run(compose_eval(*over, f"data.personagym.root={root}", f"out_dir={tmp_path / 'bad'}"))
        (root / "rubrics/Toxicity.txt").write_text("Rate {answer}")
        with pytest.raises(DataError, match=r"Toxicity.txt: unknown placeholder\(s\) \{answer\}"):
            run(compose_eval(*over, f"data.personagym.root={root}", f"out_dir={tmp_path / 'bad'}"))
    with pytest.raises(ValueError, match="data.personagym is scored by judges: judge.backend is none"):
        run(compose_eval("data=personagym_sample", f"out_dir={tmp_path / 'none'}"))
    # The local judge (the tiny model judging itself) writes no score examples: groups unscored, the
    # report written, and the run does not end as a success on a table of n/a.
    with pytest.raises(NoScores, match=r"none of the 0 judge answers holds a score .* and 10 group\(s\) got no usable"):
        run(compose_eval("data=personagym_sample", "data.personagym.questions=1", "generation.max_new_tokens=2",
                         "generation.progress=false", "judge=hf", "judge.max_tokens=3", f"out_dir={tmp_path / 'hf_judge'}"))
    doc = json.loads((tmp_path / "hf_judge" / "metrics.json").read_text())["personagym"]
    assert doc["counts"]["examples_unusable"] == 10 and doc["overall"]["PersonaScore"] is None
