"""The one client for OpenAI-compatible servers (the judge, the synthesis generator and embedder).

Transport is the ``openai`` SDK (its own retries off, so every attempt is ours to count and to
charge to the budget); retries are ``tenacity``'s: exponential backoff with full jitter, never
shorter than the server's ``Retry-After``. Retried: HTTP 408/409/429/5xx, timeouts, connection
errors, and 200s that carry no usable answer: a truncated or non-JSON body, missing or empty
``choices``, empty content, or content the caller's ``check`` rejects (a parse failure). Not
retried: other 4xx (401/403/404 also stop every later request of this client: the key or URL is
wrong, asking again cannot help). The budget is charged before each send, so a run never passes
``max_requests``. Every fault is counted by kind (``counts``). The API key is read from the
environment variable the config names, when the client is made, and goes nowhere else.

    client = ApiClient("judge", base_url=..., api_key_env="OPENAI_API_KEY", max_attempts=5)
    out = await client.chat({"model": m, "messages": msgs}, tag="item 3/KB", check=parse)
    out.status  # ok | failed | budget_exhausted; out.value = parse(content) when ok
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_random_exponential

from rolemrc.errors import MissingAPIKey

log = logging.getLogger(__name__)

__all__ = [
    "FAULT_KINDS", "ApiClient", "Budget", "BudgetExhausted", "Fault", "MissingApiKey", "Outcome", "Rejected",
    "api_key", "fault_summary",
]

# What can go wrong with one attempt, as counted in ``ApiClient.counts`` (and reported).
FAULT_KINDS: tuple[str, ...] = (
    "rate_limited",     # HTTP 429
    "server_error",     # HTTP 5xx, 408, 409
    "timeout",          # no answer within timeout_s
    "connection",       # refused, reset, closed without an answer
    "malformed_body",   # a 200 whose body is not (complete) JSON
    "empty_choices",    # a 200 with missing or empty `choices`
    "empty_content",    # a 200 whose message content is empty or null
    "rejected",         # content the caller's check refused (does not parse)
    "http_error",       # other 4xx (not retried)
    "budget_exhausted", # not sent: the request budget is spent
)
RETRY_STATUS = frozenset({408, 409, 429})
FATAL_STATUS = frozenset({401, 403, 404})


MissingApiKey = MissingAPIKey  # the environment variable that should hold the API key is not set


class BudgetExhausted(RuntimeError):
    """Raised instead of a send that would pass the request or token budget."""


class Rejected(ValueError):
    """Raised by a caller's ``check`` for content it cannot use (``reason``: a short name)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def rejected_detail(e: ValueError) -> str:
    """What a ``check`` that refused an answer said, once: ``reason: detail`` for :class:`Rejected`
    (its message already), ``<error type>: message`` for any other ValueError."""
    return str(e) if isinstance(e, Rejected) else f"{type(e).__name__}: {e}"


class Fault(Exception):
    """One failed attempt, classified."""

    def __init__(self, kind: str, detail: str, *, retryable: bool = True, retry_after: float | None = None,
                 fatal: bool = False, text: str | None = None) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail
        self.retryable, self.retry_after, self.fatal = retryable, retry_after, fatal
        self.text = text  # the content, for a rejected answer


def api_key(env: str | None, what: str) -> str:
    """The key from ``$env``; ``env=None`` for a server that needs none (e.g. ``vllm serve``)."""
    if env is None:
        return "none"
    key = os.environ.get(env)
    if not key:
        raise MissingApiKey(
            f"{what}: the API key is read from the environment variable {env}, which is not set "
            f"(set it; for a local server that ignores keys any value will do)"
        )
    return key


class Budget:
    """Caps on what may be sent (shared by every client of a run); None = no cap."""

    def __init__(self, max_requests: int | None = None, max_tokens: int | None = None,
                 names: tuple[str, str] = ("max_requests", "max_tokens")) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.names = names  # the config keys, for the message
        self.sent = self.tokens = 0

    def take(self, est_tokens: int = 0, what: str = "") -> None:
        # No await between the check and the increment: atomic within one event loop.
        if self.max_requests is not None and self.sent >= self.max_requests:
            raise BudgetExhausted(
                f"request budget reached: {self.sent} requests sent, {self.names[0]}={self.max_requests}"
                + (f" (next: {what})" if what else "") + ". Finished answers are cached; rerun with a larger budget to go on."
            )
        if self.max_tokens is not None and self.tokens + est_tokens > self.max_tokens:
            raise BudgetExhausted(
                f"token budget reached: ~{self.tokens} tokens used, next request ~{est_tokens}, "
                f"{self.names[1]}={self.max_tokens}" + (f" (next: {what})" if what else "") + ". Finished answers are cached."
            )
        self.sent += 1
        self.tokens += est_tokens

    def settle(self, estimated: int, actual: int) -> None:
        self.tokens += actual - estimated


@dataclass
class Outcome:
    """What one request came to. ``value`` is ``check(text)`` when ok."""

    status: Literal["ok", "failed", "budget_exhausted"]
    text: str | None = None  # the checked content (ok) or the last rejected content
    value: Any = None
    attempts: int = 0
    cached: bool = False
    error: str | None = None  # "<kind>: <detail>" of the last fault
    kind: str | None = None  # the last fault's kind
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def fault_summary(counts: Counter[str] | dict[str, int]) -> str:
    """``"rate_limited 3, timeout 1"`` (only the kinds that happened), or ``"none"``."""
    parts = [f"{k} {counts[k]}" for k in FAULT_KINDS if counts.get(k)]
    return ", ".join(parts) or "none"


def _retry_after(response: Any) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date)."""
    try:
        value = response.headers.get("retry-after")
    except AttributeError:
        return None
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        return max(0.0, when.timestamp() - time.time())


def classify(e: BaseException) -> Fault:
    """An exception raised by the SDK while sending or decoding -> a :class:`Fault`."""
    import openai

    if isinstance(e, Fault):
        return e
    if isinstance(e, openai.APITimeoutError):
        return Fault("timeout", "no answer within the timeout")
    if isinstance(e, openai.APIConnectionError):
        return Fault("connection", str(e.__cause__ or e) or type(e).__name__)
    if isinstance(e, openai.APIStatusError):
        code = e.status_code
        detail = f"HTTP {code} ({type(e).__name__})"
        if code == 429:
            return Fault("rate_limited", detail, retry_after=_retry_after(e.response))
        if code >= 500 or code in RETRY_STATUS:
            return Fault("server_error", detail, retry_after=_retry_after(e.response))
        return Fault("http_error", detail, retryable=False, fatal=code in FATAL_STATUS)
    if isinstance(e, (ValueError, openai.APIResponseValidationError)):
        # json.JSONDecodeError (a truncated or non-JSON body) is a ValueError.
        return Fault("malformed_body", f"{type(e).__name__}: {e}")
    raise e  # a bug of ours, not a server fault: never swallowed


class ApiClient:
    """Chat completions and embeddings with concurrency limit, retries, budget and counts.

    Make it inside the event loop that uses it (the semaphore and HTTP client bind to it) and
    ``await close()`` after. ``counts`` may be shared between clients to report a whole run.
    """

    def __init__(self, what: str, *, base_url: str | None, api_key_env: str | None, concurrency: int = 8,
                 timeout_s: float = 60.0, max_attempts: int = 5, backoff_s: float = 1.0, max_backoff_s: float = 60.0,
                 budget: Budget | None = None, counts: Counter[str] | None = None) -> None:
        import openai

        if max_attempts < 1 or concurrency < 1:
            raise ValueError(f"{what}: max_attempts and concurrency must be >= 1")
        self.what, self.base_url, self.max_attempts = what, base_url, max_attempts
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.budget = budget if budget is not None else Budget()
        self.counts: Counter[str] = counts if counts is not None else Counter()
        self.halted: str | None = None  # why later requests are not sent (a fatal 4xx)
        self._sem = asyncio.Semaphore(concurrency)
        self._jitter = wait_random_exponential(multiplier=backoff_s, max=max_backoff_s)
        # max_retries=0: the SDK's own retries would be invisible to the budget and the counts.
        self.client = openai.AsyncOpenAI(api_key=api_key(api_key_env, what), base_url=base_url,
                                         timeout=timeout_s, max_retries=0)

    async def close(self) -> None:
        await self.client.close()

    # ---------------------------------------------------------------- requests
    async def chat(self, body: dict[str, Any], *, tag: str, check: Callable[[str], Any] | None = None,
                   est_tokens: int = 0, empty_ok: bool = False) -> Outcome:
        """``POST /chat/completions`` with ``body``; ok only when the content passes ``check``.
        ``empty_ok``: an empty or null content is an answer (``""``), not a fault to retry (the
        judge's paper protocol scores it, as the authors' script did)."""
        meta: dict[str, Any] = {}

        def extract(resp: Any) -> str:
            choices = getattr(resp, "choices", None)
            if not choices:
                raise Fault("empty_choices", "the answer has no choices")
            msg = choices[0].message
            content = msg.content if msg is not None else None
            if (not content or not content.strip()) and not empty_ok:
                raise Fault("empty_content", "the answer's content is empty")
            content = content or ""
            meta["finish_reason"] = choices[0].finish_reason
            u = getattr(resp, "usage", None)
            if u is not None:
                meta["prompt_tokens"], meta["completion_tokens"] = u.prompt_tokens, u.completion_tokens
            return content

        return replace(await self._request(lambda: self.client.chat.completions.create(**body), extract, check, tag,
                                           est_tokens), **meta)  # meta: filled by extract

    async def embeddings(self, body: dict[str, Any], *, tag: str, n_inputs: int, est_tokens: int = 0) -> Outcome:
        """``POST /embeddings``; ``value`` is the list of vectors (ok only with one per input)."""
        meta: dict[str, Any] = {}

        def extract(resp: Any) -> list[list[float]]:
            rows = sorted(getattr(resp, "data", None) or [], key=lambda d: d.index)
            if len(rows) != n_inputs or any(not r.embedding for r in rows):
                raise Fault("empty_choices", f"sent {n_inputs} inputs, got {len(rows)} embeddings")
            u = getattr(resp, "usage", None)
            if u is not None:
                meta["prompt_tokens"] = u.prompt_tokens
            return [list(r.embedding) for r in rows]

        return replace(await self._request(lambda: self.client.embeddings.create(**body), extract, None, tag,
                                           est_tokens), **meta)

    async def completions(self, body: dict[str, Any], *, tag: str,
                          check: Callable[[list[Any]], Any] | None = None) -> Outcome:
        """``POST /completions`` with ``body`` (``extra_body`` for a server's own fields, e.g. vLLM's
        ``return_token_ids``); ``value`` is ``check(choices)`` (the choices sorted by index, each as a
        dict with the server's extra fields), ok only when ``check`` accepts them."""

        def extract(resp: Any) -> list[dict[str, Any]]:
            choices = getattr(resp, "choices", None)
            if not choices:
                raise Fault("empty_choices", "the answer has no choices")
            return sorted((c.model_dump() for c in choices), key=lambda c: c.get("index") or 0)

        return await self._request(lambda: self.client.completions.create(**body), extract, check, tag, 0)

    async def post(self, path: str, body: dict[str, Any], *, tag: str) -> Outcome:
        """``POST <base_url><path>`` with a JSON ``body`` (a server's own routes, e.g. vLLM's
        ``/load_lora_adapter``), with the same retries, budget and counts; ``text`` is the answer's body."""
        import httpx

        async def send() -> Any:
            return await self.client.post(path, cast_to=httpx.Response, body=body)

        return await self._request(send, lambda r: r.text, None, tag, 0)

    # ---------------------------------------------------------------- the retry loop
    def _wait(self, state: RetryCallState) -> float:
        delay = self._jitter(state)
        fault = state.outcome.exception() if state.outcome is not None else None
        after = getattr(fault, "retry_after", None)
        if after is not None:
            delay = max(delay, min(after, self.max_backoff_s))
        return delay

    def _before_sleep(self, state: RetryCallState) -> None:
        self.counts["retries"] += 1
        fault = state.outcome.exception() if state.outcome is not None else None
        log.debug("%s: attempt %d failed (%s), retrying", self.what, state.attempt_number, fault)

    async def _request(self, send: Callable[[], Awaitable[Any]], extract: Callable[[Any], Any],
                       check: Callable[[Any], Any] | None, tag: str, est_tokens: int) -> Outcome:
        attempts = 0
        last: Fault | None = None

        async def send_one() -> Any:
            nonlocal attempts
            async with self._sem:
                # Checked once a slot is free: requests queued behind a fatal answer are not sent.
                if self.halted:
                    raise Fault("http_error", f"not sent: {self.halted}", retryable=False)
                try:
                    self.budget.take(est_tokens, tag)
                except BudgetExhausted:
                    self.counts["budget_exhausted"] += 1
                    raise
                attempts += 1
                self.counts["sent"] += 1
                return await send()

        async def attempt() -> tuple[Any, Any]:
            nonlocal last
            try:
                raw = extract(await send_one())
            except BudgetExhausted:
                raise
            except Fault as f:  # an unusable 200 (extract), or not sent after a fatal answer
                if not f.detail.startswith("not sent: "):
                    last = f
                    self.counts[f.kind] += 1
                raise
            except Exception as e:  # what the SDK raised; a bug of ours is re-raised by classify
                last = classify(e)
                self.counts[last.kind] += 1
                if last.fatal:
                    self.halted = f"an earlier {self.what} request got {last.detail}"
                raise last from e
            if check is None:
                return raw, raw
            try:
                return raw, check(raw)
            except ValueError as e:
                last = Fault("rejected", rejected_detail(e), text=raw if isinstance(raw, str) else None)
                self.counts["rejected"] += 1
                raise last from e

        try:
            async for state in AsyncRetrying(
                stop=stop_after_attempt(self.max_attempts), wait=self._wait,
                retry=retry_if_exception(lambda e: isinstance(e, Fault) and e.retryable),
                before_sleep=self._before_sleep, reraise=True,
            ):
                with state:
                    raw, value = await attempt()
        except BudgetExhausted as e:
            return Outcome("budget_exhausted", text=last.text if last else None, attempts=attempts,
                           error=f"{e}" + (f" (last fault: {last})" if last else ""), kind="budget_exhausted")
        except Fault as f:
            self.counts["failed"] += 1
            log.debug("%s request %s failed after %d attempt(s): %s", self.what, tag, attempts, f)
            return Outcome("failed", text=f.text, attempts=attempts, error=str(f), kind=f.kind)
        self.counts["answered"] += 1
        return Outcome("ok", text=raw if isinstance(raw, str) else None, value=value, attempts=attempts)
