"""The OpenAI judge backend (``rolemrc.api.ApiClient``) against the fake loopback server with
scripted faults: HTTP errors, timeouts and malformed 200s are retried; only verdicts are cached."""

from __future__ import annotations

import json
import logging
import sqlite3

import pytest

from rolemrc.config import JudgeConfig
from rolemrc.eval.judge import (
    CACHE_FILE,
    Judge,
    OpenAIBackend,
    Verdict,
    aggregate,
    cache_key,
    judge_items,
    judge_messages,
)
from rolemrc.eval.report import write_report

SYSTEM = "You are Captain Mora, a gruff sea captain who says 'Arr' a lot. Passage: The ship sailed in 1820."

# (task, reply). Markers pick the fake server's behaviour (see conftest.py).
MIXED = [
    ("role_related_mrc_answer_with_narration", "(grins) Arr, 1820 it was. [[good]]"),  # KB + RS
    ("role_related_mrc_answer_no_narration", "It sailed in 1920."),  # KB, verdict 0
    ("role_unrelated_mrc_refused_no_narration", "Arr, not my waters. [[good]] [[rate2]]"),  # KB + RS
    ("role_related_mrc_refused_no_narration", "Hello there. [[err1]]"),  # RS, verdict 0
    ("role_related_mrc_answer_with_narration-special-content", "🌊 ARR 1820. [[good]] [[slow1]]"),  # NI
    ("role_related_mrc_answer_with_narration-special-format", "whatever [[garbage]]"),  # NI
    ("role_related_mrc_refused_with_narration-2ndrefused", "Still cannot say. [[good]]"),  # MT
    ("role_unrelated_mrc_refused_no_narration-2ndanswer", "Fine: Paris. [[down]]"),  # MT
    ("role_related_mrc_answer_with_narration-refused", "Here you go. [[bad400]]"),  # PI
    ("role_related_mrc_answer_no_narration-refused", "I must not say. [[good]]"),  # PI
    ("role_unrelated_mrc_answer_no_narration", "Hmm [[garbage]]"),  # RS
    # Malformed 200s on the first attempt: retried like any fault, never cached as an answer.
    ("role_related_mrc_answer_no_narration", "Arr. [[good]] [[empty1]]"),  # KB: empty choices
    ("role_related_mrc_answer_no_narration", "Arr! [[good]] [[trunc1]]"),  # KB: truncated JSON
    ("role_related_mrc_answer_no_narration", "Arr? [[good]] [[nonjson1]]"),  # KB: HTML body
    ("role_related_mrc_answer_no_narration", "Arr... [[good]] [[blank1]]"),  # KB: empty content
    ("role_related_mrc_answer_no_narration", "Arr; [[good]] [[garbage1]]"),  # KB: no verdict line
]
MAX_ATTEMPTS = 4


def _items(spec: list[tuple[str, str]]) -> tuple[list[dict], list[str]]:
    test_items = [
        {
            "task": task,
            "question": [{"role": "System", "content": SYSTEM}, {"role": "User", "content": f"Question {i}?"}],
            "reference": "Arr, 1820.",
        }
        for i, (task, _) in enumerate(spec)
    ]
    return test_items, [reply for _, reply in spec]


def _expected(reply: str) -> tuple[str, int | None, int]:
    """(status, verdict, attempts) the scripted server should produce for a reply."""
    if "[[down]]" in reply:
        return "failed", None, MAX_ATTEMPTS
    if "[[bad400]]" in reply:
        return "failed", None, 1
    if "[[garbage]]" in reply:
        return "unparseable", None, MAX_ATTEMPTS  # asked again, in vain
    once = ("[[err1]]", "[[slow1]]", "[[empty1]]", "[[trunc1]]", "[[nonjson1]]", "[[blank1]]", "[[garbage1]]")
    attempts = 1 + 2 * ("[[rate2]]" in reply) + sum(m in reply for m in once)
    return "ok", int("[[good]]" in reply), attempts


def _config(base_url: str, key_env: str, **kw) -> JudgeConfig:
    base = dict(
        backend="openai",
        model="judge-test",
        base_url=base_url,
        api_key_env=key_env,
        concurrency=4,
        timeout_s=2.5,  # far above a normal answer on a loaded 2-core CI machine (0.4 s timed one out there)
        max_attempts=MAX_ATTEMPTS,
        backoff_s=0.01,
        max_backoff_s=0.05,
    )
    base.update(kw)
    return JudgeConfig(**base)


def test_faults_are_retried_counted_and_never_scored_zero(openai_server, judge_key_env, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    base_url, server = openai_server
    test_items, replies = _items(MIXED)
    items = judge_items(test_items, replies)
    assert len(items) == 18  # two tasks map to two dimensions each

    judge = Judge(OpenAIBackend(_config(base_url, judge_key_env[0])), cache_dir=tmp_path / "cache")
    verdicts = judge.judge(items)

    # Every judgement comes back, in order, with the status and verdict the server scripted.
    assert [(v.item_id, v.dimension) for v in verdicts] == [(it.item_id, it.dimension.short) for it in items]
    for it, v in zip(items, verdicts):
        status, verdict, attempts = _expected(it.reply)
        assert (v.status, v.verdict, v.attempts) == (status, verdict, attempts), it.reply
        if status != "ok":
            assert v.verdict is None  # a failure is never a 0
        if status == "unparseable":
            assert v.raw and "VERDICT" not in v.raw and v.error and "no_verdict" in v.error
    # The server saw exactly the requests the retry policy implies, all authorised.
    assert server.requests == sum(_expected(it.reply)[2] for it in items) == judge.last_stats.requests
    assert server.unauthorized == 0 and server.models == {"judge-test"}
    assert server.max_in_flight <= 4 + 1  # +1: the abandoned slow request still sleeping server-side

    table = aggregate(verdicts)
    assert list(table) == ["KB", "RS", "MT", "NI", "PI"]
    kb, rs, mt, ni, pi = (table[d] for d in ("KB", "RS", "MT", "NI", "PI"))
    assert (kb.n_ok, kb.n_unparseable, kb.n_failed, kb.accuracy) == (8, 0, 0, pytest.approx(7 / 8))
    assert (rs.n_ok, rs.n_unparseable, rs.n_failed, rs.accuracy) == (3, 1, 0, pytest.approx(2 / 3))
    assert (ni.n_ok, ni.n_unparseable, ni.accuracy) == (1, 1, 1.0)  # the garbage one is not a 0
    assert (mt.n_ok, mt.n_failed, mt.accuracy) == (1, 1, 1.0)  # the 503 one is not a 0
    assert (pi.n_ok, pi.n_failed, pi.accuracy) == (1, 1, 1.0)
    assert sum(s.n_total for s in table.values()) == len(items)
    # Every fault kind the server produced was counted by the client.
    faults = judge.last_stats.faults
    assert faults["empty_choices"] == 1 and faults["malformed_body"] == 2 and faults["empty_content"] == 1
    assert faults["rejected"] == 1 + MAX_ATTEMPTS * 2  # garbage1 once; the two [[garbage]] prompts every time
    assert faults["rate_limited"] == server.fault_counts["rate_limit"] == 4
    assert faults["server_error"] == server.fault_counts["server_error"] + server.fault_counts["unavailable"]
    assert faults["timeout"] == 1 and faults["http_error"] == 1

    # The key was used (Authorization header) but never logged, cached or reported.
    paths = write_report(tmp_path / "report", verdicts=verdicts)
    secret = judge_key_env[1]
    assert secret not in caplog.text
    assert secret.encode() not in (tmp_path / "cache" / "judge_cache.sqlite").read_bytes()
    assert secret not in paths["judge.jsonl"].read_text() + paths["metrics.json"].read_text()
    assert [Verdict(**json.loads(ln)).to_dict() for ln in paths["judge.jsonl"].read_text().splitlines()] == [v.to_dict() for v in verdicts]

    # Only answers with a verdict were cached: a rerun re-sends failures and unparseable ones.
    before = server.requests
    again = Judge(OpenAIBackend(_config(base_url, judge_key_env[0])), cache_dir=tmp_path / "cache").judge(items)
    missing = [it for it in items if _expected(it.reply)[0] != "ok"]
    assert server.requests - before == sum(_expected(it.reply)[2] for it in missing)
    for v1, v2 in zip(verdicts, again):
        assert (v2.status, v2.verdict) == (v1.status, v1.verdict)
        assert v2.cached == (v1.status == "ok")


def test_rerun_sends_zero_requests(openai_server, judge_key_env, tmp_path):
    base_url, server = openai_server
    answerable = [(t, r) for t, r in MIXED if not any(m in r for m in ("[[down]]", "[[bad400]]", "[[garbage]]"))]
    items = judge_items(*_items(answerable))
    cfg = _config(base_url, judge_key_env[0])

    first = Judge(OpenAIBackend(cfg), cache_dir=tmp_path / "c").judge(items)
    assert all(v.status == "ok" for v in first)  # every malformed answer was asked again
    sent = server.requests
    assert sent > len(items)  # retries happened

    judge = Judge(OpenAIBackend(cfg), cache_dir=tmp_path / "c")
    second = judge.judge(items)
    assert server.requests == sent  # zero new requests
    assert judge.last_stats.cache_hits == len(items) and judge.last_stats.requests == 0
    assert all(v.cached and v.attempts == 0 for v in second)
    assert [(v.status, v.verdict, v.raw) for v in second] == [(v.status, v.verdict, v.raw) for v in first]

    # A different judge model or sampling setting is a different cache entry.
    Judge(OpenAIBackend(_config(base_url, judge_key_env[0], temperature=0.7)), cache_dir=tmp_path / "c").judge(
        items[:1]
    )
    assert server.requests == sent + 1


def test_budget_is_respected(openai_server, judge_key_env, tmp_path):
    base_url, server = openai_server
    spec = [("role_related_mrc_answer_no_narration", f"Answer {i} [[good]]") for i in range(10)]
    items = judge_items(*_items(spec))
    cfg = _config(base_url, judge_key_env[0], concurrency=2, max_requests=4)

    verdicts = Judge(OpenAIBackend(cfg), cache_dir=tmp_path / "c").judge(items)
    assert server.requests == 4
    assert server.max_in_flight <= 2
    assert sum(v.status == "ok" for v in verdicts) == 4
    unsent = [v for v in verdicts if v.status == "budget_exhausted"]
    assert len(unsent) == 6 and all(v.verdict is None and v.attempts == 0 for v in unsent)
    kb = aggregate(verdicts)["KB"]
    assert (kb.n_ok, kb.n_budget_exhausted, kb.accuracy) == (4, 6, 1.0)

    # Next run with budget 6: the 4 answered come from the cache, the other 6 are sent.
    cfg2 = _config(base_url, judge_key_env[0], concurrency=2, max_requests=6)
    verdicts = Judge(OpenAIBackend(cfg2), cache_dir=tmp_path / "c").judge(items)
    assert server.requests == 10 and all(v.status == "ok" for v in verdicts)


def test_budget_counts_retries(openai_server, judge_key_env, tmp_path):
    base_url, server = openai_server
    items = judge_items(*_items([("role_related_mrc_answer_no_narration", "[[rate2]] [[good]]")]))
    cfg = _config(base_url, judge_key_env[0], max_requests=2)
    (v,) = Judge(OpenAIBackend(cfg), cache_dir=None).judge(items)
    assert server.requests == 2
    assert (v.status, v.attempts, v.verdict) == ("budget_exhausted", 2, None)
    assert "429" in (v.error or "")


def test_missing_key_is_a_clear_error(openai_server, monkeypatch, tmp_path):
    base_url, server = openai_server
    monkeypatch.delenv("ROLEMRC_NO_SUCH_KEY", raising=False)
    with pytest.raises(RuntimeError, match="ROLEMRC_NO_SUCH_KEY"):  # when the backend is made
        OpenAIBackend(_config(base_url, "ROLEMRC_NO_SUCH_KEY"))
    assert server.requests == 0


def test_invalid_answers_an_older_version_cached_are_not_served(openai_server, judge_key_env, tmp_path):
    """An existing judge_cache.sqlite (same layout as before) holding an empty answer and one
    without a verdict line: both are asked again and replaced; the valid entry is served."""
    base_url, server = openai_server
    spec = [("role_related_mrc_answer_no_narration", f"Answer {i} [[good]]") for i in range(3)]
    items = judge_items(*_items(spec))
    cfg = _config(base_url, judge_key_env[0])
    backend = OpenAIBackend(cfg)
    keys = [cache_key(cfg.model, judge_messages(it), backend.sampling()) for it in items]
    (tmp_path / "c").mkdir()
    db = sqlite3.connect(tmp_path / "c" / CACHE_FILE)
    db.execute("CREATE TABLE answers (key TEXT PRIMARY KEY, model TEXT, text TEXT, created REAL)")
    db.executemany("INSERT INTO answers VALUES (?, ?, ?, 0)", [
        (keys[0], cfg.model, ""),  # an empty 200, cached as an answer by the old judge
        (keys[1], cfg.model, "I think it is fine."),  # an answer without a verdict
        (keys[2], cfg.model, "Checked.\nVERDICT: 0"),  # a valid answer: served as it is
    ])
    db.commit()
    db.close()
    judge = Judge(backend, cache_dir=tmp_path / "c")
    verdicts = judge.judge(items)
    assert server.requests == 2 and judge.last_stats.cache_hits == 1
    assert [(v.status, v.verdict, v.cached) for v in verdicts] == [("ok", 1, False), ("ok", 1, False), ("ok", 0, True)]
    judge.close()
    again = Judge(OpenAIBackend(cfg), cache_dir=tmp_path / "c").judge(items)
    assert server.requests == 2 and [v.verdict for v in again] == [1, 1, 0]
