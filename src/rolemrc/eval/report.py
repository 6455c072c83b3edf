"""Write an evaluation's results: ``metrics.json``, ``judge.jsonl`` and ``summary.md``.

``metrics.json`` holds everything numeric (metric summaries and per-sample scores with their
provenance, judge accuracy and counts per dimension, verifier agreement); ``judge.jsonl`` one
raw verdict per line; ``summary.md`` the human-readable tables (Table-3-style metric rows,
per-dimension judge table, judge-vs-verifier agreement).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from rolemrc.eval.judge import STATUSES, DimensionSummary, Verdict, aggregate
from rolemrc.eval.metrics import DISPLAY_NAMES, MetricsResult
from rolemrc.eval.verifiers import Agreement
from rolemrc.tasks import Dimension


def _clean(x: Any) -> Any:
    """NaN/inf -> None so metrics.json is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, Mapping):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def fmt(x: float | None, digits: int = 2) -> str:
    """A figure of a report's table: ``digits`` decimals, ``n/a`` for none."""
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def mean(xs: Sequence[float | None]) -> float | None:
    """The mean of the values that are not None; None when there is none."""
    got = [x for x in xs if x is not None]
    return sum(got) / len(got) if got else None


def pct(x: float | None) -> str:
    """A share as a percentage with two decimals, ``n/a`` for none."""
    return "n/a" if x is None else f"{100 * x:.2f}%"


PAPER_SCORE_NOTE = (
    "paper score (Figure 4): what RoleMRC's evaluation/llm_judge.py computes from the same answers: \"Score:\" "
    "removed, then Python's int() (so \"01\", \"+1\", \"-1\", \"2\" count as those numbers), any other answer, an "
    "empty one included, scored 0, averaged over the requests as that script sends them (instruction-priority "
    "items asked twice); compare this column with the paper's Figure 4."
)


def judge_table(judge: Mapping[str, DimensionSummary]) -> list[str]:
    """The per-dimension judge table (markdown lines), both accuracies side by side, and the
    authors' figure (``paper_score``) first where the paper protocol produced it."""
    paper = any(s.paper_score is not None for s in judge.values())
    head = "| dimension |" + (" paper score (Figure 4) |" if paper else "")
    lines = [
        head + " accuracy (parseable) | accuracy (unparseable = 0) | n ok | unparseable | failed | budget exhausted |",
        "|---|" + ("---|" if paper else "") + "---|---|---|---|---|---|",
    ]
    for short, s in judge.items():
        title = Dimension[short].title if short in Dimension.__members__ else short
        col = f" {fmt(s.paper_score, 4)} ({s.n_paper_requests} requests) |" if paper else ""
        lines.append(
            f"| {title} ({short}) |{col} {pct(s.accuracy)} | {pct(s.accuracy_unparseable_as_0)} | {s.n_ok} | "
            f"{s.n_unparseable} | {s.n_failed} | {s.n_budget_exhausted} |"
        )
    return lines


def status_table(columns: Sequence[str], rows: Iterable[tuple[Sequence[str], Mapping[str, int]]]) -> list[str]:
    """A judged suite's answers by status (markdown lines): the ``columns`` named, then scored,
    unparseable, failed and budget exhausted, from each row's counts by status (a missing one 0)."""
    lines = ["| " + " | ".join(columns) + " | scored | unparseable | failed | budget exhausted |",
             "|" + "---|" * (len(columns) + 4)]
    return lines + ["| " + " | ".join([*cells, *(str(n.get(s, 0)) for s in STATUSES)]) + " |" for cells, n in rows]


def metrics_table(metrics: MetricsResult) -> list[str]:
    """Reference metrics, mean ± population std (markdown lines)."""
    lines = ["| metric | mean ± std | n |", "|---|---|---|"]
    for name, s in metrics.summary().items():
        n = f"{s['n']}" + (f" ({s['n_undefined']} undefined, left out)" if s.get("n_undefined") else "")
        lines.append(f"| {DISPLAY_NAMES.get(name, name)} | {fmt(s['mean'], 4)} ± {fmt(s['std'], 4)} | {n} |")
    return lines


def settings_lines(info: Mapping[str, Any]) -> list[str]:
    """One line per metric naming its exact setting (the ``call`` recorded in metrics.json)."""
    out = []
    for key, label in (("bleu", "BLEU"), ("rouge", "ROUGE"), ("meteor", "METEOR"), ("bertscore", "BERTScore")):
        v = info.get(key)
        if v is None:
            continue
        if isinstance(v, Mapping):
            extra = f"; undefined samples: {v['undefined_rule']}" if "undefined_rule" in v else ""
            out.append(f"- {label}: {v.get('call', v)}{extra}")
        else:
            out.append(f"- {label}: {v}")
    return out


def render_summary(
    *,
    metrics: MetricsResult | None = None,
    judge: Mapping[str, DimensionSummary] | None = None,
    agreement: Agreement | None = None,
    meta: Mapping[str, Any] | None = None,
    sections: Sequence[str] = (),
) -> str:
    """The markdown of ``summary.md``; ``sections``: more markdown appended (RoleBench,
    CharacterLLM, General Δ tables: :mod:`rolemrc.eval.suites`)."""
    meta = dict(meta or {})
    lines = [f"# Evaluation: {meta.get('name', 'rolemrc')}", ""]
    for k, v in meta.items():
        if k != "name":
            lines.append(f"- {k}: {v}")
    if len(lines) > 2:
        lines.append("")

    if metrics is not None:
        lines += [f"## Reference-based metrics (n = {metrics.n}; mean ± population std per sample)", ""]
        lines += metrics_table(metrics)
        bs = metrics.info.get("bertscore")
        if bs:
            lines += ["", f"BERTScore model: {bs['model']}, layer {bs['num_layers']}, no baseline rescaling."]
        settings = settings_lines(metrics.info)
        if settings:
            lines += ["", "Settings (as recorded in metrics.json, `metrics.info`):", *settings]
        lines.append("")

    if judge is not None:
        model = meta.get("judge_model")
        lines += [f"## LLM judge{f' ({model})' if model else ''}", ""]
        lines += judge_table(judge)
        protocol = meta.get("judge_protocol")
        paper = any(s.paper_score is not None for s in judge.values())
        lines += [
            "",
            *([PAPER_SCORE_NOTE, ""] if paper else []),
            "accuracy (parseable): over the verdicts that parsed (exactly 0 or 1), one per item and dimension; "
            "accuracy (unparseable = 0): the same with every unparseable answer scored 0. Failed and unsent "
            "judgements are counted, never scored."
            + (f" Protocol: {protocol}." if protocol else ""),
            "",
        ]

    if agreement is not None:
        c = agreement.confusion
        lines += ["## NI rule verifier vs judge", ""]
        lines.append(
            f"Agreement {pct(agreement.rate)} over {agreement.n} items with both a rule and a usable "
            f"judge verdict ({agreement.n_without_verdict} rule items without one)."
        )
        lines += [
            "",
            "| | verifier: pass | verifier: fail |",
            "|---|---|---|",
            f"| judge: 1 | {c['judge1_verifier1']} | {c['judge1_verifier0']} |",
            f"| judge: 0 | {c['judge0_verifier1']} | {c['judge0_verifier0']} |",
            "",
        ]
    lines += list(sections)
    return "\n".join(lines)


def write_report(
    out_dir: str | Path,
    *,
    metrics: MetricsResult | None = None,
    verdicts: Sequence[Verdict] | None = None,
    agreement: Agreement | None = None,
    meta: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    sections: Sequence[str] = (),
) -> dict[str, Path]:
    """Write the report files that have content; returns {name: path}.

    ``extra``: more top-level sections for ``metrics.json`` only (counts, per-item checks).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    judge = aggregate(verdicts) if verdicts is not None else None
    paths: dict[str, Path] = {}

    doc: dict[str, Any] = {"meta": dict(meta or {})}
    if metrics is not None:
        doc["metrics"] = metrics.to_dict()
    if judge is not None:
        doc["judge"] = {k: s.to_dict() for k, s in judge.items()}
    if agreement is not None:
        doc["verifier_agreement"] = agreement.to_dict()
    for key, value in (extra or {}).items():
        if key in doc:
            raise ValueError(f"write_report: extra section {key!r} would overwrite a standard one")
        doc[key] = value
    paths["metrics.json"] = out / "metrics.json"
    paths["metrics.json"].write_text(json.dumps(_clean(doc), indent=2, allow_nan=False) + "\n", encoding="utf-8")

    if verdicts is not None:
        paths["judge.jsonl"] = out / "judge.jsonl"
        with paths["judge.jsonl"].open("w", encoding="utf-8") as f:
            for v in verdicts:
                f.write(json.dumps(v.to_dict(), ensure_ascii=False) + "\n")

    paths["summary.md"] = out / "summary.md"
    paths["summary.md"].write_text(
        render_summary(metrics=metrics, judge=judge, agreement=agreement, meta=meta, sections=sections),
        encoding="utf-8",
    )
    return paths


def log_to_loggers(loggers: list[Any], scalars: Mapping[str, float], rows: list[list[Any]], columns: list[str], *,
                   tables: Mapping[str, tuple[list[str], list[list[Any]]]] | None = None,
                   images: Mapping[str, Path] | None = None) -> None:
    """Scalars to each of ``loggers`` (:func:`rolemrc.parts.build_loggers`); the samples table and
    ``tables`` (key -> (columns, rows)) to those that take tables, ``images`` (key -> PNG) to those
    that take images (W&B)."""
    for lg in loggers:
        lg.log_metrics(dict(scalars), step=0)
        if hasattr(lg, "log_table"):
            lg.log_table(key="samples", columns=columns, data=rows)
            for key, (cols, data) in (tables or {}).items():
                lg.log_table(key=key, columns=cols, data=data)
        if hasattr(lg, "log_image"):
            for key, path in (images or {}).items():
                lg.log_image(key=key, images=[str(path)])
        lg.finalize("success")
        if type(lg).__name__ == "WandbLogger":
            lg.experiment.finish()  # flush now: tests and sweeps run several evaluations per process


def unparseable_warning(judge: Mapping[str, DimensionSummary] | None) -> str | None:
    """A console warning when most judge answers did not parse, with the counts."""
    if not judge:
        return None
    bad = sum(s.n_unparseable for s in judge.values())
    answered = bad + sum(s.n_ok for s in judge.values())
    if not answered or bad * 2 <= answered:
        return None
    check = "check judge.model, judge.max_tokens and judge.protocol (raw answers in judge.jsonl)"
    if bad == answered:
        return f"warning: judge: all {answered} answers were unparseable, so there is no accuracy: {check}"
    return (f"warning: judge: {bad} of {answered} answers were unparseable ({answered - bad} parseable); "
            f"the accuracies rest on those {answered - bad} verdicts: {check}")


def print_console(summary: Path, *, metrics: MetricsResult | None = None,
                  judge: Mapping[str, DimensionSummary] | None = None, sections: Sequence[str] = ()) -> None:
    """The headline tables on the console at the end of a run, then the summary's path; a
    warning line (stderr) when most judge answers were unparseable."""
    import sys

    out: list[str] = []
    if metrics is not None:
        out += [f"Reference metrics (n = {metrics.n}; mean ± population std):", *metrics_table(metrics)]
        bs = metrics.info.get("bertscore")
        if bs:
            out.append(f"BERTScore model: {bs['model']}, layer {bs['num_layers']}, no baseline rescaling.")
        out.append("")
    if judge:
        out += ["LLM judge:", *judge_table(judge), ""]
    out += list(sections)
    out.append(f"evaluation summary: {summary}")
    print("\n".join(out), flush=True)
    warning = unparseable_warning(judge)
    if warning:
        print(warning, file=sys.stderr, flush=True)
