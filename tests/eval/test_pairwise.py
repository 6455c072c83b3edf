"""Pairwise judging (``pairwise.against``) against the loopback judge (tests/fake_openai.py).

Model A's replies come from a replies file (generation.backend=file), B's from another. Each
comparison is asked in both orders; the fake judge prefers the reply marked ``[[strong]]``, always
picks the first position for ``[[first]]`` (an order flip: a tie), says tie for ``[[tie]]`` and
is down (503) for ``[[down]]`` until repaired: that comparison is counted as failed, never scored,
the run exits non-zero, and the rerun of the same command asks only for it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rolemrc.config import Judging
from rolemrc.data.schemas import parse_test_item
from rolemrc.errors import ConfigError, InputNotFound
from rolemrc.eval import pairwise
from rolemrc.eval.generation import item_id
from rolemrc.eval.judge import JudgeIncomplete
from rolemrc.eval.run import run
from tests.eval.test_evaluate_file import rolemrc_rows
from tests.eval.test_evaluate_run import compose_eval
from tests.fake_openai import FakeOpenAI, Request

A = ["[[strong]] alpha-0", "alpha-1", "alpha-2 [[first]]", "alpha-3 [[tie]]", "alpha-4 [[down]]"]
B = ["beta-0", "[[strong]] beta-1", "beta-2", "beta-3", "beta-4"]


class PairJudge(FakeOpenAI):
    broken = True

    def fault(self, req: Request) -> str | None:
        if "[[down]]" in req.last_content and self.broken:
            return "unavailable"
        return super().fault(req)

    def chat_content(self, req: Request) -> str:
        c = req.last_content
        if "[[first]]" in c:
            return "The first one reads well.\nWINNER: 1"
        if "[[tie]]" in c:
            return "Both are as good.\n**WINNER: tie**"
        head = c.split("=== Reply 2 ===", 1)[0]
        return "One reply fits the role better.\nWINNER: " + ("1" if "[[strong]]" in head else "2")


def write(path: Path, rows: list[dict], replies: list[str]) -> None:
    with path.open("w") as f:
        for i, (r, reply) in enumerate(zip(rows, replies)):
            it = parse_test_item(r)
            f.write(json.dumps({"id": item_id(i, it.task, it.question), "reply": reply}) + "\n")


def test_both_orders_ties_on_flips_failures_unscored_and_resume(api_key_env: tuple[str, str], tmp_path: Path) -> None:
    rows = rolemrc_rows(5)
    write(tmp_path / "a.jsonl", rows, A)
    write(tmp_path / "b.jsonl", rows, B)
    out = tmp_path / "eval"
    with PairJudge(api_key=api_key_env[1]) as server:
        seen: list[str] = []
        real = server._decide

        def record(path: str, auth: str, raw: bytes):
            seen.append(json.loads(raw)["messages"][-1]["content"])
            return real(path, auth, raw)

        server._decide = record  # type: ignore[method-assign]
        overrides = ["data=sample", "limit=5", "generation.backend=file", f"generation.path={tmp_path / 'a.jsonl'}",
                     "metrics.names=[rougeL]", "judge=openai", "judge.model=judge-x", f"judge.base_url={server.base_url}",
                     f"judge.api_key_env={api_key_env[0]}", "judge.max_attempts=2", "judge.backoff_s=0.01",
                     f"pairwise.against={tmp_path / 'b.jsonl'}", f"out_dir={out}"]
        with pytest.raises(JudgeIncomplete, match=r"4 of 5 comparisons decided, missing 1 failed"):
            run(compose_eval(*overrides))

        # Both orders sent for every item: A's reply above B's once, below it once.
        for a, b in zip(A[:4], B[:4]):
            asked = [c for c in seen if a in c]
            assert sorted(c.index(a) < c.index(b) for c in asked) == [False, True]
        doc = json.loads((out / "metrics.json").read_text())
        t = doc["pairwise"]["opponents"]["b"]["overall"]
        assert (t["n"], t["wins"], t["ties"], t["losses"], t["flips"], t["n_failed"]) == (4, 1, 2, 1, 1, 1)
        assert t["win_rate"] == 0.25 and t["tie_rate"] == 0.5 and t["win_rate_ties_half"] == 0.5
        by_task = doc["pairwise"]["opponents"]["b"]["by_task"]
        assert sum(r["n"] for r in by_task.values()) == 4 and set(by_task) == {parse_test_item(r).task for r in rows}
        pairs = [json.loads(x) for x in (out / "pairwise.jsonl").read_text().splitlines()]
        assert [p["outcome"] for p in pairs] == ["win", "loss", "tie", "tie", None]
        assert pairs[2]["flip"] and (pairs[2]["a_first"], pairs[2]["b_first"]) == ("A", "B")
        assert pairs[4]["status"] == "failed" and pairs[4]["outcome"] is None  # never scored
        md = (out / "summary.md").read_text()
        assert "## Pairwise: A = " in md and "vs B = b (judge: judge-x)" in md and "flips with the" in md
        assert "| **all** | 4 | 1 | 2 | 1 | 25.00% | 50.00% | 25.00% | 50.00% | 1 | 0 | 1 | 0 |" in md

        # Rerun the same command with the judge repaired: only the failed comparison is asked.
        server.broken = False
        before = len(seen)
        res = run(compose_eval(*overrides))
        assert len(seen) - before == 2 and all(A[4] in c for c in seen[before:])
        t = res["pairwise"]["opponents"]["b"]["overall"]
        assert (t["n"], t["wins"], t["ties"], t["losses"], t["n_failed"]) == (5, 1, 3, 1, 0)
        assert res["pairwise"]["cache_hits"] == 8


def test_template_and_inputs_checked_before_work(api_key_env: tuple[str, str], tmp_path: Path) -> None:
    bad = tmp_path / "t.txt"
    bad.write_text("Compare {reply_1} with {reply_two}.")
    with pytest.raises(ConfigError, match=rf"pairwise.template={bad}: unknown placeholder\(s\) \{{reply_two\}}"):
        pairwise.load_template(str(bad))
    bad.write_text("Only {reply_1} here.")
    with pytest.raises(ConfigError, match=r"never shows \{reply_2\}"):
        pairwise.load_template(str(bad))
    good = tmp_path / "mine.txt"
    good.write_text("Task {task}. First: {reply_1} Second: {reply_2} {{literal}}")
    it = parse_test_item(rolemrc_rows(1)[0])
    msg = pairwise.prompt(pairwise.load_template(str(good)), it, "x", "y")
    assert msg == [{"role": "user", "content": f"Task {it.task}. First: x Second: y {{literal}}"}]
    assert pairwise.combine("A", "A") == ("win", False) and pairwise.combine("B", "B") == ("loss", False)
    assert pairwise.combine("A", "tie") == ("tie", False) and pairwise.combine("B", "A") == ("tie", True)
    assert pairwise.combine("A", None) == (None, False)
    assert pairwise.parse_winner("x\nWINNER: 2\n") == "2" and pairwise.parse_winner("WINNER: 1\nmore") is None

    write(tmp_path / "a.jsonl", rolemrc_rows(2), A[:2])
    base = ["data=sample", "limit=2", "generation.backend=file", f"generation.path={tmp_path / 'a.jsonl'}",
            "metrics.names=[rougeL]", f"out_dir={tmp_path / 'o'}"]
    with pytest.raises(ConfigError, match="pairwise.against is set but there is no judge"):
        run(compose_eval(*base, f"pairwise.against={tmp_path / 'a.jsonl'}"))
    with pytest.raises(InputNotFound, match=rf"pairwise.against: no such file: {tmp_path / 'nope.jsonl'}"):
        run(compose_eval(*base, "judge=openai", f"judge.api_key_env={api_key_env[0]}",
                         f"pairwise.against={tmp_path / 'nope.jsonl'}"))
    assert not (tmp_path / "o" / "metrics.json").exists()


def test_local_judge_answers_read_once_and_lists_of_opponents(tmp_path: Path) -> None:
    """A local (greedy) judge: its text is read here, an answer without a winner is final
    (unparseable, not missing, not cached); a list of files is one opponent each."""
    import asyncio  # noqa: F401 - the stub's answer_all is a coroutine

    from omegaconf import OmegaConf

    from rolemrc.eval.judge import Answer

    class Stub:
        model_id = "stub"
        counts: dict = {}
        asks_again = False

        def sampling(self) -> dict:
            return {"do_sample": False}

        async def answer_all(self, prompts, on_answer=None):
            out = []
            for p in prompts:
                c = p[-1]["content"]
                out.append(Answer("unparseable", text="no idea" if "[[mute]]" in c else "WINNER: 1", attempts=1))
            return out

    class J:
        backend = Stub()

    rows = rolemrc_rows(2)
    items = [parse_test_item(r) for r in rows]
    ids = [item_id(i, it.task, it.question) for i, it in enumerate(items)]
    for name in ("b", "c"):
        with (tmp_path / f"{name}.jsonl").open("w") as f:
            for i, iid in enumerate(ids):
                f.write(json.dumps({"id": iid, "reply": f"{name}-{i}" + (" [[mute]]" if name == "c" and i else "")}) + "\n")
    cfg = OmegaConf.create({"pairwise": {"against": [str(tmp_path / "b.jsonl"), str(tmp_path / "c.jsonl")],
                                         "reply_field": "reply", "template": None, "on_missing": "error"},
                            "judge": {"backend": "hf", "model": "stub", "cache_dir": None}, "out_dir": str(tmp_path)})
    res = pairwise.judge_pairs(cfg.pairwise, Judging(cfg.judge, str(tmp_path / "judge_cache")), J(), items,
                               ["a-0", "a-1"], ids)
    assert list(res["opponents"]) == ["b", "c"] and "missing" not in res
    b, c = res["opponents"]["b"]["overall"], res["opponents"]["c"]["overall"]
    assert (b["n"], b["ties"], b["flips"]) == (2, 2, 2)  # always "1": position bias, ties
    assert (c["n"], c["ties"], c["n_unparseable"]) == (1, 1, 1)
