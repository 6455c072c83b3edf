"""``evaluate.py`` for the benchmarks beyond RoleMRC's own test set, in one report.

Runs whichever of these the config names, in this order, and writes one ``summary.md`` (a
table per benchmark in its paper's layout), the same numbers in ``metrics.json`` and, with
``logger=...``, as scalars to every logger (W&B included):

- ``data.rolebench``: RoleBench per split, RAW/CUS/SPE (:mod:`rolemrc.eval.rolebench`);
- ``data.characterllm``: CharacterLLM Single/Turns judged 1-7 (:mod:`rolemrc.eval.characterllm`);
- ``data.personagym``: PersonaGym's PersonaScore (:mod:`rolemrc.eval.bench.personagym`);
- ``data.charactereval``: CharacterEval's metrics by its reward model (:mod:`rolemrc.eval.bench.charactereval`);
- ``data.characterbench``: CharacterBench's files judged by CharacterJudge (:mod:`rolemrc.eval.bench.characterbench`);
- ``data.coser``: CoSER given-circumstance acting (:mod:`rolemrc.eval.bench.coser`);
- ``benchmarks``: general benchmarks through lm-evaluation-harness for ``model.path`` and
  ``compare.path``, and their difference, General Δ (:mod:`rolemrc.eval.general`).

Generations go to ``<out_dir>/<benchmark>/.../generations.jsonl`` and resume like the RoleMRC
evaluation's; judge answers are cached under ``<out_dir>/judge_cache`` (or ``judge.cache_dir``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Sequence

from omegaconf import DictConfig, OmegaConf

from rolemrc.config import Judging, Replier
from rolemrc.parts import build_chat, build_loggers
from rolemrc.config_suites import check_suite_keys
from rolemrc.data.schemas import TestItem
from rolemrc.errors import ConfigError
from rolemrc.eval import characterllm, general, reference, rolebench
from rolemrc.eval.bench import characterbench, charactereval, coser, personagym
from rolemrc.eval.characterllm import check_scorer
from rolemrc.eval.generation import (
    GENERATION_BACKENDS, count_unmatched, generation_backend, generation_label, item_id, load_eval_model, model_label,
    prepare_generation, read_replies,
)
from rolemrc.eval.judge import JudgeIncomplete, finish_judged
from rolemrc.eval.report import log_to_loggers, print_console, write_report
from rolemrc.models.source import resolve_model_sources
from rolemrc.registry import Registry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Suite:
    """A benchmark evaluate.py runs when the config key ``key`` is set. ``settings(cfg)`` (at the door;
    default: the group at ``key``, see :func:`reading`) picks what it reads; its functions get only
    that and a :class:`ModelContext` ``ctx``: ``module`` has ``evaluate(settings, ctx)``,
    ``render(result)``, ``scalars(result)`` (a result's ``missing`` sentence marks it incomplete);
    ``check(settings, ctx)`` refuses what cannot run before anything slow; ``meta(settings, resolved)``
    adds report fields (default: ``data``, the data group's name); ``finish(result, out_dir)`` runs
    after the report is printed and returns an error to raise (or None)."""

    key: str
    module: Any
    check: Callable[[Any, "ModelContext"], None] = lambda settings, ctx: None
    meta: Callable[[Any, dict[str, str]], dict[str, Any]] | None = None
    finish: Callable[[dict[str, Any], Path], Exception | None] = lambda res, out_dir: None
    settings: Callable[[Any], Any] | None = None

    def wanted(self, cfg: Any) -> bool:
        return OmegaConf.select(cfg, self.key, default=None) is not None


def reading(*keys: str) -> Callable[[Any], SimpleNamespace]:
    """A suite's ``settings`` reading several groups: ``reading("data", "metrics")`` hands it
    ``settings.data`` and ``settings.metrics`` (a dotted key by its last part)."""
    return lambda cfg: SimpleNamespace(**{k.rpartition(".")[2]: OmegaConf.select(cfg, k) for k in keys})


SUITES: Registry[Suite] = Registry("suite", doc="benchmark suites evaluate.py runs, in this order, when their key is set")


def _characterllm_check(settings: Any, ctx: "ModelContext") -> None:
    if not ctx.backend.generates:
        raise ConfigError("CharacterLLM's multi-turn sessions are generated turn by turn from the model's own "
                          "earlier replies: generation.backend=file cannot supply them (use hf, vllm or openai)")
    check_scorer(ctx.judging.judge)  # the judge's backend, model and key, before anything slow


def _general_check(settings: Any, ctx: "ModelContext") -> None:
    if not ctx.backend.local:
        raise ConfigError(f"benchmarks (lm-evaluation-harness) score a local model's log-probs: not with "
                          f"generation.backend={ctx.backend.name}")


def _general_meta(settings: Any, resolved: dict[str, str]) -> dict[str, Any]:
    return {"benchmarks": settings.benchmarks.name, "compare": settings.compare.path,
            **({"compare_checkpoint": resolved["compare.path"]} if "compare.path" in resolved else {})}


SUITES.register("rolebench", Suite("data.rolebench", rolebench, settings=reading("data", "metrics")),
                doc="data.rolebench: RoleBench per split, RAW/CUS/SPE")
SUITES.register("characterllm", Suite("data.characterllm", characterllm, _characterllm_check, finish=finish_judged,
                                      settings=reading("data")),
                doc="data.characterllm: CharacterLLM Single/Turns judged 1-7")
SUITES.register("personagym", Suite("data.personagym", personagym, personagym.check, finish=finish_judged),
                doc="data.personagym: PersonaGym's PersonaScore per task, judged with its rubrics")
SUITES.register("charactereval", Suite("data.charactereval", charactereval, charactereval.check),
                doc="data.charactereval: CharacterEval's twelve metrics scored by its reward model")
SUITES.register("characterbench", Suite("data.characterbench", characterbench, characterbench.check),
                doc="data.characterbench: CharacterBench's thirteen test files judged by CharacterJudge")
SUITES.register("coser", Suite("data.coser", coser, coser.check, finish=finish_judged),
                doc="data.coser: CoSER given-circumstance acting, four judged dimensions, BLEU and ROUGE-L")
SUITES.register("general", Suite("benchmarks", general, _general_check, _general_meta,
                                 settings=reading("benchmarks", "compare")),
                doc="benchmarks: lm-evaluation-harness for model.path and compare.path (General delta)")


def wants_suites(cfg: Any) -> bool:
    """True when the config asks for any registered suite (RoleBench, CharacterLLM, lm-eval benchmarks)."""
    return any(suite.wanted(cfg) for _, suite in SUITES.items())


class ModelContext:
    """What a suite gets besides its settings: ``replier`` (:class:`~rolemrc.config.Replier`) and its
    ``backend``, ``judging`` (:class:`~rolemrc.config.Judging`), ``out_dir``, ``limit``; the model,
    loaded once on first use, and resumable generation into sub-folders (:meth:`generate`)."""

    def __init__(self, replier: Replier, judging: Judging, limit: int | None = None) -> None:
        self.replier = replier
        self.judging = judging
        self.limit = limit
        self.out_dir = Path(replier.out_dir)
        self.backend = generation_backend(replier)
        self._chat: Any = None
        self._model: Any = None
        self.generated = self.resumed = self.cut = self.requests = self.missing = 0
        self.replies_file: Any = None  # the replies file read (generation.backend=file), None before or without one

    @property
    def chat(self) -> Any:
        if self._chat is None:
            self._chat = build_chat(self.replier.model)
        return self._chat

    @property
    def tokenizer(self) -> Any:
        return self.chat.tokenizer

    @property
    def model(self) -> Any:
        if self._model is None and self.backend.loads_model:
            self._model = load_eval_model(self.replier, self.tokenizer)
        return self._model

    def generate(self, sub_dir: str, items: Sequence[TestItem]) -> list[str | None]:
        """Greedy replies to ``items`` (their ``question`` messages), resuming from
        ``<out_dir>/<sub_dir>/generations.jsonl``; with ``generation.backend=file`` the file's
        replies, None for an item without one (``generation.on_missing=skip``)."""
        sub = self.replier.at(self.out_dir / sub_dir)
        Path(sub.out_dir).mkdir(parents=True, exist_ok=True)
        ids = [item_id(i, it.task, it.question) for i, it in enumerate(items)]
        if not self.backend.local:
            if not self.backend.generates and self.replies_file is None:
                self.replies_file = read_replies(sub.generation.path, sub.generation.reply_field)
            run = self.backend.generate_remote(sub, items, ids, self.replies_file)
            self.requests += run.requests
            self.missing += len(run.missing)
        else:
            gen_items, stops = prepare_generation(sub, items, ids, self.tokenizer, self.chat)
            run = self.backend.generate_local(sub, gen_items, stops, self.tokenizer, self.model)
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

    suites = {name: suite for name, suite in SUITES.items() if suite.wanted(cfg)}
    resolved: dict[str, str] = {}
    if GENERATION_BACKENDS.get(cfg.generation.backend).local:
        cfg, resolved = resolve_model_sources(cfg, "compare.path")
    # The door: the parts every suite is handed, typed once; each suite's settings picked here.
    ctx = ModelContext(Replier.of(cfg), Judging.of(cfg), cfg.limit)
    r = ctx.replier
    settings = {name: s.settings(cfg) if s.settings else OmegaConf.select(cfg, s.key) for name, s in suites.items()}
    for name, suite in suites.items():
        suite.check(settings[name], ctx)
    ctx.backend.check(r, ctx.judging.judge)  # what the backend needs (vllm, the API key, the replies file)
    refs = reference.picked(cfg.get("report"))  # report.reference: the published rows named, before anything slow
    out_dir = ctx.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {}
    sections: list[str] = []
    scalars: dict[str, float] = {}
    meta: dict[str, Any] = {
        "name": f"{model_label(r)} on {', '.join(suites)}",
        "model": model_label(r),
        **({"model_checkpoint": resolved["model.path"]} if "model.path" in resolved else {}),
    }
    for name, suite in suites.items():
        res = suite.module.evaluate(settings[name], ctx)
        doc[name] = res
        sections.append(suite.module.render(res))
        scalars.update(suite.module.scalars(res))
        meta.update(suite.meta(settings[name], resolved) if suite.meta else {"data": r.data.name})
    meta["generation"] = generation_label(r)
    doc["counts"] = {"generated": ctx.generated, "resumed": ctx.resumed, "cut_at_max_new_tokens": ctx.cut,
                     "replies_missing": ctx.missing, "generation_requests": ctx.requests}
    if ctx.replies_file is not None:  # rows matched to no item of any benchmark read
        doc["counts"]["replies_unmatched"] = count_unmatched(ctx.replies_file)
    ref_section = reference.section(refs, scalars)
    if ref_section:
        sections.append(ref_section)
        doc["reference"] = reference.logger_rows(refs, scalars)
    paths = write_report(out_dir, meta=meta, extra=doc, sections=sections)
    log_to_loggers(build_loggers(cfg) if cfg.logger else [], scalars, [[k, v] for k, v in scalars.items()],
                   ["metric", "value"], tables=reference.logger_tables(refs, scalars))

    print_console(paths["summary.md"], sections=sections)
    errors = [e for name, suite in suites.items() if (e := suite.finish(doc[name], out_dir)) is not None]
    incomplete = [doc[name]["missing"] for name in suites if doc[name].get("missing")]
    if incomplete:
        raise JudgeIncomplete("; ".join(incomplete) + f"; the report in {out_dir} holds what was obtained; rerun the "
                              "same command to ask only for the rest")
    if errors:
        raise errors[0]
    return {"out_dir": str(out_dir), "paths": {k: str(p) for k, p in paths.items()}, "results": doc,
            "scalars": scalars}
