"""Synthesis requests on top of :mod:`rolemrc.api`: request bodies, cache keys, usage, dry run.

Transport, retries (faults, malformed 200s, answers the stage's parser rejects), the budget and
fault counts are :class:`rolemrc.api.ApiClient`'s. Every request is keyed by its content (model,
messages, sampling parameters, schema); the answer is written to the SQLite cache
(:class:`rolemrc.api.AnswerCache`, ``<cache_dir>/api_cache.sqlite``) as soon as it arrives and
only if it passed the stage's check, so a run killed at any moment resumes where it stopped, a
rerun of a finished run sends nothing, and an answer that could not be used is asked again.
"""

from __future__ import annotations

import base64
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from rolemrc.api import FAULT_KINDS, AnswerCache, ApiClient, Budget, BudgetExhausted, Outcome, request_key
from rolemrc.synth.config import BudgetConfig, EmbedderConfig, GeneratorConfig

CACHE_FILE = "api_cache.sqlite"


class Cache:
    """The run's answer cache: ``<root>/api_cache.sqlite``. Answers cached by older versions as
    one JSON file per key (``<root>/<k[:2]>/<k>.json``) are still read, checked like any other."""

    def __init__(self, root: Path, read_only: bool = False) -> None:
        self.root = Path(root)
        self.read_only = read_only
        self._db: Optional[AnswerCache] = None
        # Looked for once: most runs have no JSON-file cache, and a miss per request adds up.
        self._has_legacy = self.root.is_dir() and any(p.is_dir() and len(p.name) == 2 for p in self.root.iterdir())

    @property
    def db(self) -> Optional[AnswerCache]:
        if self._db is None and (not self.read_only or (self.root / CACHE_FILE).exists()):
            self._db = AnswerCache(self.root / CACHE_FILE)
        return self._db

    def get(self, key: str, valid: Optional[Callable[[str], Any]] = None) -> Optional[str]:
        db = self.db
        hit = db.get(key, valid) if db is not None else None
        if hit is None:
            hit = self._legacy(key, valid)
        return hit

    def _legacy(self, key: str, valid: Optional[Callable[[str], Any]]) -> Optional[str]:
        if not self._has_legacy:
            return None
        path = self.root / key[:2] / f"{key}.json"
        try:
            with open(path, encoding="utf-8") as f:
                rec = json.load(f)
            text = rec["content"] if "content" in rec else json.dumps({"b64": rec["b64"], "shape": rec["shape"]})
            if valid is not None:
                valid(text)
        except FileNotFoundError:
            return None
        except Exception:  # a damaged file or an answer the check rejects: asked again
            return None
        return text

    def put(self, key: str, text: str, model: str = "") -> None:
        if not self.read_only and self.db is not None:
            self.db.put(key, text, model)

    def __len__(self) -> int:
        db = self.db
        return len(db) if db is not None else 0

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


@dataclass
class Usage:
    """What a stage asked for, what came from cache, what was (or would be) sent, what went wrong."""

    requests: int = 0
    cached: int = 0
    sent: int = 0  # attempts sent (retries included)
    retries: int = 0
    rate_limited: int = 0
    failed: int = 0  # requests without a usable answer after every retry
    prompt_tokens: int = 0  # reported by the server when it does, else estimated
    completion_tokens: int = 0
    est_prompt_tokens: int = 0  # estimates for requests not yet answered (dry run)
    est_completion_tokens: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)  # by kind (rolemrc.api.FAULT_KINDS)

    def add(self, other: Usage) -> None:
        for k in ("requests", "cached", "sent", "retries", "rate_limited", "failed", "prompt_tokens", "completion_tokens",
                  "est_prompt_tokens", "est_completion_tokens"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        for k, v in other.by_kind.items():
            self.by_kind[k] = self.by_kind.get(k, 0) + v
        for k, v in other.faults.items():
            self.faults[k] = self.faults.get(k, 0) + v

    def add_counts(self, counts: Counter[str]) -> None:
        """Fold in an :class:`~rolemrc.api.ApiClient`'s counts."""
        for k in ("sent", "retries", "rate_limited", "failed"):
            setattr(self, k, getattr(self, k) + counts[k])
        for k in FAULT_KINDS:
            if counts[k]:
                self.faults[k] = self.faults.get(k, 0) + counts[k]

    def line(self, dry_run: bool = False) -> str:
        if dry_run:
            return f"requests {self.requests} (cached {self.cached}, would send {self.requests - self.cached})"
        s = f"requests {self.requests} (cached {self.cached}, sent {self.sent}"
        if self.retries or self.failed:
            s += f", retries {self.retries}, failed {self.failed}; faults: " + ", ".join(f"{k} {v}" for k, v in self.faults.items())
        return s + ")"


def make_budget(limits: BudgetConfig) -> Budget:
    """One budget for the whole run (every stage, generator and embedder)."""
    return Budget(limits.max_requests, limits.max_tokens, names=("budget.max_requests", "budget.max_tokens"))


@dataclass
class ChatRequest:
    """One chat completion to make. ``placeholder`` answers it in a dry run; ``check`` raises
    :class:`rolemrc.api.Rejected` for an answer the stage cannot parse (it is then asked again)."""

    kind: str  # profile | free_chat | mrc_dialogue | reply | two_turn (budget estimate key)
    tag: str  # record id, for reports and error messages
    messages: list[dict[str, str]]  # OpenAI roles (system/user/assistant)
    schema_name: str
    schema: Optional[dict[str, Any]]
    placeholder: str
    check: Optional[Callable[[str], Any]] = None


@dataclass
class ChatResult:
    """The answer's text, or why there is none (``error``; ``kind``: the last fault's kind)."""

    tag: str
    text: Optional[str]
    error: Optional[str] = None
    kind: Optional[str] = None
    attempts: int = 0


class _Client:
    """What the generator and the embedder share: the API client, the cache, the budget, the
    usage counts. Create inside the event loop that uses it (the semaphore and HTTP client
    bind to it). In a dry run nothing is sent and no key is needed."""

    what = "client"

    def __init__(self, endpoint: GeneratorConfig | EmbedderConfig, budget_cfg: BudgetConfig, budget: Budget,
                 cache: Cache, dry_run: bool = False) -> None:
        self.endpoint = endpoint
        self.budget_cfg = budget_cfg
        self.budget = budget
        self.cache = cache
        self.dry_run = dry_run
        self.usage = Usage()
        self.api: Optional[ApiClient] = None
        if not dry_run:
            self.api = ApiClient(
                self.what, base_url=endpoint.base_url, api_key_env=endpoint.api_key_env,
                concurrency=endpoint.concurrency, timeout_s=endpoint.timeout_s, max_attempts=endpoint.max_retries + 1,
                backoff_s=endpoint.backoff_s, max_backoff_s=endpoint.max_backoff_s, budget=budget,
            )

    @property
    def halted(self) -> Optional[str]:
        return self.api.halted if self.api is not None else None

    async def close(self) -> None:
        if self.api is not None:
            self.usage.add_counts(self.api.counts)
            await self.api.close()
            self.api = None


class Generator(_Client):
    """Chat completions with cache, budget, retries and a dry-run mode."""

    what = "generator"
    endpoint: GeneratorConfig

    def payload(self, req: ChatRequest) -> dict[str, Any]:
        """The request body; also what the cache key is computed from."""
        c = self.endpoint
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

    async def chat(self, req: ChatRequest) -> ChatResult:
        """The answer's text (cached, fetched, or the placeholder in a dry run), or why not."""
        body = self.payload(req)
        # The server address is not part of the key: moving to another host serving the same
        # model keeps the cache valid.
        key = request_key({"endpoint": "chat.completions", **body})
        self.usage.requests += 1
        self.usage.by_kind[req.kind] = self.usage.by_kind.get(req.kind, 0) + 1
        hit = self.cache.get(key, req.check)
        if hit is not None:
            self.usage.cached += 1
            return ChatResult(req.tag, hit)
        est_prompt = self.estimate_prompt_tokens(body)
        est_completion = min(self.budget_cfg.completion_tokens.get(req.kind, self.endpoint.max_tokens), self.endpoint.max_tokens)
        if self.dry_run:
            self.usage.est_prompt_tokens += est_prompt
            self.usage.est_completion_tokens += est_completion
            return ChatResult(req.tag, req.placeholder)
        assert self.api is not None
        out: Outcome = await self.api.chat(body, tag=req.tag, check=req.check, est_tokens=est_prompt + est_completion)
        if not out.ok or out.text is None:
            return ChatResult(req.tag, None, out.error, out.kind if out.status != "budget_exhausted" else "budget_exhausted", out.attempts)
        content = out.text
        pt = out.prompt_tokens or est_prompt
        ct = out.completion_tokens or max(1, int(len(content) / self.budget_cfg.chars_per_token))
        self.usage.prompt_tokens += pt
        self.usage.completion_tokens += ct
        self.budget.settle(est_prompt + est_completion, pt + ct)
        self.cache.put(key, content, self.endpoint.model)
        return ChatResult(req.tag, content, attempts=out.attempts)


class EmbeddingFailed(RuntimeError):
    """An embedding batch without a usable answer after every retry (the match stage stops)."""


def _decode_embeddings(text: str) -> np.ndarray:
    rec = json.loads(text)
    return np.frombuffer(base64.b64decode(rec["b64"]), dtype=np.float32).reshape(rec["shape"])


class RemoteEmbedder(_Client):
    """``/v1/embeddings`` of an OpenAI-compatible server, batched and cached per batch."""

    what = "embedder"
    endpoint: EmbedderConfig

    def __init__(self, embedder: EmbedderConfig, budget_cfg: BudgetConfig, budget: Budget, cache: Cache,
                 dry_run: bool = False) -> None:
        if not embedder.base_url or not embedder.model:
            raise ValueError("embedder.backend=openai needs embedder.base_url and embedder.model")
        super().__init__(embedder, budget_cfg, budget, cache, dry_run)
        self._dim: Optional[int] = None

    async def _batch(self, texts: list[str], tag: str) -> Optional[np.ndarray]:
        body = {"model": self.endpoint.model, "input": texts}
        key = request_key({"endpoint": "embeddings", **body})
        self.usage.requests += 1
        self.usage.by_kind["embed"] = self.usage.by_kind.get("embed", 0) + 1

        def valid(text: str) -> None:
            if _decode_embeddings(text).shape[0] != len(texts):
                raise ValueError("cached batch has another row count")

        hit = self.cache.get(key, valid)
        if hit is not None:
            self.usage.cached += 1
            arr = _decode_embeddings(hit)
            self._dim = arr.shape[1]
            return arr
        est = int(sum(len(t) for t in texts) / self.budget_cfg.chars_per_token)
        if self.dry_run:
            self.usage.est_prompt_tokens += est
            return None
        assert self.api is not None
        out = await self.api.embeddings({**body, "encoding_format": "float"}, tag=tag, n_inputs=len(texts), est_tokens=est)
        if out.status == "budget_exhausted":
            raise BudgetExhausted(out.error or "budget exhausted")
        if not out.ok:
            raise EmbeddingFailed(f"embedder request {tag} at {self.endpoint.base_url} failed after {out.attempts} attempt(s): {out.error}")
        arr = np.asarray(out.value, dtype=np.float32)
        pt = out.prompt_tokens or est
        self.usage.prompt_tokens += pt
        self.budget.settle(est, pt)
        self._dim = arr.shape[1]
        self.cache.put(key, json.dumps({"b64": base64.b64encode(arr.tobytes()).decode("ascii"), "shape": list(arr.shape)}), self.endpoint.model)
        return arr

    async def embed(self, texts: list[str], is_query: bool, tag: str, on_batch: Callable[[int], None] = lambda n: None) -> np.ndarray:
        import asyncio

        prefix = self.endpoint.query_prefix if is_query else self.endpoint.doc_prefix
        texts = [prefix + t for t in texts]
        bs = self.endpoint.batch_size

        async def one(i: int) -> Optional[np.ndarray]:
            out = await self._batch(texts[i : i + bs], f"{tag}[{i}:{i + bs}]")
            on_batch(min(bs, len(texts) - i))
            return out

        # Every batch runs to its end (and is cached) before the first error is raised.
        results = await asyncio.gather(*(one(i) for i in range(0, len(texts), bs)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        parts: list[Optional[np.ndarray]] = list(results)  # type: ignore[arg-type]
        if any(p is None for p in parts):
            # Dry run with batches not in the cache: stand-in vectors of the right count, so the
            # later stages can still be planned and counted.
            rng = np.random.default_rng(len(texts))
            return rng.standard_normal((len(texts), self._dim or 8)).astype(np.float32)
        arr = np.concatenate(parts) if parts else np.zeros((0, 1), np.float32)  # type: ignore[arg-type]
        if self.endpoint.normalize:
            arr = arr / np.maximum(np.linalg.norm(arr, axis=1, keepdims=True), 1e-12)
        return arr
