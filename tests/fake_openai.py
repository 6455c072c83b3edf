"""A fake OpenAI-compatible server for the tests: real HTTP on 127.0.0.1, faults on demand.

It speaks ``POST /v1/chat/completions`` and ``POST /v1/embeddings`` (any prefix), checks the
``Authorization: Bearer <key>`` header when given a key, and counts everything server side.
What a request gets is decided per request:

- ``script(*faults)``: the next requests take these faults in order (FIFO);
- ``faults(req)``: a function of the request (``Request``: body, key, attempt number, index)
  returning a fault name or None; subclasses may override ``fault``;
- ``answer(req)``: the chat content of a good answer (default ``"ok"``); subclasses may
  override ``chat_content``.

Faults (``FAULTS``): ``empty_choices`` (``"choices": []``), ``missing_choices`` (no key),
``truncated`` (a 200 whose JSON body is cut in half), ``non_json`` (a 200 with an HTML body),
``empty_content`` (``""``), ``null_content`` (``null``), ``invalid_content`` (a well-formed 200
whose content the caller cannot parse: ``bad_content(req, content)``, by default the content cut
in half), ``rate_limit`` (429 with
``Retry-After``), ``server_error`` (500), ``unavailable`` (503), ``bad_request`` (400),
``slow`` (answers after ``slow_s``, past the client's timeout), ``drop`` (closes the connection
without an answer). ``down = True`` drops every request; ``hold(n)`` parks requests once
``n`` good answers were served (so a test can kill a client at a known point) until
``release()``, which answers them 503.

Counters: ``requests`` (every request that reached the handler), ``fault_counts[name]``,
``attempts[key]`` (requests per distinct body), ``served[key]`` (good 200 answers per body),
``in_flight`` / ``max_in_flight``, ``unauthorized``, ``models``.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

FAULTS = (
    "empty_choices", "missing_choices", "truncated", "non_json", "empty_content", "null_content",
    "invalid_content", "rate_limit", "server_error", "unavailable", "bad_request", "slow", "drop",
)


def canon(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class Request:
    index: int  # 1-based, over the server's life
    path: str
    body: dict[str, Any]
    key: str  # hash of path + body: identical requests share it
    attempt: int  # 1-based: how many requests with this key arrived so far, this one included

    @property
    def last_content(self) -> str:
        msgs = self.body.get("messages") or [{}]
        return str(msgs[-1].get("content", ""))


def bow_vector(text: str, dim: int) -> list[float]:
    """Hashed bag of words: texts sharing words point the same way (so matching means something)."""
    v = [0.0] * dim
    for w in re.findall(r"[a-z]+", text.lower()):
        if len(w) > 3:
            v[int(hashlib.md5(w.encode()).hexdigest(), 16) % dim] += 1.0
    v[0] += 0.1  # never the zero vector
    return v


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # don't wait for abandoned slow handlers at shutdown

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that gave up (timeout, killed on purpose) leaves broken pipes behind.
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return
        super().handle_error(request, client_address)


class FakeOpenAI:
    """The server and its counters (thread-safe). Use as a context manager or start()/stop()."""

    def __init__(self, api_key: str | None = None, *, answer: Callable[[Request], str] | None = None,
                 faults: Callable[[Request], str | None] | None = None, slow_s: float = 1.0,
                 retry_after: str | None = "0", latency_s: float = 0.0, dim: int = 64) -> None:
        self.api_key = api_key
        self._answer = answer
        self._faults = faults
        self.slow_s = slow_s
        self.retry_after = retry_after
        self.latency_s = latency_s
        self.dim = dim
        self.down = False
        self.lock = threading.Lock()
        self._script: deque[str | None] = deque()
        self.requests = 0
        self.fault_counts: Counter[str] = Counter()
        self.attempts: Counter[str] = Counter()
        self.served: Counter[str] = Counter()
        self.in_flight = 0
        self.max_in_flight = 0
        self.unauthorized = 0
        self.models: set[str] = set()
        self.hold_after: int | None = None
        self.parked = 0
        self._gate = threading.Event()
        self.httpd: _Server | None = None

    # ------------------------------------------------------------- lifecycle
    def start(self) -> "FakeOpenAI":
        self.httpd = _Server(("127.0.0.1", 0), self._handler())
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.httpd is not None:
            self._gate.set()
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None

    def __enter__(self) -> "FakeOpenAI":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        assert self.httpd is not None, "server not started"
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    # ------------------------------------------------------------- control
    def script(self, *faults: str | None) -> None:
        """The next ``len(faults)`` requests take these faults in order (None: a good answer)."""
        unknown = [f for f in faults if f is not None and f not in FAULTS]
        assert not unknown, f"unknown faults {unknown}; known: {FAULTS}"
        with self.lock:
            self._script.extend(faults)

    def hold(self, after: int) -> None:
        self._gate.clear()
        self.hold_after = after

    def release(self) -> None:
        """Answer the parked requests 503; returns once none is parked any more."""
        self.hold_after = None
        self._gate.set()
        deadline = time.monotonic() + 10
        while self.parked and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not self.parked, "parked requests did not leave"

    def total_served(self) -> int:
        with self.lock:
            return sum(self.served.values())

    def repeated(self) -> dict[str, int]:
        """Bodies answered (200, good) more than once."""
        with self.lock:
            return {k: v for k, v in self.served.items() if v > 1}

    def reset_counts(self) -> None:
        with self.lock:
            self.served.clear()

    # ------------------------------------------------------------- behaviour (override in tests)
    def fault(self, req: Request) -> str | None:
        return self._faults(req) if self._faults is not None else None

    def chat_content(self, req: Request) -> str:
        return self._answer(req) if self._answer is not None else "ok"

    def bad_content(self, req: Request, content: str) -> str:
        """The content sent for an ``invalid_content`` fault."""
        return content[: len(content) // 2]

    def embeddings(self, req: Request) -> dict[str, Any]:
        texts = req.body["input"]
        texts = [texts] if isinstance(texts, str) else texts
        n = sum(len(t) // 4 for t in texts)
        return {
            "object": "list", "model": req.body.get("model"),
            "data": [{"object": "embedding", "index": i, "embedding": bow_vector(t, self.dim)} for i, t in enumerate(texts)],
            "usage": {"prompt_tokens": n, "total_tokens": n},
        }

    def chat(self, req: Request, content: str | None) -> dict[str, Any]:
        ntok = max(1, len(canon(req.body.get("messages", []))) // 4)
        ctok = len(content or "") // 4 + 1
        return {
            "id": "chatcmpl-" + req.key[:12], "object": "chat.completion", "created": 0, "model": req.body.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": ntok, "completion_tokens": ctok, "total_tokens": ntok + ctok},
        }

    # ------------------------------------------------------------- protocol
    def _decide(self, path: str, auth: str, raw: bytes) -> tuple[int, bytes | None, dict[str, str], float, str | None]:
        """(status, body or None = drop the connection, headers, seconds to sleep first, fault)."""
        body = json.loads(raw)
        with self.lock:
            self.requests += 1
            self.models.add(body.get("model"))
            if self.api_key is not None and auth != f"Bearer {self.api_key}":
                self.unauthorized += 1
                return 401, _json({"error": {"message": "bad key", "type": "invalid_request_error"}}), {}, 0.0, None
            key = hashlib.sha256(canon({"path": path, **body}).encode()).hexdigest()
            self.attempts[key] += 1
            req = Request(self.requests, path, body, key, self.attempts[key])
            scripted = self._script.popleft() if self._script else None
            if self.down:
                scripted = "drop"
        fault = scripted if scripted is not None else self.fault(req)
        if fault is not None:
            with self.lock:
                self.fault_counts[fault] += 1
        if fault == "drop":
            return 0, None, {}, 0.0, fault
        if fault in ("rate_limit", "server_error", "unavailable", "bad_request"):
            status = {"rate_limit": 429, "server_error": 500, "unavailable": 503, "bad_request": 400}[fault]
            headers = {"Retry-After": self.retry_after} if fault == "rate_limit" and self.retry_after is not None else {}
            return status, _json({"error": {"message": f"scripted {fault}", "type": "test"}}), headers, 0.0, fault
        if fault == "non_json":
            return 200, b"<html><body>502 Bad Gateway</body></html>", {}, 0.0, fault
        if path.endswith("/embeddings"):
            payload = self.embeddings(req)
            if fault == "empty_choices":
                payload["data"] = []
            elif fault == "missing_choices":
                payload.pop("data")
        elif path.endswith("/chat/completions"):
            content: str | None = self.chat_content(req)
            if fault == "invalid_content":
                content = self.bad_content(req, content or "")
            elif fault == "empty_content":
                content = ""
            elif fault == "null_content":
                content = None
            payload = self.chat(req, content)
            if fault == "empty_choices":
                payload["choices"] = []
            elif fault == "missing_choices":
                payload.pop("choices")
        else:
            return 404, _json({"error": {"message": f"no route {path}"}}), {}, 0.0, fault
        data = _json(payload)
        if fault == "truncated":
            data = data[: len(data) // 2]
        # A slow answer arrives after the client gave up: not counted as served.
        return 200, data, {}, (self.slow_s if fault == "slow" else 0.0), ("good" if fault is None else fault)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body in two writes: no delayed-ACK stalls

            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

            def do_POST(self) -> None:  # noqa: N802 (stdlib name)
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with server.lock:
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                    park = server.hold_after is not None and sum(server.served.values()) >= server.hold_after
                    server.parked += park
                try:
                    if park:
                        server._gate.wait()
                        with server.lock:
                            server.parked -= 1
                        self._send(503, _json({"error": {"message": "dropped while held"}}), {})
                        return
                    status, data, headers, sleep, outcome = server._decide(self.path, self.headers.get("Authorization", ""), raw)
                    if data is None:
                        self.close_connection = True
                        return
                    time.sleep(sleep or server.latency_s)
                    if outcome == "good":
                        key = hashlib.sha256(canon({"path": self.path, **json.loads(raw)}).encode()).hexdigest()
                        with server.lock:
                            server.served[key] += 1
                    self._send(status, data, headers)
                finally:
                    with server.lock:
                        server.in_flight -= 1

            def _send(self, status: int, data: bytes, headers: dict[str, str]) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout): that is the point of the slow case

        return Handler


def _json(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def serve(**kw: Any) -> Iterator[FakeOpenAI]:
    """Generator for fixtures: a started server, stopped afterwards."""
    with FakeOpenAI(**kw) as server:
        yield server
