"""The synthesis generator and embedder on rolemrc.api: request cache (valid answers only),
retries on 429 / 5xx / timeouts / connection errors / malformed 200s / content the stage cannot
parse, failures reported per request (never raised mid-stage), the key from the environment."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rolemrc.api import request_key
from rolemrc.errors import MissingAPIKey
from rolemrc.synth.client import (
    Cache,
    ChatRequest,
    ChatResult,
    Generator,
    RemoteEmbedder,
    make_budget,
)
from rolemrc.synth.config import BudgetConfig, EmbedderConfig, GeneratorConfig
from rolemrc.synth.profiles import parse, parser
from rolemrc.synth.records import Reply, wire_schema
from tests.synth.helpers import API_KEY_ENV, SynthServer, bow_vector


def _gen(base_url: str, cache: Path, **kw: Any) -> tuple[GeneratorConfig, BudgetConfig, Cache]:
    kw = {"api_key_env": API_KEY_ENV, "backoff_s": 0.01, "max_retries": 3, "timeout_s": 10, **kw}
    cfg = GeneratorConfig(base_url=base_url, model="fake-gen", **kw)
    return cfg, BudgetConfig(), Cache(cache)


def _req(text: str = "hello", tag: str = "t1") -> ChatRequest:
    return ChatRequest(kind="reply", tag=tag, messages=[{"role": "user", "content": text}], schema_name="role_reply",
                       schema=wire_schema(Reply), placeholder='{"reply": "x"}', check=parser(Reply))


def _chat(cfg: GeneratorConfig, bcfg: BudgetConfig, cache: Cache, reqs: list[ChatRequest], dry_run: bool = False) -> tuple[list[ChatResult], Any, Any]:
    async def go() -> tuple[list[ChatResult], Any, Any]:
        g = Generator(cfg, bcfg, make_budget(bcfg), cache, dry_run=dry_run)
        try:
            return list(await asyncio.gather(*(g.chat(r) for r in reqs))), g.usage, g.halted
        finally:
            await g.close()

    return asyncio.run(go())


def test_cache_makes_the_second_identical_request_free(fake_server: Any, tmp_path: Path) -> None:
    cfg, b, cache = _gen(fake_server.base_url, tmp_path / "c")
    first, u1, _ = _chat(cfg, b, cache, [_req("a"), _req("b")])
    again, u2, _ = _chat(cfg, b, cache, [_req("a"), _req("b")])
    assert [r.text for r in first] == [r.text for r in again] and Reply.model_validate_json(first[0].text).reply
    assert (u1.requests - u1.cached, u2.sent, u2.cached) == (2, 0, 2)
    assert fake_server.total_served() == 2 and len(cache) == 2
    # A different sampling parameter is a different request.
    cfg.temperature = 0.1
    _, u3, _ = _chat(cfg, b, cache, [_req("a")])
    assert u3.cached == 0 and fake_server.total_served() == 3


def test_429_is_retried_with_retry_after(tmp_path: Path) -> None:
    with SynthServer(rate_limit_mod=1) as server:  # every request's first attempt gets a 429
        cfg, b, cache = _gen(server.base_url, tmp_path / "c")
        out, usage, _ = _chat(cfg, b, cache, [_req("x")])
        assert out[0].text and (usage.retries, usage.rate_limited, server.rate_limited) == (1, 1, 1)


def test_malformed_answers_are_asked_again_and_never_cached(fake_openai: Any, api_key_env: Any, tmp_path: Path) -> None:
    """Every kind of unusable 200 (and a 500, a 429) before the good answer: one request, one
    good answer, each fault counted by kind."""
    fake_server = fake_openai
    faults = ("empty_choices", "missing_choices", "truncated", "non_json", "empty_content", "null_content",
              "invalid_content", "server_error", "rate_limit")
    fake_server.script(*faults)
    cfg, b, cache = _gen(fake_server.base_url, tmp_path / "c", max_retries=len(faults), api_key_env=api_key_env[0])
    fake_server._answer = lambda req: json.dumps({"reply": "Ahoy there"})
    (res,), usage, _ = _chat(cfg, b, cache, [_req("x")])
    assert res.text == '{"reply": "Ahoy there"}' and res.attempts == len(faults) + 1
    assert usage.faults == {"empty_choices": 2, "malformed_body": 2, "empty_content": 2, "rejected": 1,
                            "server_error": 1, "rate_limited": 1}
    assert fake_server.requests == len(faults) + 1 and len(cache) == 1


def test_a_request_that_keeps_failing_is_reported_not_raised(fake_openai: Any, api_key_env: Any, tmp_path: Path) -> None:
    fake_server = fake_openai
    fake_server._answer = lambda req: "this is not JSON" if "bad" in req.last_content else json.dumps({"reply": "ok"})
    cfg, b, cache = _gen(fake_server.base_url, tmp_path / "c", max_retries=2, api_key_env=api_key_env[0])
    out, usage, halted = _chat(cfg, b, cache, [_req("bad", tag="r-bad"), _req("good", tag="r-good")])
    assert (out[0].tag, out[0].text, out[0].kind, out[0].attempts) == ("r-bad", None, "rejected", 3)
    assert "json" in (out[0].error or "")
    assert out[1].text == '{"reply": "ok"}' and halted is None
    assert usage.failed == 1 and usage.faults == {"rejected": 3} and len(cache) == 1  # the failure is not cached


def test_connection_errors_are_retried_then_reported(tmp_path: Path) -> None:
    cfg, b, cache = _gen("http://127.0.0.1:9/v1", tmp_path / "c")  # discard port: refused
    (res,), usage, _ = _chat(cfg, b, cache, [_req()])
    assert (res.text, res.kind, res.attempts) == (None, "connection", 4)
    assert usage.faults == {"connection": 4} and len(cache) == 0


def test_auth_errors_are_not_retried_and_stop_later_requests(fake_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "wrong")
    cfg, b, cache = _gen(fake_server.base_url, tmp_path / "c", concurrency=1)
    out, _, halted = _chat(cfg, b, cache, [_req(str(i)) for i in range(20)])
    assert halted and "HTTP 401" in halted and all(r.text is None for r in out)
    assert fake_server.unauthorized == 1  # the other 19 were not sent


def test_key_comes_from_the_environment_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLEMRC_UNSET_KEY", raising=False)
    cfg, b, cache = _gen("http://127.0.0.1:9/v1", tmp_path / "c")
    cfg.api_key_env = "ROLEMRC_UNSET_KEY"
    with pytest.raises(MissingAPIKey, match="environment variable ROLEMRC_UNSET_KEY, which is not set"):
        _chat(cfg, b, cache, [_req()])


def test_dry_run_answers_with_placeholders_and_estimates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)  # a dry run needs no key
    cfg, b, cache = _gen("http://127.0.0.1:9/v1", tmp_path / "c")
    out, usage, _ = _chat(cfg, b, cache, [_req("x" * 400)], dry_run=True)
    assert [r.text for r in out] == ['{"reply": "x"}']
    assert usage.requests == 1 and usage.sent == 0 and usage.est_prompt_tokens >= 100
    assert usage.est_completion_tokens == BudgetConfig().completion_tokens["reply"]


def test_schema_in_prompt_when_the_server_has_no_structured_output(fake_server: Any, tmp_path: Path) -> None:
    cfg, b, cache = _gen(fake_server.base_url, tmp_path / "c", structured_output="none")
    body = Generator(cfg, b, make_budget(b), cache, dry_run=True).payload(_req("hi"))
    assert "response_format" not in body
    assert body["messages"][-1]["content"].startswith("hi\n\n") and '"reply"' in body["messages"][-1]["content"]
    obj, reason, _ = parse(Reply, 'Sure!\n```json\n{"reply": "Ahoy there"}\n```')
    assert obj is not None and obj.reply == "Ahoy there" and reason == ""
    assert parse(Reply, '{"reply": ')[1] == "json"
    assert parse(Reply, '{"answer": "x"}')[1] == "schema"


def test_invalid_answers_in_an_older_cache_are_not_served(fake_server: Any, tmp_path: Path) -> None:
    """The JSON-file cache of earlier versions is still read, through the same check: a cached
    empty or unparseable answer is asked again, a valid one is served."""
    cfg, b, cache = _gen(fake_server.base_url, tmp_path / "c")
    g = Generator(cfg, b, make_budget(b), cache, dry_run=True)
    for text, content in (("empty", ""), ("cut", '{"reply": "Ah'), ("fine", '{"reply": "From the old cache"}')):
        key = request_key({"endpoint": "chat.completions", **g.payload(_req(text))})
        path = tmp_path / "c" / key[:2] / f"{key}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"content": content, "tag": "t1"}))
    cache = Cache(tmp_path / "c")  # a run started on the older run's cache folder
    out, usage, _ = _chat(cfg, b, cache, [_req("empty"), _req("cut"), _req("fine")])
    assert usage.cached == 1 and fake_server.total_served() == 2
    assert out[2].text == '{"reply": "From the old cache"}' and all(Reply.model_validate_json(r.text) for r in out)


def test_remote_embeddings_are_batched_cached_and_normalised(fake_server: Any, tmp_path: Path) -> None:
    cfg = EmbedderConfig(backend="openai", model="fake-embed", base_url=fake_server.base_url, api_key_env=API_KEY_ENV, batch_size=2, backoff_s=0.01)
    texts = ["bread dough rises", "galaxy spiral arms", "coral reef bleaching"]
    b = BudgetConfig()
    fake_server.script("empty_choices", "truncated")  # malformed 200s are asked again here too

    async def go() -> np.ndarray:
        e = RemoteEmbedder(cfg, b, make_budget(b), Cache(tmp_path / "c"))
        try:
            return await e.embed(texts, is_query=True, tag="t")
        finally:
            await e.close()

    a = asyncio.run(go())
    assert a.shape == (3, 64) and fake_server.total_served() == 2  # two batches
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, rtol=1e-6)
    want = np.asarray(bow_vector(texts[1], 64))
    np.testing.assert_allclose(a[1], want / np.linalg.norm(want), rtol=1e-5)
    np.testing.assert_array_equal(asyncio.run(go()), a)
    assert fake_server.total_served() == 2


def test_timeouts_are_retried_then_reported(tmp_path: Path) -> None:
    with SynthServer(latency_s=1.0, rate_limit_mod=10**9) as server:
        cfg, b, cache = _gen(server.base_url, tmp_path / "c")
        cfg.timeout_s, cfg.max_retries = 0.2, 1
        (res,), usage, _ = _chat(cfg, b, cache, [_req()])
        assert (res.text, res.kind, res.attempts) == (None, "timeout", 2) and usage.faults == {"timeout": 2}
