"""Test items for evaluation and the training-time judge: ``data.test`` sources read,
validated (file:line errors) and cut to a limit; their generation prompts encoded once into a
:mod:`rolemrc.data.store` (``data.cache``) and read back by every later evaluation."""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import OmegaConf

from rolemrc.config import plain
from rolemrc.data.readers import read_examples
from rolemrc.data.schemas import DataError, TestItem
from rolemrc.data.store import open_or_build_prompts
from rolemrc.data.templates import ChatFormat

log = logging.getLogger(__name__)


def load_test_items(data: Any, limit: int | None = None) -> tuple[list[TestItem], bool]:
    """``(items, is_rolebench)`` from ``data.test``, cut to the first ``limit`` items."""
    sources = OmegaConf.to_container(data.test, resolve=True)
    assert isinstance(sources, list)
    formats = {str(s.get("format") or "auto") for s in sources}
    unknown = formats - {"auto", "rolebench"}
    if unknown:
        raise ValueError(f"data.test: unknown source format(s) {sorted(unknown)}; use auto or rolebench")
    if formats == {"auto", "rolebench"}:
        # The two are scored differently (all metrics + judge vs ROUGE-L only): one report each.
        raise ValueError("data.test mixes RoleMRC and RoleBench (format: rolebench) sources; evaluate them in separate runs")
    if not sources:
        raise DataError("no test sources configured (data.test is empty)")
    rolebench = formats == {"rolebench"}
    items, report = read_examples(sources, "test", on_error=data.on_error)
    for line in report.lines():
        log.info("test data: %s", line)
    if limit is not None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1 (or null for all items), got {limit}")
        items = items[:limit]
    if not items:
        raise DataError("the test sources hold no items")
    return items, rolebench


def generation_prompts(data: Any, items: list[TestItem], chat: ChatFormat) -> list[list[int]]:
    """The generation prompt of each item (``chat.encode_prompt`` of its question). With
    ``data.cache`` (the default) they come from the store of these questions' prompts (keyed by
    the questions, the tokenizer, chat template and encoder code), built at the first start and
    read back, with no encoding, at every later one; ``data.cache=false`` encodes them here."""
    questions = [it.question for it in items]
    if not data.get("cache", True):
        return [chat.encode_prompt(q) for q in questions]
    return open_or_build_prompts(questions, chat, data.get("cache_dir"), plain(data.get("test"))).prompts()
