"""``evaluate.py`` for the benchmarks beyond RoleMRC's own test set, in one report.

Runs whichever of these the config names, in this order, and writes one ``summary.md`` (a
table per benchmark in its paper's layout), the same numbers in ``metrics.json`` and, with
``logger=...``, as scalars to every logger (W&B included):

- ``data.rolebench``: RoleBench per split, RAW/CUS/SPE (:mod:`rolemrc.eval.rolebench`);
- ``data.characterllm``: CharacterLLM Single/Turns judged 1-7 (:mod:`rolemrc.eval.characterllm`);
- ``benchmarks``: general benchmarks through lm-evaluation-harness for ``model.path`` and
  ``compare.path``, and their difference, General Δ (:mod:`rolemrc.eval.general`).

Generations go to ``<out_dir>/<benchmark>/.../generations.jsonl`` and resume like the RoleMRC
evaluation's; judge answers are cached under ``<out_dir>/judge_cache`` (or ``judge.cache_dir``).
"""

from __future__ import annotations

import copy
import logging
import sys
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, open_dict

from rolemrc.parts import build_chat, build_loggers
from rolemrc.config_suites import check_suite_keys
from rolemrc.data.schemas import TestItem
from rolemrc.errors import ConfigError
from rolemrc.eval import characterllm, general, rolebench
from rolemrc.eval.characterllm import check_scorer
from rolemrc.eval.generation import (
    check_backend, count_unmatched, generate, generate_remote, generation_backend, generation_label, item_id,
    load_eval_model, model_label, prepare_generation, read_replies,
)
from rolemrc.eval.judge import JudgeIncomplete
from rolemrc.eval.report import log_to_loggers, print_console, write_report
from rolemrc.models.source import resolve_model_sources

log = logging.getLogger(__name__)


def wants_suites(cfg: Any) -> bool:
    """True when the config asks for RoleBench, CharacterLLM or lm-eval benchmarks."""
    data = cfg.data
    return bool(data.get("rolebench") is not None or data.get("characterllm") is not None
                or cfg.get("benchmarks") is not None)


class ModelContext:
    """The evaluated model, loaded once on first use, and resumable generation into sub-folders."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self._chat: Any = None
        self._model: Any = None
        self.generated = 0
        self.resumed = 0
        self.cut = 0
        self.requests = 0
        self.missing = 0
        self._replies: Any = None

    @property
    def replies_file(self) -> Any:
        """The replies file read (``generation.backend=file``), None before or without one."""
        return self._replies

    @property
    def chat(self) -> Any:
        if self._chat is None:
            self._chat = build_chat(self.cfg.model)
        return self._chat

    @property
    def tokenizer(self) -> Any:
        return self.chat.tokenizer

    @property
    def model(self) -> Any:
        if self._model is None and generation_backend(self.cfg).loads_model:
            self._model = load_eval_model(self.cfg, self.tokenizer)
        return self._model

    def generate(self, sub_dir: str, items: Sequence[TestItem]) -> list[str | None]:
        """Greedy replies to ``items`` (their ``question`` messages), resuming from
        ``<out_dir>/<sub_dir>/generations.jsonl``; with ``generation.backend=file`` the file's
        replies, None for an item without one (``generation.on_missing=skip``)."""
        sub = copy.deepcopy(self.cfg)
        with open_dict(sub):
            sub.out_dir = str(Path(self.cfg.out_dir) / sub_dir)
        Path(sub.out_dir).mkdir(parents=True, exist_ok=True)
        ids = [item_id(i, it.task, it.question) for i, it in enumerate(items)]
        backend = generation_backend(self.cfg)
        if not backend.local:
            if not backend.generates and self._replies is None:
                self._replies = read_replies(self.cfg.generation.path, self.cfg.generation.reply_field)
            run = generate_remote(sub, items, ids, sub.out_dir, self._replies)
            self.requests += run.requests
            self.missing += len(run.missing)
        else:
            gen_items, stops = prepare_generation(sub, items, ids, self.tokenizer, self.chat)
            run = generate(sub, gen_items, stops, self.tokenizer, self.model)
        self.generated += run.n_new
        self.resumed += run.n_resumed
        self.cut += run.n_cut
        replies: list[str | None] = list(run.replies)
        for k in run.missing:  # file backend: put the gaps back in item order
            replies.insert(k, None)
        return replies


def run_suites(cfg: DictConfig) -> dict[str, Any]:
    """Evaluate the configured benchmarks; returns paths and each benchmark's results."""
    check_suite_keys(cfg)  # a key added with '+' that no suite reads (e.g. +data.rolebench.splitz=...)

    backend = generation_backend(cfg)
    if backend.local:
        cfg, resolved = resolve_model_sources(cfg, "compare.path")
    else:
        resolved = {}
        if cfg.get("benchmarks") is not None:
            raise ConfigError(f"benchmarks (lm-evaluation-harness) score a local model's log-probs: not with "
                              f"generation.backend={backend.name}")
        if not backend.generates and cfg.data.get("characterllm") is not None:
            raise ConfigError("CharacterLLM's multi-turn sessions are generated turn by turn from the model's own "
                              "earlier replies: generation.backend=file cannot supply them (use hf, vllm or openai)")
    check_backend(cfg)
    if cfg.data.get("characterllm") is not None:
        check_scorer(cfg)  # the judge's backend, model and key, before anything slow
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = ModelContext(cfg)
    doc: dict[str, Any] = {}
    sections: list[str] = []
    scalars: dict[str, float] = {}
    incomplete: list[str] = []

    if cfg.data.get("rolebench") is not None:
        res = rolebench.evaluate(cfg, ctx)
        doc["rolebench"] = res
        sections.append(rolebench.render(res))
        scalars.update(rolebench.scalars(res))
    if cfg.data.get("characterllm") is not None:
        res = characterllm.evaluate(cfg, ctx)
        doc["characterllm"] = res
        sections.append(characterllm.render(res))
        scalars.update(characterllm.scalars(res))
        if res.get("missing"):
            incomplete.append(res["missing"])
    if cfg.get("benchmarks") is not None:
        res = general.evaluate(cfg, ctx)
        doc["general"] = res
        sections.append(general.render(res))
        scalars.update(general.scalars(res))

    meta: dict[str, Any] = {
        "name": f"{model_label(cfg)} on {', '.join(k for k in ('rolebench', 'characterllm', 'general') if k in doc)}",
        "model": model_label(cfg),
        **({"model_checkpoint": resolved["model.path"]} if "model.path" in resolved else {}),
        **({"data": cfg.data.name} if "rolebench" in doc or "characterllm" in doc else {}),
        "generation": generation_label(cfg),
    }
    if cfg.get("benchmarks") is not None:
        meta["benchmarks"] = cfg.benchmarks.name
        meta["compare"] = cfg.compare.path
        if "compare.path" in resolved:
            meta["compare_checkpoint"] = resolved["compare.path"]
    doc["counts"] = {"generated": ctx.generated, "resumed": ctx.resumed, "cut_at_max_new_tokens": ctx.cut,
                     "replies_missing": ctx.missing, "generation_requests": ctx.requests}
    if ctx.replies_file is not None:  # rows matched to no item of any benchmark read
        doc["counts"]["replies_unmatched"] = count_unmatched(ctx.replies_file)
    paths = write_report(out_dir, meta=meta, extra=doc, sections=sections)
    log_to_loggers(build_loggers(cfg) if cfg.logger else [], scalars, [[k, v] for k, v in scalars.items()],
                   ["metric", "value"])

    print_console(paths["summary.md"], sections=sections)
    cl = doc.get("characterllm") or {}
    if cl.get("warning"):
        print(cl["warning"], file=sys.stderr, flush=True)
    if incomplete:
        raise JudgeIncomplete("; ".join(incomplete) + f"; the report in {out_dir} holds what was obtained; rerun the "
                              "same command to ask only for the rest")
    if cl.get("unscored"):  # every answer final and without a score: never exit 0 on a table of n/a
        raise characterllm.NoScores(f"{cl['unscored']}; the report in {out_dir} holds the answers")
    return {"out_dir": str(out_dir), "paths": {k: str(p) for k, p in paths.items()}, "results": doc,
            "scalars": scalars}
