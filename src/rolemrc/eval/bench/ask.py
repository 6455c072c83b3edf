"""Asking a judge (the ``judge`` group, hf or openai, or a suite's own judge settings) for answers
in a benchmark's own format, through an answer cache: the loop the judged suites share."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from rolemrc.api import AnswerCache
from rolemrc.eval.generation import model_label
from rolemrc.eval.judge import OpenAIBackend, cache_key, make_judge

Message = dict[str, str]


def ask_judge(backend: Any, cache: AnswerCache, prompts: Sequence[list[Message]], parse: Callable[[str | None], Any],
              check: Callable[[str], Any], tag: str, mode: str | None = None,
              no_value: str | None = None) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """One ``{"status", "text", "value", "cached", "error", "attempts"}`` per prompt, and ``{"cache_hits", "requests"}``.

    A cached answer is served when ``check`` accepts it; identical prompts are asked once. ``value``
    is ``parse(text)``; an answer it cannot read is ``unparseable`` (the openai backend first asks
    again, ``check`` raising :class:`rolemrc.api.Rejected`; a greedy hf judge would answer the
    same). Only answers with a value are cached; failed requests keep their status and error.
    ``mode``: added to the cache key's sampling settings; ``no_value``: the error of an unparseable
    answer that carries none."""
    stats = {"cache_hits": 0, "requests": 0}
    results: list[dict[str, Any] | None] = [None] * len(prompts)
    sampling = {**backend.sampling(), "mode": mode} if mode else backend.sampling()
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
            if value is None and no_value:
                error = error or no_value
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


@contextmanager
def suite_judge(ctx: Any, cache_file: str, judge: Any = None, where: str = "judge") -> Iterator[tuple[Any, AnswerCache]]:
    """The suite's judge backend (``judge``: other judge settings than ``ctx.judging``'s group,
    named ``where`` in errors), closed after, and the answer cache ``<judge cache>/<cache_file>``.
    A judge ``hf`` with ``model: null`` judges with the evaluated model (``ctx.model``)."""
    judging = ctx.judging
    model = ctx.model
    built = make_judge(judging.judge if judge is None else judge, cache_dir=judging.cache_dir, model=model,
                       tokenizer=ctx.tokenizer if model is not None else None, model_id=model_label(ctx.replier),
                       device=judging.device, where=where)
    assert built is not None
    try:
        with AnswerCache(Path(judging.cache_dir) / cache_file) as cache:
            yield built.backend, cache
    finally:
        built.close()


def ask_suite_judge(ctx: Any, cache_file: str, prompts: Sequence[list[Message]], parse: Callable[[str | None], Any],
                    check: Callable[[str], Any], tag: str, judge: Any = None,
                    where: str = "judge") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """:func:`ask_judge` with :func:`suite_judge`; the stats also name the judge's model and count the prompts."""
    with suite_judge(ctx, cache_file, judge, where) as (backend, cache):
        answers, counts = ask_judge(backend, cache, prompts, parse, check, tag)
    return answers, {"judge_model": backend.model_id, "prompts": len(prompts), **counts}
