"""The evaluation pipeline behind ``python evaluate.py``.

test items -> generations (resumable) -> reference metrics -> LLM judge per (item, dimension)
-> NI rule verifiers + judge agreement -> ``metrics.json``, ``judge.jsonl``, ``summary.md``.

RoleBench test splits (paper Table 4) are test sources with ``format: rolebench``: rows
``{role, question, generated}`` (or SFT-shaped conversations whose last turn is the answer);
they are scored with ROUGE-L only (best over the rows' reference answers) and not judged.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from omegaconf import DictConfig

from rolemrc.config import Judging, Replier, check_data_dir
from rolemrc.errors import ConfigError
from rolemrc.parts import build_chat, build_loggers
from rolemrc.data.schemas import TestItem
from rolemrc.data.test_items import load_test_items  # noqa: F401 - re-exported for callers of eval.run
from rolemrc.eval.generation import (
    GenerationStore, build_judge, check_generation, generation_label, item_id, load_eval_model, model_label,
    prepare_generation,
)
from rolemrc.eval import dialogue, pairwise, reference
from rolemrc.eval.judge import (
    JudgeIncomplete, aggregate, judge_backend, judge_items, uses_evaluated_model,
)
from rolemrc.eval.metrics import (
    BertScoreConfig, MetricsResult, check_metrics, compute_metrics, rouge_l, rouge_scores, rouge_setting,
)
from rolemrc.eval.report import log_to_loggers, print_console, write_report  # noqa: F401 - print_console re-exported
from rolemrc.eval.suites import run_suites, wants_suites
from rolemrc.eval.verifiers import agreement, verify_all
from rolemrc.models.source import resolve_model_sources
from rolemrc.tasks import TASKS

log = logging.getLogger(__name__)



# ---------------------------------------------------------------- model + generation


def _pending(out_dir: Path, gen_items: Sequence[Any]) -> int:
    """How many of ``gen_items`` have no reply in ``<out_dir>/generations.jsonl`` yet."""
    done = GenerationStore(out_dir / "generations.jsonl").load()
    return sum(1 for it in gen_items if it.id not in done)


# ---------------------------------------------------------------- metrics + judge


def reference_metrics(m: Any, items: Sequence[TestItem], replies: Sequence[str], rolebench: bool) -> Any:
    """MetricsResult (``m``: the ``metrics`` group): ROUGE-L only for RoleBench / ``metrics.rouge_only``,
    else ``metrics.names``."""
    if rolebench:
        # Best ROUGE-L over the row's reference answers (RoleBench rows carry several).
        several = [it.extra.get("references") or [it.reference] for it in items]
        per = rouge_scores(replies, several, ("rougeL",), m.rouge_use_stemmer, m.rouge_target)["rougeL"]
        return MetricsResult({"rougeL": per}, {"rouge": rouge_setting(m.rouge_use_stemmer, m.rouge_target)})
    refs = [it.reference for it in items]
    if m.rouge_only:
        return rouge_l(replies, refs, m.rouge_use_stemmer, m.rouge_target)
    if not m.names:
        return None
    return compute_metrics(
        replies, refs,
        metrics=list(m.names),
        bertscore=_bertscore(m.bertscore),
        meteor_tokenizer=m.meteor_tokenizer,
        rouge_use_stemmer=m.rouge_use_stemmer,
        rouge_target=m.rouge_target,
        bleu_undefined=m.bleu_undefined,
    )


def _bertscore(bs: Any) -> BertScoreConfig:
    return BertScoreConfig(model=bs.model, num_layers=bs.num_layers, batch_size=bs.batch_size, device=bs.device)


# ---------------------------------------------------------------- loggers


def _scalars(metrics: Any, judge_table: Mapping[str, Any] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    if metrics is not None:
        for name, s in metrics.summary().items():
            out[f"eval/{name}"] = s["mean"]
    for dim, s in (judge_table or {}).items():
        if s.accuracy is not None:
            out[f"judge/{dim}/accuracy"] = s.accuracy
        if s.paper_score is not None:  # judge=paper: the authors' figure (Figure 4)
            out[f"judge/{dim}/paper_score"] = s.paper_score
        out[f"judge/{dim}/n_unparseable"] = float(s.n_unparseable)
        out[f"judge/{dim}/n_failed"] = float(s.n_failed)
    return out


# ---------------------------------------------------------------- the pipeline


def run(cfg: DictConfig) -> dict[str, Any]:
    """Evaluate as configured; returns paths, counts and the judge's run stats."""
    if dialogue.enabled(cfg):  # env=<name>: a conversation per seed, judged by turn (rolemrc.eval.dialogue)
        return dialogue.run_dialogues(cfg)
    check_data_dir(cfg.data)  # data=local without data.dir: named before anything loads
    compare_pairs = pairwise.enabled(cfg)
    if wants_suites(cfg):
        if compare_pairs:
            raise ConfigError("pairwise.against compares replies to test items (data=sample, rolemrc_test, local); "
                              f"data={cfg.data.name} is scored by its own benchmark suite: drop pairwise.against")  # RoleBench / CharacterLLM / lm-eval benchmarks: their own report
        return run_suites(cfg)


    # The door: the evaluated model and the judge, typed once (the model's path again once resolved).
    r, judging = Replier.of(cfg), Judging.of(cfg)
    # Checks in the order of relevance, all before anything slow: the model, the backend and the
    # judge (check_generation), then the test data, METEOR's data and BERTScore's encoder.
    backend = check_generation(r, judging.judge)
    refs = reference.picked(cfg.get("report"))  # report.reference: the published rows named
    if compare_pairs:
        pairwise.check(cfg.pairwise, judging.judge)  # a judge, B's replies files, the prompt template
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    items, rolebench = load_test_items(cfg.data, cfg.limit)
    if not (rolebench or cfg.metrics.rouge_only):
        check_metrics(list(cfg.metrics.names), cfg.metrics.meteor_tokenizer, _bertscore(cfg.metrics.bertscore))
    # Slow for a checkpoint or an adapter (exported or merged once): after every check.
    if backend.local:
        cfg, resolved = resolve_model_sources(cfg)
        r = replace(r, model=cfg.model)
    else:
        resolved = {}
    source = resolved.get("model.path")  # the checkpoint an export came from
    ids = [item_id(i, it.task, it.question) for i, it in enumerate(items)]
    log.info("evaluating %s on %d test items (%s)", model_label(r), len(items), cfg.data.name)

    model = tokenizer = None
    if backend.local:
        chat = build_chat(cfg.model)
        tokenizer = chat.tokenizer
        gen_items, stops = prepare_generation(r, items, ids, tokenizer, chat)
        # judge=hf judging with the evaluated model, which only a loaded model can be (a path-less,
        # random-init model); with a model.path the judge loads it itself when it has work.
        judge_needs_model = uses_evaluated_model(judging.judge) and r.model.path is None
        if backend.loads_model and (_pending(out_dir, gen_items) or judge_needs_model):
            model = load_eval_model(r, tokenizer)
        elif backend.loads_model:  # a finished folder: metrics and the judge from what is there
            log.info("generation: every reply is in %s: the model is not loaded", out_dir / "generations.jsonl")
        gen = backend.generate_local(r, gen_items, stops, tokenizer, model)
    else:
        gen = backend.generate_remote(r, items, ids)
    n_items = len(items)
    if gen.missing:  # generation.on_missing=skip: items without a reply are left out (counted)
        gone = set(gen.missing)
        items = [it for k, it in enumerate(items) if k not in gone]
        ids = [i for k, i in enumerate(ids) if k not in gone]
    replies = gen.replies
    log.info("generation: %d new, %d resumed from %s", gen.n_new, gen.n_resumed, out_dir / "generations.jsonl")

    metrics = reference_metrics(cfg.metrics, items, replies, rolebench)

    # The judge and the rule verifiers only apply to RoleMRC's 18 tasks.
    judged = [k for k, it in enumerate(items) if it.task in TASKS]
    verdicts = None
    judge_stats = None
    judge_model = None
    judge_protocol = None
    pairs = None
    if compare_pairs:  # the judge compares A with B instead of scoring the five dimensions
        with build_judge(judging, r, model, tokenizer) as judge:
            pairs = pairwise.judge_pairs(cfg.pairwise, judging, judge, items, replies, ids)
    elif judge_backend(judging.judge) is not None and judged:
        jitems = judge_items([items[k] for k in judged], [replies[k] for k in judged], [ids[k] for k in judged])
        with build_judge(judging, r, model, tokenizer) as judge:
            judge_model = judge.backend.model_id
            judge_protocol = judge.protocol.name
            verdicts = judge.judge(jitems)
            judge_stats = judge.last_stats
    elif judge_backend(judging.judge) is not None:
        log.info("judge skipped: no item belongs to a RoleMRC task")
    verifier = verify_all([items[k] for k in judged], [replies[k] for k in judged], [ids[k] for k in judged])
    agree = agreement(verdicts, verifier) if verdicts is not None and verifier else None

    bert = (metrics.info.get("bertscore") or {}).get("model") if metrics is not None else None
    meta: dict[str, Any] = {
        "name": f"{cfg.model.name} on {cfg.data.name}",
        "model": model_label(r),
        **({"model_checkpoint": source} if source else {}),
        "data": cfg.data.name,
        "items": len(items),
        "generation": generation_label(r),
        "restraint": cfg.restraint,
        "bertscore_model": bert,
        "judge_model": judge_model,
    }
    if gen.missing:
        meta["replies_missing"] = (f"{len(gen.missing)} of {n_items} test items have no reply in the file: left out "
                                   "(generation.on_missing=skip)")
    if judge_protocol:
        meta["judge_protocol"] = judge_protocol
    if pairs is not None:
        meta["judge_model"] = pairs["judge_model"]
        meta["judge_mode"] = f"pairwise, A = {model_label(r)} vs B = {', '.join(pairs['opponents'])} (both orders)"
    if verifier:
        meta["rule_verifier"] = f"{sum(verifier.values())}/{len(verifier)} replies obey their NI rule"
    statuses = {}
    if verdicts is not None:
        for v in verdicts:
            statuses[v.status] = statuses.get(v.status, 0) + 1
    extra = {
        "counts": {
            "items": len(items),
            "generated": gen.n_new,
            "resumed": gen.n_resumed,
            "cut_at_max_new_tokens": gen.n_cut,
            "replies_missing": len(gen.missing),
            "replies_unmatched": gen.unmatched,
            "generation_requests": gen.requests,
            "generation_faults": gen.faults,
            "judged_items": len(judged) if verdicts is not None else 0,
            "judgements": len(verdicts) if verdicts is not None else 0,
            "judgement_status": statuses,
            "judge_cache_hits": judge_stats.cache_hits if judge_stats else 0,
            "judge_requests": judge_stats.requests if judge_stats else 0,
            "judge_faults": judge_stats.faults if judge_stats else {},
            "rule_items": len(verifier),
            "rule_passed": sum(verifier.values()),
        },
        "rule_verifier": verifier,
    }
    sections: list[str] = []
    if pairs is not None:
        extra["pairwise"] = {k: v for k, v in pairs.items() if k != "pairs"}
        sections.append(pairwise.render(pairs, model_label(r)))
    table = aggregate(verdicts) if verdicts is not None else None
    scalars = _scalars(metrics, table)
    if pairs is not None:
        scalars.update(pairwise.scalars(pairs))
    ref_section = reference.section(refs, scalars)
    if ref_section:
        sections.append(ref_section)
        extra["reference"] = reference.logger_rows(refs, scalars)
    paths = write_report(out_dir, metrics=metrics, verdicts=verdicts, agreement=agree, meta=meta, extra=extra,
                         sections=sections)
    if pairs is not None:
        paths["pairwise.jsonl"] = pairwise.write_pairs(out_dir, pairs)

    columns = ["id", "task", "question", "reply", "reference"]
    rows = [[i, it.task, it.question[-1]["content"], r, it.reference] for i, it, r in zip(ids, items, replies)]
    log_to_loggers(build_loggers(cfg) if cfg.logger else [], scalars, rows, columns,
                   tables=reference.logger_tables(refs, scalars))

    print_console(paths["summary.md"], metrics=metrics, judge=table, sections=sections)
    if pairs is not None and pairs.get("missing"):
        # Promised comparisons are missing: never exit 0; what was decided is in the report.
        raise JudgeIncomplete(f"{pairs['missing']}; the report in {out_dir} holds what was obtained; rerun the same "
                              "command to ask only for the rest")
    if verdicts is not None and judge_stats is not None:
        missing = judge_stats.missing(verdicts, final_unparseable=not getattr(judge.backend, "retries_unparseable", True))
        if missing:
            # Promised work is missing: never exit 0. Generations, metrics and the verdicts obtained are kept.
            raise JudgeIncomplete(
                f"judge: {len(verdicts) - sum(missing.values())} of {len(verdicts)} verdicts obtained, missing "
                f"{', '.join(f'{n} {s}' for s, n in missing.items())} (faults: {judge_stats.fault_text()}); "
                f"the report in {out_dir} holds what was obtained; rerun the same command to ask only for the rest"
            )
    return {
        "out_dir": str(out_dir),
        "paths": {k: str(p) for k, p in paths.items()},
        "generation": gen,
        "judge_stats": judge_stats,
        "metrics": metrics,
        "verdicts": verdicts,
        "pairwise": pairs,
        "ids": ids,
    }
