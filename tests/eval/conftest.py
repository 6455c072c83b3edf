"""The judge's server in the tests: the shared fake (``tests/fake_openai.py``) with scripted faults.

The reply being judged carries markers that pick the server's behaviour for that prompt
(``attempt`` counts the requests for the same prompt):

- ``[[good]]``: answers ``VERDICT: 1`` (otherwise ``VERDICT: 0``)
- ``[[rate2]]``: the first 2 requests get HTTP 429 (``Retry-After: 0``), then an answer
- ``[[err1]]``: the first request gets HTTP 500, then an answer
- ``[[slow1]]``: the first request answers after the client's timeout, then an answer
- ``[[empty1]]`` / ``[[trunc1]]`` / ``[[nonjson1]]`` / ``[[blank1]]``: the first request gets a 200
  with empty ``choices`` / a truncated JSON body / an HTML body / empty content
- ``[[garbage1]]``: the first answer has no verdict line, then a good one
- ``[[garbage]]``: always answers text without a verdict line
- ``[[down]]``: always HTTP 503
- ``[[bad400]]``: always HTTP 400 (not retried)
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.fake_openai import FakeOpenAI, Request

SLOW_S = 8.0  # the client timeout in the tests (2.5 s) is well below this, and well above a loaded CI machine's latency

_FIRST = {"[[err1]]": "server_error", "[[slow1]]": "slow", "[[empty1]]": "empty_choices", "[[trunc1]]": "truncated",
          "[[nonjson1]]": "non_json", "[[blank1]]": "empty_content"}


class JudgeServer(FakeOpenAI):
    """Faults and verdicts picked by the markers in the judged reply."""

    def fault(self, req: Request) -> str | None:
        content, n = req.last_content, req.attempt
        if "[[down]]" in content:
            return "unavailable"
        if "[[bad400]]" in content:
            return "bad_request"
        if "[[rate2]]" in content and n <= 2:
            return "rate_limit"
        for marker, fault in _FIRST.items():
            if marker in content and n <= 1:
                return fault
        return super().fault(req)  # the `faults=` function, if any

    def chat_content(self, req: Request) -> str:
        content = req.last_content
        if "[[garbage]]" in content or ("[[garbage1]]" in content and req.attempt <= 1):
            return "Well, it is hard to say. Probably fine?"
        verdict = 1 if "[[good]]" in content else 0
        return f"The reply was checked against the criterion.\nVERDICT: {verdict}"


@pytest.fixture
def judge_key_env(api_key_env: tuple[str, str]) -> tuple[str, str]:
    """(env var name, secret) for the judge's API key (the shared ``api_key_env``)."""
    return api_key_env


@pytest.fixture
def judge_server(judge_key_env: tuple[str, str]) -> Iterator[JudgeServer]:
    with JudgeServer(api_key=judge_key_env[1], slow_s=SLOW_S, latency_s=0.02) as server:
        yield server


@pytest.fixture
def openai_server(judge_server: JudgeServer) -> tuple[str, JudgeServer]:
    """(base_url, server) of a fresh judge server on 127.0.0.1 (random free port)."""
    return judge_server.base_url, judge_server


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Generation-heavy tests on one torch thread (the 2-core machines run other processes)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
