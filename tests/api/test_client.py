"""rolemrc.api against the fake server (tests/fake_openai.py): what the judge and synthesis rely on."""

from __future__ import annotations

import asyncio
import email.utils
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from rolemrc.api import AnswerCache, ApiClient, Budget, MissingApiKey, Rejected, fault_summary

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _client(server: Any, key_env: str, **kw: Any) -> ApiClient:
    opts = dict(base_url=server.base_url, api_key_env=key_env, timeout_s=5.0, max_attempts=4, backoff_s=0.001,
                max_backoff_s=5.0)
    opts.update(kw)
    return ApiClient("test", **opts)


def _run(make: Any, *bodies: dict[str, Any], check: Any = None) -> tuple[list[Any], ApiClient]:
    async def go() -> tuple[list[Any], ApiClient]:
        c = make()
        try:
            return list(await asyncio.gather(*(c.chat(b, tag=f"r{i}", check=check) for i, b in enumerate(bodies)))), c
        finally:
            await c.close()

    return asyncio.run(go())


@pytest.mark.parametrize("retry_after", ["0.5", "date"])
def test_retry_after_is_honoured(fake_openai: Any, api_key_env: Any, retry_after: str) -> None:
    """A 429's Retry-After (seconds or an HTTP date) sets the wait even when the backoff is tiny."""
    fake_openai.retry_after = email.utils.formatdate(time.time() + 1.5, usegmt=True) if retry_after == "date" else retry_after
    fake_openai.script("rate_limit")
    start = time.monotonic()
    (out,), c = _run(lambda: _client(fake_openai, api_key_env[0]), BODY)
    waited = time.monotonic() - start
    assert out.ok and out.attempts == 2 and c.counts["rate_limited"] == 1 and c.counts["retries"] == 1
    assert waited >= (0.5 if retry_after == "0.5" else 0.4), waited  # an HTTP date has 1 s resolution


def test_backoff_grows_exponentially_with_jitter(fake_openai: Any, api_key_env: Any) -> None:
    fake_openai.retry_after = None
    fake_openai.script("server_error", "server_error", "server_error")
    c = _client(fake_openai, api_key_env[0], backoff_s=0.2, max_backoff_s=0.3)
    waits = [c._wait(type("S", (), {"attempt_number": n, "outcome": None})()) for n in range(1, 200)]
    assert all(0 <= w <= 0.3 for w in waits) and len({round(w, 6) for w in waits}) > 100  # jittered, capped
    start = time.monotonic()
    (out,), c = _run(lambda: _client(fake_openai, api_key_env[0], backoff_s=0.01, max_backoff_s=0.05), BODY)
    assert out.ok and out.attempts == 4 and c.counts["server_error"] == 3 and time.monotonic() - start < 3


def test_concurrency_limit_and_budget_hold_under_load(fake_openai: Any, api_key_env: Any) -> None:
    fake_openai.latency_s = 0.05
    fake_openai.script(*["rate_limit"] * 5)  # retries are charged to the budget too
    bodies = [{**BODY, "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(30)]
    outs, c = _run(lambda: _client(fake_openai, api_key_env[0], concurrency=3, budget=Budget(20)), *bodies)
    assert fake_openai.max_in_flight <= 3
    assert fake_openai.requests == 20 == c.counts["sent"]
    statuses = Counter(o.status for o in outs)
    assert statuses["ok"] == 15 and statuses["budget_exhausted"] == 15
    assert all("request budget reached" in o.error for o in outs if o.status == "budget_exhausted")


def test_rejected_content_is_retried_and_reported(fake_openai: Any, api_key_env: Any) -> None:
    answers = iter(["no number here", "still none", "42"])
    fake_openai._answer = lambda req: next(answers)

    def check(text: str) -> int:
        if not text.strip().isdigit():
            raise Rejected("no_number", f"{text!r} is not a number")
        return int(text)

    (out,), c = _run(lambda: _client(fake_openai, api_key_env[0]), BODY, check=check)
    assert (out.status, out.value, out.attempts, c.counts["rejected"]) == ("ok", 42, 3, 2)
    fake_openai._answer = lambda req: "never"
    (out,), c = _run(lambda: _client(fake_openai, api_key_env[0], max_attempts=2), BODY, check=check)
    assert (out.status, out.kind, out.text, out.attempts) == ("failed", "rejected", "never", 2)
    assert "no_number" in out.error and fault_summary(c.counts) == "rejected 2"


def test_a_wrong_key_stops_the_client_and_the_key_is_never_logged(fake_openai: Any, api_key_env: Any,
                                                                  monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv(api_key_env[0], "sk-wrong-secret-987")
    bodies = [{**BODY, "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(5)]
    outs, c = _run(lambda: _client(fake_openai, api_key_env[0], concurrency=1), *bodies)
    assert fake_openai.unauthorized == 1 and fake_openai.requests == 1  # the 401 is not retried, nothing else sent
    assert all(o.status == "failed" for o in outs) and c.halted and "HTTP 401" in c.halted
    assert "sk-wrong-secret-987" not in caplog.text
    monkeypatch.delenv(api_key_env[0])
    with pytest.raises(MissingApiKey, match=api_key_env[0]):
        _client(fake_openai, api_key_env[0])


def test_cache_serves_only_answers_that_pass_the_check(tmp_path: Path) -> None:
    def valid(text: str) -> None:
        if "VERDICT" not in text:
            raise ValueError("no verdict")

    with AnswerCache(tmp_path / "c.sqlite") as cache:
        cache.put("a", "VERDICT: 1", "m")
        cache.put("b", "", "m")  # as an older version might have stored it
        assert cache.get("a", valid) == "VERDICT: 1" and cache.get("b", valid) is None and cache.get("z", valid) is None
        assert cache.invalid_seen == 1 and len(cache) == 2
    with AnswerCache(tmp_path / "c.sqlite") as cache:  # committed row by row: survives the process
        assert cache.get("a") == "VERDICT: 1"
