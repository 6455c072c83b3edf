"""A real OpenAI-compatible chat-completions server on loopback, with scripted faults.

The reply being judged carries markers that pick the server's behaviour for that prompt:

- ``[[good]]``: answers ``VERDICT: 1`` (otherwise ``VERDICT: 0``)
- ``[[rate2]]``: the first 2 requests for the prompt get HTTP 429, then an answer
- ``[[err1]]``: the first request gets HTTP 500, then an answer
- ``[[slow1]]``: the first request sleeps past the client's timeout, then an answer
- ``[[garbage]]``: always answers text without a verdict line
- ``[[down]]``: always HTTP 503
- ``[[bad400]]``: always HTTP 400 (not retryable)
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import pytest

SLOW_S = 1.2  # the client timeout in the tests is well below this


class FakeOpenAI:
    """Request log and behaviour of the fake server (thread-safe)."""

    def __init__(self, api_key: str) -> None:
        self.api_key = api_key
        self.lock = threading.Lock()
        self.requests = 0
        self.per_prompt: Counter[str] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0
        self.unauthorized = 0
        self.models: set[str] = set()

    def decide(self, body: dict[str, Any]) -> tuple[int, str | None, float]:
        """(HTTP status, answer text, seconds to sleep first) for one request."""
        content = body["messages"][-1]["content"]
        key = hashlib.sha256(content.encode()).hexdigest()
        with self.lock:
            self.per_prompt[key] += 1
            n = self.per_prompt[key]
        if "[[down]]" in content:
            return 503, None, 0.0
        if "[[bad400]]" in content:
            return 400, None, 0.0
        if "[[rate2]]" in content and n <= 2:
            return 429, None, 0.0
        if "[[err1]]" in content and n <= 1:
            return 500, None, 0.0
        if "[[garbage]]" in content:
            return 200, "Well, it is hard to say. Probably fine?", 0.0
        verdict = 1 if "[[good]]" in content else 0
        sleep = SLOW_S if ("[[slow1]]" in content and n <= 1) else 0.0
        return 200, f"The reply was checked against the criterion.\nVERDICT: {verdict}", sleep


def _handler(state: FakeOpenAI) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # keep pytest output clean
            pass

        def _send(self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
            data = json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (timeout); that is the point of the slow case

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with state.lock:
                state.requests += 1
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
                state.models.add(body.get("model"))
                if self.headers.get("Authorization") != f"Bearer {state.api_key}":
                    state.unauthorized += 1
            try:
                if not self.path.endswith("/chat/completions"):
                    self._send(404, {"error": {"message": "not found"}})
                    return
                status, text, sleep = state.decide(body)
                time.sleep(sleep or 0.02)  # a little latency so requests overlap
                if status != 200:
                    headers = {"Retry-After": "0"} if status == 429 else None
                    self._send(status, {"error": {"message": f"scripted {status}", "type": "test"}}, headers)
                    return
                self._send(
                    200,
                    {
                        "id": "chatcmpl-test",
                        "object": "chat.completion",
                        "created": 0,
                        "model": body.get("model"),
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": text},
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    },
                )
            finally:
                with state.lock:
                    state.in_flight -= 1

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # don't wait for the abandoned slow handlers at shutdown


@pytest.fixture
def judge_key_env(monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """(env var name, secret) for the judge's API key."""
    name, secret = "ROLEMRC_TEST_JUDGE_KEY", "sk-test-secret-do-not-log-1234"
    monkeypatch.setenv(name, secret)
    return name, secret


@pytest.fixture
def openai_server(judge_key_env: tuple[str, str]) -> Iterator[tuple[str, FakeOpenAI]]:
    """(base_url, state) of a fresh fake server on 127.0.0.1 (random free port)."""
    state = FakeOpenAI(api_key=judge_key_env[1])
    server = _Server(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", state
    finally:
        server.shutdown()
        server.server_close()
