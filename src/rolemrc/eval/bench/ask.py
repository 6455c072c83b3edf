"""Asking a judge (``cfg.judge``: hf or openai) for answers in a benchmark's own format, through
an answer cache: the loop CharacterLLM's and CharacterBench's scoring share."""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Sequence

from rolemrc.api import AnswerCache
from rolemrc.eval.judge import OpenAIBackend, cache_key

Message = dict[str, str]


def ask_judge(backend: Any, cache: AnswerCache, prompts: Sequence[list[Message]], parse: Callable[[str | None], Any],
              check: Callable[[str], Any], tag: str) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """One ``{"status", "text", "value", "cached", "error", "attempts"}`` per prompt, and ``{"cache_hits", "requests"}``.

    A cached answer is served when ``check`` accepts it; identical prompts are asked once. ``value``
    is ``parse(text)``; an answer it cannot read is ``unparseable`` (the openai backend first asks
    again, ``check`` raising :class:`rolemrc.api.Rejected`; a greedy hf judge would answer the
    same). Only answers with a value are cached; failed requests keep their status and error."""
    stats = {"cache_hits": 0, "requests": 0}
    results: list[dict[str, Any] | None] = [None] * len(prompts)
    sampling = backend.sampling()
    todo: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        k = cache_key(backend.model_id, p, sampling)
        text = cache.get(k, valid=check)
        if text is not None:
            results[i] = {"status": "ok", "text": text, "value": parse(text), "cached": True, "error": None,
                          "attempts": 0}
            stats["cache_hits"] += 1
        else:
            todo.setdefault(k, []).append(i)
    keys = list(todo)

    def record(j: int, status: str, text: str | None, attempts: int, error: str | None) -> None:
        value = parse(text) if status in ("ok", "unparseable") else None
        if status in ("ok", "unparseable"):
            status = "ok" if value is not None else "unparseable"
        if status == "ok":
            cache.put(keys[j], text or "", backend.model_id)
        stats["requests"] += attempts
        for i in todo[keys[j]]:
            results[i] = {"status": status, "text": text, "value": value, "cached": False, "error": error,
                          "attempts": attempts}

    asks = [prompts[idx[0]] for idx in todo.values()]
    if asks and isinstance(backend, OpenAIBackend):
        asyncio.run(backend.answer_all(asks, lambda j, a: record(j, a.status, a.text, a.attempts, a.error),
                                       check=check, tag=tag))
    elif asks:  # hf: the text is what counts here (its own verdict check does not apply)
        for j, a in enumerate(asyncio.run(backend.answer_all(asks))):
            record(j, "failed" if a.status == "failed" else "ok", a.text, a.attempts, a.error)
    return [r for r in results if r is not None], stats
