"""Published figures set beside this run's (``report.reference``): a table per benchmark in
``summary.md`` and a ``reference`` table for W&B.

Each benchmark's published rows live in one YAML file, shipped under
``rolemrc/assets/reference/<benchmark>.yaml`` or given in ``report.reference_files``::

    benchmark: personagym                 # one name per file
    title: PersonaGym (PersonaScore, 1-5)
    digits: 2                             # decimals shown
    columns:                              # the figures, in order
      - {key: persona_score, label: PersonaScore, scalar: personagym/persona_score}
    rows:
      - model: gpt-3.5                    # what report.reference names (case-insensitive)
        source: "paper or file, table"    # where the figures were published
        figures: {persona_score: 4.38}    # a column's key -> the published value (a column may be absent)

``scalar`` is the name of this run's figure that sits beside the column (the same name as in
``metrics.json``'s scalars and the loggers; ``scale`` multiplies it into the published unit);
without one the column has no figure of this run. Every fault in a file is a one-line
:class:`rolemrc.errors.ConfigError` naming the file and the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from rolemrc import asset
from rolemrc.errors import ConfigError
from rolemrc.eval.report import fmt
from rolemrc.fileio import read_mapping


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    scalar: str | None = None
    scale: float = 1.0


@dataclass(frozen=True)
class Row:
    model: str
    source: str
    figures: dict[str, float]
    note: str | None = None


@dataclass(frozen=True)
class Table:
    benchmark: str
    title: str
    columns: tuple[Column, ...]
    rows: tuple[Row, ...]
    path: str
    digits: int = 2
    note: str | None = None


def shipped_files() -> list[Path]:
    """The reference files shipped with rolemrc (``rolemrc/assets/reference/*.yaml``)."""
    return sorted(Path(asset("reference")).glob("*.yaml"))


def _need(doc: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    v = doc.get(key)
    if not isinstance(v, kind) or (isinstance(v, (str, list, dict)) and not v):
        raise ConfigError(f"{where}: '{key}' must be a non-empty {getattr(kind, '__name__', 'value')}")
    return v


def load_table(path: str | Path) -> Table:
    """One reference file, checked (see the module's docstring for the layout)."""
    p, doc = read_mapping(path, "report.reference_files", "a mapping with benchmark, title, columns, rows")
    unknown = sorted(set(doc) - {"benchmark", "title", "digits", "columns", "rows", "note"})
    if unknown:
        raise ConfigError(f"{p}: unknown key {unknown[0]!r}; keys: benchmark, title, digits, columns, rows, note")
    columns = []
    for i, c in enumerate(_need(doc, "columns", list, str(p))):
        where = f"{p}: columns[{i}]"
        if not isinstance(c, dict) or set(c) - {"key", "label", "scalar", "scale"}:
            raise ConfigError(f"{where}: expected {{key, label, scalar?, scale?}}, got {c!r}")
        scale = c.get("scale", 1.0)
        if not isinstance(scale, (int, float)) or isinstance(scale, bool):
            raise ConfigError(f"{where}: 'scale' must be a number")
        columns.append(Column(str(_need(c, "key", str, where)), str(_need(c, "label", str, where)),
                              c.get("scalar"), float(scale)))
    keys = [c.key for c in columns]
    rows = []
    for i, r in enumerate(_need(doc, "rows", list, str(p))):
        where = f"{p}: rows[{i}]"
        if not isinstance(r, dict) or set(r) - {"model", "source", "figures", "note"}:
            raise ConfigError(f"{where}: expected {{model, source, figures, note?}}, got {r!r}")
        figures = _need(r, "figures", dict, where)
        for k, v in figures.items():
            if k not in keys:
                raise ConfigError(f"{where}: figures.{k} is not a column; columns: {', '.join(keys)}")
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ConfigError(f"{where}: figures.{k} must be a number, got {v!r}")
        rows.append(Row(str(_need(r, "model", (str, int, float), where)), str(_need(r, "source", str, where)),
                        {k: float(v) for k, v in figures.items()}, r.get("note")))
    return Table(str(_need(doc, "benchmark", str, str(p))), str(_need(doc, "title", str, str(p))), tuple(columns),
                 tuple(rows), str(p), int(doc.get("digits", 2)), doc.get("note"))


def load_tables(extra: Sequence[str] = ()) -> list[Table]:
    """The shipped tables, then the user's (``report.reference_files``); a user's file for a
    benchmark that is shipped adds its rows to that benchmark's table."""
    out: dict[str, Table] = {}
    for path in [*shipped_files(), *extra]:
        t = load_table(path)
        if t.benchmark in out:
            old = out[t.benchmark]
            if [c.key for c in t.columns] != [c.key for c in old.columns][: len(t.columns)]:
                raise ConfigError(f"{t.path}: benchmark {t.benchmark!r} is already defined by {old.path} with the "
                                  f"columns {', '.join(c.key for c in old.columns)}; use the same columns")
            t = Table(old.benchmark, old.title, old.columns, old.rows + t.rows, old.path, old.digits, old.note)
        out[t.benchmark] = t
    return list(out.values())


def select(tables: Sequence[Table], names: Sequence[str]) -> list[tuple[Table, list[Row]]]:
    """The rows ``names`` pick (by model name, case-insensitive), per table; a name that no table
    has is a ConfigError listing the known names."""
    wanted = [str(n).strip().lower() for n in names]
    known = {r.model.lower() for t in tables for r in t.rows}
    missing = [n for n in names if str(n).strip().lower() not in known]
    if missing:
        listing = "; ".join(f"{t.benchmark}: {', '.join(r.model for r in t.rows)}" for t in tables)
        raise ConfigError(f"report.reference: no published row named {missing[0]!r}; known: {listing} "
                          "(or add a file in report.reference_files)")
    out = []
    for t in tables:
        rows = [r for n in wanted for r in t.rows if r.model.lower() == n]
        if rows:
            out.append((t, rows))
    return out


def evaluated(t: Table, scalars: Mapping[str, float]) -> bool:
    """This run has figures of the benchmark: a column's scalar, or any ``<benchmark>/...`` scalar."""
    return any(c.scalar in scalars for c in t.columns if c.scalar) or any(k.startswith(f"{t.benchmark}/")
                                                                        for k in scalars)


def section(picked: Sequence[tuple[Table, list[Row]]], scalars: Mapping[str, float]) -> str | None:
    """Markdown: per benchmark this run evaluated (some column's scalar present), this run's row
    and the picked published rows, then each row's source. None when nothing is picked."""
    if not picked:
        return None
    lines = ["## Reference figures (published rows named in report.reference)", ""]
    skipped = []
    for t, rows in picked:
        mine = {c.key: scalars[c.scalar] * c.scale for c in t.columns if c.scalar and c.scalar in scalars}
        if not evaluated(t, scalars):
            skipped.append(t.title)
            continue
        lines += [f"### {t.title}", "", "| model | " + " | ".join(c.label for c in t.columns) + " |",
                  "|---|" + "---|" * len(t.columns),
                  "| this run | " + " | ".join(fmt(mine.get(c.key), t.digits) for c in t.columns) + " |"]
        for r in rows:
            lines.append(f"| {r.model} | " + " | ".join(fmt(r.figures.get(c.key), t.digits) for c in t.columns) + " |")
        lines.append("")
        lines += [f"- {r.model}: {r.source}" + (f" ({r.note})" if r.note else "") for r in rows]
        if t.note:
            lines.append(f"- {t.note}")
        lines.append("")
    if skipped:
        lines += [f"Not evaluated in this run, so not shown: {', '.join(skipped)}.", ""]
    return "\n".join(lines)


def picked(report: Any) -> list[tuple[Table, list[Row]]]:
    """The rows ``report.reference`` names (``report.reference_files`` added to the shipped
    tables; ``report``: the ``report`` group, or None); [] when it names none. Called before
    anything slow, so a bad name fails first."""
    names = list(getattr(report, "reference", None) or [])
    if not names:
        return []
    return select(load_tables([str(f) for f in report.reference_files or []]), names)


COLUMNS = ["benchmark", "model", "figure", "value", "source"]


def logger_rows(picked: Sequence[tuple[Table, list[Row]]], scalars: Mapping[str, float]) -> list[list[Any]]:
    """``[benchmark, model, figure, value, source]`` rows: this run's figures and the picked
    published ones, for the loggers' ``reference`` table (W&B)."""
    out: list[list[Any]] = []
    for t, rows in picked:
        if not evaluated(t, scalars):
            continue
        for c in t.columns:
            if c.scalar and c.scalar in scalars:
                out.append([t.benchmark, "this run", c.label, scalars[c.scalar] * c.scale, ""])
        for r in rows:
            out += [[t.benchmark, r.model, c.label, r.figures[c.key], r.source] for c in t.columns if c.key in r.figures]
    return out


def logger_tables(picked: Sequence[tuple[Table, list[Row]]], scalars: Mapping[str, float]) -> dict[str, Any]:
    """``{"reference": (COLUMNS, rows)}`` for :func:`rolemrc.eval.report.log_to_loggers`; {} without rows."""
    rows = logger_rows(picked, scalars)
    return {"reference": (COLUMNS, rows)} if rows else {}
