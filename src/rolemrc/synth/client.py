"""Async client for OpenAI-compatible servers: cache, concurrency, retries, budget, dry run.

Every request is keyed by its content (model, messages, sampling parameters, schema). The
answer is written to an on-disk cache as soon as it arrives, atomically, so a run killed at any
moment resumes where it stopped and a rerun of a finished run sends nothing.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from rolemrc.synth.config import BudgetConfig, EmbedderConfig, GeneratorConfig


class BudgetExceeded(RuntimeError):
    """Raised before a request that would pass ``budget.max_requests`` / ``budget.max_tokens``."""


class Halted(RuntimeError):
    """A request not sent because another one failed for good (the stage is stopping)."""


async def gather_all(coros: list[Awaitable[Any]]) -> list[Any]:
    """Run all; after a failure, requests already in flight still finish (and are cached) while
    queued ones stop (:class:`Halted`). Raises the first real error."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise next((e for e in errors if not isinstance(e, Halted)), errors[0])
    return results


def request_key(payload: dict[str, Any]) -> str:
    """Stable hash of a request body (sorted keys, no whitespace)."""
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class Cache:
    """One JSON file per request key, written with write-then-rename (crash safe)."""

    def __init__(self, root: Path, read_only: bool = False) -> None:
        self.root = Path(root)
        self.read_only = read_only

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str) -> Optional[dict[str, Any]]:
        path = self._path(key)
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except json.JSONDecodeError as e:
            # Only complete files are ever renamed into place, so this is outside damage.
            raise RuntimeError(f"corrupt cache entry {path}: {e}; delete it to re-request") from e

    def put(self, key: str, value: dict[str, Any]) -> None:
        if self.read_only:
            return
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}-{id(value)}")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(value, f, ensure_ascii=False)
        os.replace(tmp, path)

    def __len__(self) -> int:
        return sum(1 for _ in self.root.glob("*/*.json")) if self.root.exists() else 0


@dataclass
class Usage:
    """What a stage asked for, what came from cache, what was (or would be) sent."""

    requests: int = 0
    cached: int = 0
    sent: int = 0
    retries: int = 0
    rate_limited: int = 0
    prompt_tokens: int = 0  # reported by the server when it does, else estimated
    completion_tokens: int = 0
    est_prompt_tokens: int = 0  # estimates for requests not yet answered (dry run)
    est_completion_tokens: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)

    def add(self, other: Usage) -> None:
        for k in ("requests", "cached", "sent", "retries", "rate_limited", "prompt_tokens", "completion_tokens", "est_prompt_tokens", "est_completion_tokens"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        for k, v in other.by_kind.items():
            self.by_kind[k] = self.by_kind.get(k, 0) + v

    def line(self, dry_run: bool = False) -> str:
        if dry_run:
            return f"requests {self.requests} (cached {self.cached}, would send {self.requests - self.cached})"
        s = f"requests {self.requests} (cached {self.cached}, sent {self.sent}"
        if self.retries:
            s += f", retries {self.retries}, 429s {self.rate_limited}"
        return s + ")"


class Budget:
    """Shared across stages of one run: counts what is sent, refuses what would exceed the caps."""

    def __init__(self, cfg: BudgetConfig) -> None:
        self.cfg = cfg
        self.sent = 0
        self.tokens = 0

    def reserve(self, est_tokens: int, what: str) -> None:
        if self.cfg.max_requests is not None and self.sent + 1 > self.cfg.max_requests:
            raise BudgetExceeded(
                f"request budget reached: {self.sent} requests sent, budget.max_requests={self.cfg.max_requests} "
                f"(next: {what}). Finished requests are cached; rerun with a larger budget to go on."
            )
        if self.cfg.max_tokens is not None and self.tokens + est_tokens > self.cfg.max_tokens:
            raise BudgetExceeded(
                f"token budget reached: ~{self.tokens} tokens used, next request ~{est_tokens}, "
                f"budget.max_tokens={self.cfg.max_tokens} (next: {what}). Finished requests are cached."
            )
        self.sent += 1
        self.tokens += est_tokens

    def settle(self, estimated: int, actual: int) -> None:
        self.tokens += actual - estimated


@dataclass
class ChatRequest:
    """One chat completion to make. ``placeholder`` answers it in a dry run."""

    kind: str  # profile | free_chat | mrc_dialogue | reply | two_turn (budget estimate key)
    tag: str  # item id, for error messages
    messages: list[dict[str, str]]  # OpenAI roles (system/user/assistant)
    schema_name: str
    schema: Optional[dict[str, Any]]
    placeholder: str


def _api_key(env: Optional[str], what: str) -> str:
    if env is None:
        return "none"  # servers without auth (vllm serve without --api-key) accept anything
    key = os.environ.get(env)
    if not key:
        raise RuntimeError(f"{what}: environment variable {env} is not set (API keys are read from the environment only; set {what}.api_key_env=null for a server that needs none)")
    return key


_RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}


class _Endpoint:
    """Retry/backoff/concurrency wrapper shared by chat and embedding calls."""

    def __init__(self, *, base_url: str, api_key_env: Optional[str], what: str, concurrency: int, timeout_s: float, max_retries: int, backoff_s: float, max_backoff_s: float, dry_run: bool) -> None:
        self.base_url = base_url
        self.what = what
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.dry_run = dry_run
        self.timeout_s = timeout_s
        self._sem = asyncio.Semaphore(concurrency)
        self._client: Any = None
        self._key = None if dry_run else _api_key(api_key_env, what)
        self._rng = random.Random(0)
        self.halted = False

    @property
    def client(self) -> Any:
        if self._client is None:
            import openai

            # Retries are ours (counted, with the server's Retry-After honoured), not the SDK's.
            self._client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self._key, max_retries=0, timeout=self.timeout_s)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def call(self, fn: Callable[[], Awaitable[Any]], tag: str, usage: Usage) -> Any:
        import openai

        async with self._sem:
            for attempt in range(self.max_retries + 1):
                if self.halted:
                    raise Halted(f"{self.what} request {tag} not sent: an earlier request failed")
                try:
                    return await fn()
                except (openai.APITimeoutError, openai.APIConnectionError, openai.APIStatusError) as e:
                    status = getattr(e, "status_code", None)
                    transient = status is None or status in _RETRY_STATUS
                    if not transient or attempt == self.max_retries:
                        self.halted = True
                        raise RuntimeError(f"{self.what} request {tag} failed after {attempt + 1} attempt(s) at {self.base_url}: {type(e).__name__}: {e}") from e
                    usage.retries += 1
                    if status == 429:
                        usage.rate_limited += 1
                    await asyncio.sleep(self._delay(e, attempt))
        raise AssertionError("unreachable")

    def _delay(self, err: Any, attempt: int) -> float:
        response = getattr(err, "response", None)
        if response is not None:
            after = response.headers.get("retry-after")
            if after is not None:
                try:
                    return min(float(after), self.max_backoff_s)
                except ValueError:
                    pass  # an HTTP-date; fall back to exponential backoff
        # Full jitter keeps many workers from retrying in lockstep after a shared 429.
        return self._rng.uniform(0.5, 1.0) * min(self.max_backoff_s, self.backoff_s * 2**attempt)


class _Client:
    """What the generator and the embedder share: one endpoint, the cache, the budget, the
    usage counts. Create inside the event loop that uses it (the semaphore and HTTP client
    bind to it)."""

    what = "client"

    def __init__(self, cfg: GeneratorConfig | EmbedderConfig, budget_cfg: BudgetConfig, budget: Budget, cache: Cache,
                 dry_run: bool = False) -> None:
        self.cfg = cfg
        self.budget_cfg = budget_cfg
        self.budget = budget
        self.cache = cache
        self.dry_run = dry_run
        self.usage = Usage()
        self.ep = _Endpoint(
            base_url=cfg.base_url, api_key_env=cfg.api_key_env, what=self.what, concurrency=cfg.concurrency,
            timeout_s=cfg.timeout_s, max_retries=cfg.max_retries, backoff_s=cfg.backoff_s,
            max_backoff_s=cfg.max_backoff_s, dry_run=dry_run,
        )

    async def close(self) -> None:
        await self.ep.close()


class Generator(_Client):
    """Chat completions with cache, budget, retries and a dry-run mode."""

    what = "generator"
    cfg: GeneratorConfig

    def payload(self, req: ChatRequest) -> dict[str, Any]:
        """The request body; also what the cache key is computed from."""
        c = self.cfg
        messages = req.messages
        body: dict[str, Any] = {"model": c.model, "messages": messages, "temperature": c.temperature, "max_tokens": c.max_tokens}
        if c.top_p is not None:
            body["top_p"] = c.top_p
        if c.seed is not None:
            body["seed"] = c.seed
        if req.schema is not None:
            if c.structured_output == "json_schema":
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": req.schema_name, "schema": req.schema, "strict": True}}
            elif c.structured_output == "json_object":
                body["response_format"] = {"type": "json_object"}
            if c.structured_output != "json_schema":
                # Without server-side constraints the model only knows the shape from the prompt.
                hint = "Answer with one JSON object that matches this JSON schema, and nothing else:\n" + json.dumps(req.schema, ensure_ascii=False)
                body["messages"] = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + "\n\n" + hint}]
        if c.extra_body:
            body["extra_body"] = dict(c.extra_body)
        return body

    def estimate_prompt_tokens(self, body: dict[str, Any]) -> int:
        chars = sum(len(m["content"]) for m in body["messages"]) + len(json.dumps(body.get("response_format", "")))
        return int(chars / self.budget_cfg.chars_per_token) + 4 * len(body["messages"])

    async def chat(self, req: ChatRequest) -> str:
        """Text content of the answer (cached, fetched, or the placeholder in a dry run)."""
        body = self.payload(req)
        # The server address is not part of the key: moving to another host serving the same
        # model keeps the cache valid.
        key = request_key({"endpoint": "chat.completions", **body})
        self.usage.requests += 1
        self.usage.by_kind[req.kind] = self.usage.by_kind.get(req.kind, 0) + 1
        hit = self.cache.get(key)
        if hit is not None:
            self.usage.cached += 1
            return hit["content"]
        est_prompt = self.estimate_prompt_tokens(body)
        est_completion = min(self.budget_cfg.completion_tokens.get(req.kind, self.cfg.max_tokens), self.cfg.max_tokens)
        if self.dry_run:
            self.usage.est_prompt_tokens += est_prompt
            self.usage.est_completion_tokens += est_completion
            return req.placeholder
        self.budget.reserve(est_prompt + est_completion, req.tag)
        self.usage.sent += 1
        resp = await self.ep.call(lambda: self.ep.client.chat.completions.create(**body), req.tag, self.usage)
        if not resp.choices:
            raise RuntimeError(f"generator request {req.tag}: the server returned no choices")
        choice = resp.choices[0]
        content = choice.message.content or ""
        u = resp.usage
        pt = u.prompt_tokens if u is not None and u.prompt_tokens else est_prompt
        ct = u.completion_tokens if u is not None and u.completion_tokens else max(1, int(len(content) / self.budget_cfg.chars_per_token))
        self.usage.prompt_tokens += pt
        self.usage.completion_tokens += ct
        self.budget.settle(est_prompt + est_completion, pt + ct)
        self.cache.put(key, {"content": content, "finish_reason": choice.finish_reason, "usage": {"prompt_tokens": pt, "completion_tokens": ct}, "tag": req.tag, "time": time.time()})
        return content


class RemoteEmbedder(_Client):
    """``/v1/embeddings`` of an OpenAI-compatible server, batched and cached per batch."""

    what = "embedder"
    cfg: EmbedderConfig

    def __init__(self, cfg: EmbedderConfig, budget_cfg: BudgetConfig, budget: Budget, cache: Cache, dry_run: bool = False) -> None:
        if not cfg.base_url or not cfg.model:
            raise ValueError("embedder.backend=openai needs embedder.base_url and embedder.model")
        super().__init__(cfg, budget_cfg, budget, cache, dry_run)
        self._dim: Optional[int] = None

    async def _batch(self, texts: list[str], tag: str) -> Optional[np.ndarray]:
        body = {"model": self.cfg.model, "input": texts}
        key = request_key({"endpoint": "embeddings", **body})
        self.usage.requests += 1
        self.usage.by_kind["embed"] = self.usage.by_kind.get("embed", 0) + 1
        hit = self.cache.get(key)
        if hit is not None:
            self.usage.cached += 1
            arr = np.frombuffer(base64.b64decode(hit["b64"]), dtype=np.float32).reshape(hit["shape"])
            self._dim = arr.shape[1]
            return arr
        est = int(sum(len(t) for t in texts) / self.budget_cfg.chars_per_token)
        if self.dry_run:
            self.usage.est_prompt_tokens += est
            return None
        self.budget.reserve(est, tag)
        self.usage.sent += 1
        resp = await self.ep.call(lambda: self.ep.client.embeddings.create(model=self.cfg.model, input=texts, encoding_format="float"), tag, self.usage)
        rows = sorted(resp.data, key=lambda d: d.index)
        if len(rows) != len(texts):
            raise RuntimeError(f"embedder request {tag}: sent {len(texts)} texts, got {len(rows)} embeddings")
        arr = np.asarray([r.embedding for r in rows], dtype=np.float32)
        pt = resp.usage.prompt_tokens if getattr(resp, "usage", None) is not None and resp.usage.prompt_tokens else est
        self.usage.prompt_tokens += pt
        self.budget.settle(est, pt)
        self._dim = arr.shape[1]
        self.cache.put(key, {"b64": base64.b64encode(arr.tobytes()).decode("ascii"), "shape": list(arr.shape), "tag": tag})
        return arr

    async def embed(self, texts: list[str], is_query: bool, tag: str, on_batch: Callable[[int], None] = lambda n: None) -> np.ndarray:
        prefix = self.cfg.query_prefix if is_query else self.cfg.doc_prefix
        texts = [prefix + t for t in texts]
        bs = self.cfg.batch_size

        async def one(i: int) -> Optional[np.ndarray]:
            out = await self._batch(texts[i : i + bs], f"{tag}[{i}:{i + bs}]")
            on_batch(min(bs, len(texts) - i))
            return out

        parts = await gather_all([one(i) for i in range(0, len(texts), bs)])
        if any(p is None for p in parts):
            # Dry run with batches not in the cache: stand-in vectors of the right count, so the
            # later stages can still be planned and counted.
            rng = np.random.default_rng(len(texts))
            return rng.standard_normal((len(texts), self._dim or 8)).astype(np.float32)
        arr = np.concatenate(parts) if parts else np.zeros((0, 1), np.float32)
        if self.cfg.normalize:
            arr = arr / np.maximum(np.linalg.norm(arr, axis=1, keepdims=True), 1e-12)
        return arr
