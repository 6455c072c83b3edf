"""The OpenAI judge backend against a real loopback HTTP server with scripted faults."""

from __future__ import annotations

import logging

import pytest

from rolemrc.eval.judge import Judge, OpenAIBackend, OpenAIJudgeConfig, aggregate, judge_items, read_verdicts
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
        return "unparseable", None, 1
    attempts = 1 + 2 * ("[[rate2]]" in reply) + ("[[err1]]" in reply) + ("[[slow1]]" in reply)
    return "ok", int("[[good]]" in reply), attempts


def _config(base_url: str, key_env: str, **kw) -> OpenAIJudgeConfig:
    base = dict(
        model="judge-test",
        base_url=base_url,
        api_key_env=key_env,
        concurrency=4,
        timeout_s=0.4,
        max_attempts=MAX_ATTEMPTS,
        backoff_base_s=0.01,
        backoff_max_s=0.05,
    )
    base.update(kw)
    return OpenAIJudgeConfig(**base)


def test_faults_are_retried_counted_and_never_scored_zero(openai_server, judge_key_env, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    base_url, server = openai_server
    test_items, replies = _items(MIXED)
    items = judge_items(test_items, replies)
    assert len(items) == 13  # two tasks map to two dimensions each

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
            assert v.raw and "VERDICT" not in v.raw
    # The server saw exactly the requests the retry policy implies, all authorised.
    assert server.requests == sum(_expected(it.reply)[2] for it in items) == judge.last_stats.requests
    assert server.unauthorized == 0 and server.models == {"judge-test"}
    assert server.max_in_flight <= 4 + 1  # +1: the abandoned slow request still sleeping server-side

    table = aggregate(verdicts)
    assert list(table) == ["KB", "RS", "MT", "NI", "PI"]
    kb, rs, mt, ni, pi = (table[d] for d in ("KB", "RS", "MT", "NI", "PI"))
    assert (kb.n_ok, kb.n_unparseable, kb.n_failed, kb.accuracy) == (3, 0, 0, pytest.approx(2 / 3))
    assert (rs.n_ok, rs.n_unparseable, rs.n_failed, rs.accuracy) == (3, 1, 0, pytest.approx(2 / 3))
    assert (ni.n_ok, ni.n_unparseable, ni.accuracy) == (1, 1, 1.0)  # the garbage one is not a 0
    assert (mt.n_ok, mt.n_failed, mt.accuracy) == (1, 1, 1.0)  # the 503 one is not a 0
    assert (pi.n_ok, pi.n_failed, pi.accuracy) == (1, 1, 1.0)
    assert sum(s.n_total for s in table.values()) == len(items)

    # The key was used (Authorization header) but never logged, cached or reported.
    paths = write_report(tmp_path / "report", verdicts=verdicts)
    secret = judge_key_env[1]
    assert secret not in caplog.text
    assert secret.encode() not in (tmp_path / "cache" / "judge_cache.sqlite").read_bytes()
    assert secret not in paths["judge.jsonl"].read_text() + paths["metrics.json"].read_text()
    assert [v.to_dict() for v in read_verdicts(paths["judge.jsonl"])] == [v.to_dict() for v in verdicts]

    # A rerun answers everything the judge answered from the cache; only failures are re-sent.
    before = server.requests
    again = Judge(OpenAIBackend(_config(base_url, judge_key_env[0])), cache_dir=tmp_path / "cache").judge(items)
    failed = [it for it in items if _expected(it.reply)[0] == "failed"]
    assert server.requests - before == sum(_expected(it.reply)[2] for it in failed)
    for v1, v2 in zip(verdicts, again):
        assert (v2.status, v2.verdict) == (v1.status, v1.verdict)
        assert v2.cached == (v1.status in ("ok", "unparseable"))


def test_rerun_sends_zero_requests(openai_server, judge_key_env, tmp_path):
    base_url, server = openai_server
    answerable = [(t, r) for t, r in MIXED if "[[down]]" not in r and "[[bad400]]" not in r]
    items = judge_items(*_items(answerable))
    cfg = _config(base_url, judge_key_env[0])

    first = Judge(OpenAIBackend(cfg), cache_dir=tmp_path / "c").judge(items)
    assert all(v.status in ("ok", "unparseable") for v in first)
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
    items = judge_items(*_items(MIXED[:1]))
    judge = Judge(OpenAIBackend(_config(base_url, "ROLEMRC_NO_SUCH_KEY")), cache_dir=tmp_path)
    with pytest.raises(RuntimeError, match="ROLEMRC_NO_SUCH_KEY"):
        judge.judge(items)
    assert server.requests == 0
