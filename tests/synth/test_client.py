"""The async client: request cache, retries on 429 / connection errors, errors that name the request."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rolemrc.synth.client import (
    Budget,
    Cache,
    ChatRequest,
    Generator,
    RemoteEmbedder,
    gather_all,
)
from rolemrc.synth.config import BudgetConfig, EmbedderConfig, GeneratorConfig
from rolemrc.synth.profiles import parse
from rolemrc.synth.records import Reply, wire_schema
from tests.synth.helpers import API_KEY_ENV, bow_vector


def _gen(base_url: str, cache: Path, **kw: Any) -> tuple[GeneratorConfig, BudgetConfig, Cache]:
    cfg = GeneratorConfig(base_url=base_url, model="fake-gen", api_key_env=API_KEY_ENV, backoff_s=0.01, max_retries=3, timeout_s=10, **kw)
    return cfg, BudgetConfig(), Cache(cache)


def _req(text: str = "hello") -> ChatRequest:
    return ChatRequest(kind="reply", tag="t1", messages=[{"role": "user", "content": text}], schema_name="role_reply", schema=wire_schema(Reply), placeholder='{"reply": "x"}')


def _chat(cfg: GeneratorConfig, bcfg: BudgetConfig, cache: Cache, reqs: list[ChatRequest], dry_run: bool = False) -> tuple[list[str], Any]:
    async def go() -> tuple[list[str], Any]:
        g = Generator(cfg, bcfg, Budget(bcfg), cache, dry_run=dry_run)
        try:
            return await gather_all([g.chat(r) for r in reqs]), g.usage
        finally:
            await g.close()

    return asyncio.run(go())


def test_cache_makes_the_second_identical_request_free(fake_server: Any, tmp_path: Path) -> None:
    cfg, b, cache = _gen(fake_server.base_url, tmp_path / "c")
    first, u1 = _chat(cfg, b, cache, [_req("a"), _req("b")])
    again, u2 = _chat(cfg, b, cache, [_req("a"), _req("b")])
    assert first == again and Reply.model_validate_json(first[0]).reply
    assert (u1.sent, u2.sent, u2.cached) == (2, 0, 2)
    assert fake_server.total_served() == 2 and len(cache) == 2
    # A different sampling parameter is a different request.
    cfg.temperature = 0.1
    _, u3 = _chat(cfg, b, cache, [_req("a")])
    assert u3.sent == 1


def test_429_is_retried_with_retry_after(tmp_path: Path) -> None:
    from tests.synth.helpers import FakeOpenAI

    with FakeOpenAI(rate_limit_mod=1) as server:  # every request's first attempt gets a 429
        cfg, b, cache = _gen(server.base_url, tmp_path / "c")
        out, usage = _chat(cfg, b, cache, [_req("x")])
        assert out and (usage.retries, usage.rate_limited, server.rate_limited) == (1, 1, 1)


def test_connection_errors_are_retried_then_raised_with_context(tmp_path: Path) -> None:
    cfg, b, cache = _gen("http://127.0.0.1:9/v1", tmp_path / "c")  # discard port: refused
    with pytest.raises(RuntimeError, match=r"generator request t1 failed after 4 attempt\(s\)"):
        _chat(cfg, b, cache, [_req()])
    assert len(cache) == 0


def test_auth_errors_are_not_retried(fake_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "wrong")
    cfg, b, cache = _gen(fake_server.base_url, tmp_path / "c")
    with pytest.raises(RuntimeError, match=r"failed after 1 attempt\(s\).*AuthenticationError"):
        _chat(cfg, b, cache, [_req()])
    assert fake_server.unauthorized == 1


def test_key_comes_from_the_environment_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLEMRC_UNSET_KEY", raising=False)
    cfg, b, cache = _gen("http://127.0.0.1:9/v1", tmp_path / "c")
    cfg.api_key_env = "ROLEMRC_UNSET_KEY"
    with pytest.raises(RuntimeError, match="environment variable ROLEMRC_UNSET_KEY is not set"):
        _chat(cfg, b, cache, [_req()])


def test_dry_run_answers_with_placeholders_and_estimates(tmp_path: Path) -> None:
    cfg, b, cache = _gen("http://127.0.0.1:9/v1", tmp_path / "c")
    out, usage = _chat(cfg, b, cache, [_req("x" * 400)], dry_run=True)
    assert out == ['{"reply": "x"}']
    assert usage.requests == 1 and usage.sent == 0 and usage.est_prompt_tokens >= 100
    assert usage.est_completion_tokens == BudgetConfig().completion_tokens["reply"]


def test_schema_in_prompt_when_the_server_has_no_structured_output(fake_server: Any, tmp_path: Path) -> None:
    cfg, b, cache = _gen(fake_server.base_url, tmp_path / "c", structured_output="none")
    body = Generator(cfg, b, Budget(b), cache).payload(_req("hi"))
    assert "response_format" not in body
    assert body["messages"][-1]["content"].startswith("hi\n\n") and '"reply"' in body["messages"][-1]["content"]
    obj, reason, _ = parse(Reply, 'Sure!\n```json\n{"reply": "Ahoy there"}\n```')
    assert obj is not None and obj.reply == "Ahoy there" and reason == ""
    assert parse(Reply, '{"reply": ')[1] == "json"
    assert parse(Reply, '{"answer": "x"}')[1] == "schema"


def test_remote_embeddings_are_batched_cached_and_normalised(fake_server: Any, tmp_path: Path) -> None:
    cfg = EmbedderConfig(backend="openai", model="fake-embed", base_url=fake_server.base_url, api_key_env=API_KEY_ENV, batch_size=2, backoff_s=0.01)
    texts = ["bread dough rises", "galaxy spiral arms", "coral reef bleaching"]
    b = BudgetConfig()

    async def go() -> np.ndarray:
        e = RemoteEmbedder(cfg, b, Budget(b), Cache(tmp_path / "c"))
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


def test_timeouts_are_retried_then_raised(tmp_path: Path) -> None:
    from tests.synth.helpers import FakeOpenAI

    with FakeOpenAI(delay_s=1.0, rate_limit_mod=10**9) as server:
        cfg, b, cache = _gen(server.base_url, tmp_path / "c")
        cfg.timeout_s, cfg.max_retries = 0.2, 1
        with pytest.raises(RuntimeError, match=r"failed after 2 attempt\(s\).*APITimeoutError"):
            _chat(cfg, b, cache, [_req()])


def test_after_a_fatal_error_queued_requests_are_not_sent(fake_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "wrong")
    cfg, b, cache = _gen(fake_server.base_url, tmp_path / "c", concurrency=1)
    with pytest.raises(RuntimeError, match="AuthenticationError"):
        _chat(cfg, b, cache, [_req(str(i)) for i in range(20)])
    assert fake_server.unauthorized == 1
