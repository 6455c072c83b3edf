"""RoleBench scored the way RoleLLM reports it (RoleMRC paper, Table 4).

``data.rolebench.root`` is a folder in RoleBench's public layout (``ZenMoore/RoleBench``)::

    profiles-eng/desc.json, profiles-zh/desc.json          {role name: description}
    rolebench-eng/instruction-generalization/{general,role_specific}/test.jsonl
    rolebench-eng/role-generalization/{general,role_specific}/test.jsonl
    rolebench-zh/{general,role_specific}/test.jsonl
    instructions-eng/instructions-general.jsonl             RAW answers (see below)

Rows are ``{"role", "question", "generated": [answers]}`` (the field names OpenCompass's
RoleBench loader reads too). Each row becomes a RoCIT prompt (:mod:`rolemrc.data.roles`:
the role's profile from ``desc.json``, plus ``data.roles.profiles``, through
``data.roles.template``) and the model's greedy reply is scored with ROUGE F-measure against
the row's answers (several answers: the best per ROUGE type, rouge_score's ``score_multi``):

- **CUS**: general instructions against the role-customised answers (``general/test.jsonl``),
  speaking style;
- **RAW**: the same replies against the general instructions' original answers, found by the
  question text in ``raw_answers[<lang>]`` (assumed rows ``{question, answer}``; the field names
  are ``raw_question_field``/``raw_answer_field``). A question without a raw answer is counted
  (``raw_missing``), never scored 0. The public release carries no RAW answers at all: when the
  file is not there, RAW is left out with one warning and every general item counted in
  ``raw_missing`` (not an error); ``raw_answers.<lang>: null`` leaves RAW out silently;
- **SPE**: role-specific questions (``role_specific/test.jsonl``), role knowledge.

ROUGE-1/2/L/Lsum F-measure. English: rouge_score's tokenizer with Porter stemming, as the
authors' script (``metrics.rouge_use_stemmer``, ``metrics.rouge_target``:
:func:`rolemrc.eval.metrics.rouge_scores`). Chinese: one token per non-space character
(``chinese_tokenizer: char``; rouge_score's default tokenizer would drop every CJK character), no
stemming. The settings are written into ``metrics.json`` and ``summary.md``. ``limit=N`` keeps the
first N rows of each test file.

With ``generation.backend=file`` the replies come from a file (e.g. RoleBench's own
``rolegpt_baseline.jsonl``), matched by role + question; the prompts are then never used, so
missing ``profiles-*/desc.json`` (the GitHub release has none) only gives a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from rolemrc.config import plain
from rolemrc.data.readers import iter_source, read_examples
from rolemrc.data.roles import RoleSystem
from rolemrc.data.schemas import DataError, TestItem
from rolemrc.errors import ConfigError, InputNotFound
from rolemrc.eval.metrics import rouge_scores, rouge_setting
from rolemrc.eval.report import mean

log = logging.getLogger(__name__)

ROUGE = ("rouge1", "rouge2", "rougeL", "rougeLsum")
SETS = ("RAW", "CUS", "SPE")
# config name -> (table label, language, folder under root)
SPLITS = {
    "instruction_generalization_eng": ("InstEng", "eng", "rolebench-eng/instruction-generalization"),
    "role_generalization_eng": ("RoleEng", "eng", "rolebench-eng/role-generalization"),
    "instruction_generalization_zh": ("InstZh", "zh", "rolebench-zh"),
}
def english_tokenization(use_stemmer: bool) -> str:
    return ("rouge_score default tokenizer (lowercase, non-alphanumerics dropped)"
            + (" + Porter stemmer (use_stemmer=True)" if use_stemmer else ", no stemming (use_stemmer=False)"))
CHINESE_TOKENIZATION = {
    "char": "character-level: every non-whitespace character is one token (no stemming, no lowercasing)",
    "whitespace": "whitespace-separated tokens (no stemming, no lowercasing)",
}


class CharTokenizer:
    """rouge_score tokenizer: one token per non-whitespace character (Chinese)."""

    def tokenize(self, text: str) -> list[str]:
        return [c for c in text if not c.isspace()]


class WhitespaceTokenizer:
    def tokenize(self, text: str) -> list[str]:
        return text.split()


def chinese_rouge(predictions: Sequence[str], references: Sequence[Sequence[str]], mode: str = "char",
                  types: Sequence[str] = ROUGE, target: str = "reply") -> dict[str, list[float]]:
    """F-measure per sample with rouge_score and a character (or whitespace) tokenizer; several
    references: the best per type; ``target`` as in :func:`rolemrc.eval.metrics.rouge_scores`."""
    if mode not in CHINESE_TOKENIZATION:
        raise ConfigError(f"data.rolebench.chinese_tokenizer must be one of {sorted(CHINESE_TOKENIZATION)}, got {mode!r}")
    tok = CharTokenizer() if mode == "char" else WhitespaceTokenizer()
    return rouge_scores(predictions, [list(r) for r in references], types, False, target,  # type: ignore[arg-type]
                        tokenizer=tok)


def rouge(lang: str, predictions: Sequence[str], references: Sequence[Sequence[str]], zh_mode: str,
          use_stemmer: bool = True, target: str = "reply") -> dict[str, list[float]]:
    if lang == "zh":
        return chinese_rouge(predictions, references, zh_mode, target=target)

    return rouge_scores(predictions, [list(r) for r in references], ROUGE, use_stemmer, target)


@dataclass
class RBItem:
    split: str  # InstEng | RoleEng | InstZh
    lang: str
    subset: str  # general | role_specific
    item: TestItem
    raw: str | None = None  # the original answer (general subset)


def _raw_answers(path: Path, qfield: str, afield: str) -> dict[str, str]:
    out: dict[str, str] = {}
    errors = []
    for file, line, rec in iter_source({"path": str(path)}):
        if not isinstance(rec, dict) or not isinstance(rec.get(qfield), str) or not isinstance(rec.get(afield), str):
            have = ", ".join(map(str, rec)) if isinstance(rec, dict) else type(rec).__name__
            errors.append(f"{file}:{line}: RAW row needs string fields {qfield!r} and {afield!r} (has: {have})")
            continue
        out[rec[qfield].strip()] = rec[afield]
    if errors:
        raise DataError(f"{len(errors)} invalid RAW answer row(s) (data.rolebench.raw_question_field / "
                        "raw_answer_field name the fields):\n  " + "\n  ".join(errors[:20]))
    return out


def load_items(data: Any, limit: int | None, need_prompts: bool = True) -> tuple[list[RBItem], dict[str, str]]:
    """Every test row of the configured splits, validated (file:line errors), RoCIT prompts;
    and ``{lang: why}`` for the languages whose RAW answers are absent (left out, warned once).
    ``need_prompts=False`` (replies from a file): a missing ``desc.json`` is only a warning."""
    rb = data.rolebench
    root = Path(str(rb.root)).expanduser()
    if not root.is_dir():
        raise InputNotFound(f"data.rolebench.root: not a folder: {root} (put RoleBench's files there, see README)")
    roles = plain(data.roles) or {}
    raw_cfg = plain(rb.raw_answers) or {}
    unknown = [s for s in rb.splits if s not in SPLITS]
    if unknown:
        raise ConfigError(f"data.rolebench.splits: unknown {unknown}; known: {', '.join(SPLITS)}")
    if limit is not None and limit < 1:
        raise ConfigError(f"limit must be >= 1 (or null for all items), got {limit}")
    out: list[RBItem] = []
    raw_absent: dict[str, str] = {}
    raw_loaded: dict[str, dict[str, str]] = {}
    for name in rb.splits:
        label, lang, folder = SPLITS[name]
        desc = root / f"profiles-{lang}" / "desc.json"
        if desc.is_file():
            src_roles = dict(roles, profiles=[str(desc)] + list(roles.get("profiles") or []))
        elif need_prompts:
            raise InputNotFound(f"RoleBench profiles not found: {desc} (data.rolebench.root={root})")
        else:
            log.warning("RoleBench profiles not found: %s; the replies come from a file, so the prompts "
                        "(which would need them) are not used", desc)
            src_roles = dict(roles, strict=False)
        raw: dict[str, str] | None = None
        if raw_cfg.get(lang) and lang not in raw_absent:
            raw_path = root / raw_cfg[lang]
            if raw_path.is_file():
                if lang not in raw_loaded:
                    raw_loaded[lang] = _raw_answers(raw_path, rb.raw_question_field, rb.raw_answer_field)
                raw = raw_loaded[lang]
            else:
                # The public release has no RAW answers: RAW is left out (counted), not an error.
                raw_absent[lang] = f"RAW answers not found: {raw_path} (data.rolebench.raw_answers.{lang})"
                log.warning("%s; RAW is left out for %s (set data.rolebench.raw_answers.%s=null to silence this)",
                            raw_absent[lang], lang, lang)
        for subset in ("general", "role_specific"):
            path = root / folder / subset / "test.jsonl"
            items, _ = read_examples([{"path": str(path), "format": "rolebench", "roles": src_roles}], "test",
                                     on_error=data.on_error)
            if limit is not None:
                items = items[:limit]
            for it in items:
                answer = raw.get(it.question[-1]["content"].strip()) if raw is not None and subset == "general" else None
                out.append(RBItem(label, lang, subset, it, answer))
    if not out:
        raise DataError("the RoleBench test files hold no items")
    return out, raw_absent


def score(items: Sequence[RBItem], replies: Sequence[str], zh_mode: str = "char",
          raw_enabled: dict[str, bool] | None = None, use_stemmer: bool = True,
          target: str = "reply") -> dict[str, Any]:
    """``{"splits": {label: {RAW|CUS|SPE: {rouge1, rouge2, rougeL, rougeLsum, n}}}, "per_item": [...], ...}``."""
    per_item: list[dict[str, Any]] = []
    buckets: dict[tuple[str, str], dict[str, list[float]]] = {}
    langs = {}
    groups: dict[tuple[str, str, str], list[tuple[int, list[str]]]] = {}
    raw_missing: dict[str, int] = {}
    for k, it in enumerate(items):
        langs[it.split] = it.lang
        refs = it.item.extra.get("references") or [it.item.reference]
        per_item.append({"split": it.split, "subset": it.subset, "origin": it.item.origin,
                         "role": it.item.extra.get("rolebench_role"), "reply": replies[k]})
        if it.subset == "role_specific":
            groups.setdefault((it.split, "SPE", it.lang), []).append((k, refs))
            continue
        groups.setdefault((it.split, "CUS", it.lang), []).append((k, refs))
        if it.raw is not None:
            groups.setdefault((it.split, "RAW", it.lang), []).append((k, [it.raw]))
        elif (raw_enabled or {}).get(it.lang, True):
            raw_missing[it.split] = raw_missing.get(it.split, 0) + 1
    for (split, kind, lang), members in groups.items():
        s = rouge(lang, [replies[k] for k, _ in members], [r for _, r in members], zh_mode, use_stemmer, target)
        buckets[(split, kind)] = s
        for j, (k, _) in enumerate(members):
            per_item[k][kind] = {t: s[t][j] for t in ROUGE}
    splits: dict[str, dict[str, Any]] = {}
    for split in dict.fromkeys(it.split for it in items):
        row: dict[str, Any] = {}
        for kind in SETS:
            s = buckets.get((split, kind))
            row[kind] = ({**{t: mean(s[t]) for t in ROUGE}, "n": len(s["rougeL"])} if s else None)
        vals = [row[k]["rougeL"] for k in SETS if row[k] is not None]
        row["avg_rougeL"] = mean(vals)
        if raw_missing.get(split):
            row["raw_missing"] = raw_missing[split]
        splits[split] = row

    settings = {}
    for lang in dict.fromkeys(langs.values()):
        st = rouge_setting(use_stemmer if lang != "zh" else False, target, ROUGE)
        if lang == "zh":
            st["tokenizer"] = f"{zh_mode}: {CHINESE_TOKENIZATION[zh_mode]}"
            st["call"] = st["call"].replace("use_stemmer=False", f"tokenizer=<{zh_mode} tokenizer>")
        st["several_references"] = "best F-measure per ROUGE type over the row's reference answers (score_multi's rule)"
        settings[lang] = st
    return {
        "splits": splits,
        "tokenization": {lang: (CHINESE_TOKENIZATION[zh_mode] if lang == "zh" else english_tokenization(use_stemmer))
                         for lang in dict.fromkeys(langs.values())},
        "rouge": settings,  # per language: the exact call (read back by the tests)
        "per_item": per_item,
    }


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}"


def render(res: dict[str, Any]) -> str:
    """Markdown: RoleLLM's RAW/CUS/SPE ROUGE-L table, then ROUGE-1/2/L per split and set."""
    lines = ["## RoleBench (RoleLLM metrics; RoleMRC paper Table 4)", "",
             "ROUGE-L F x 100 per split: RAW = general instructions vs their original answers, CUS = vs the "
             "role-customised answers (speaking style), SPE = role-specific questions (role knowledge).", "",
             "| split | RAW | CUS | SPE | avg |", "|---|---|---|---|---|"]
    for split, row in res["splits"].items():
        cells = [_f(row[k]["rougeL"]) if row[k] else "n/a" for k in SETS]
        lines.append(f"| {split} | {' | '.join(cells)} | {_f(row['avg_rougeL'])} |")
    lines += ["", *detail_table(res)]
    lines.append("")
    for split, row in res["splits"].items():
        if row.get("raw_missing"):
            lines.append(f"{split}: {row['raw_missing']} general item(s) have no raw answer (not scored for RAW).")
    for lang, why in (res.get("raw_absent") or {}).items():
        lines.append(f"RAW left out ({lang}): {why}.")
    if res.get("replies_missing"):
        lines.append(f"{res['replies_missing']} item(s) had no reply in the replies file and were left out "
                     "(generation.on_missing=skip).")
    for lang, how in res["tokenization"].items():
        lines.append(f"Tokenisation ({lang}): {how}.")
    for lang, r in (res.get("rouge") or {}).items():
        lines.append(f"ROUGE ({lang}): {r['call']}; {r['several_references']}; mean over items.")
    lines.append("")
    return "\n".join(lines)


def detail_table(res: dict[str, Any]) -> list[str]:
    """ROUGE-1/2/L/Lsum x 100 per split and set (markdown lines)."""
    lines = ["| split | set | n | ROUGE-1 | ROUGE-2 | ROUGE-L | ROUGE-Lsum |", "|---|---|---|---|---|---|---|"]
    for split, row in res["splits"].items():
        for k in SETS:
            if row[k]:
                lines.append(f"| {split} | {k} | {row[k]['n']} | {_f(row[k]['rouge1'])} | {_f(row[k]['rouge2'])} | "
                             f"{_f(row[k]['rougeL'])} | {_f(row[k]['rougeLsum'])} |")
    return lines


def scalars(res: dict[str, Any]) -> dict[str, float]:
    out = {}
    for split, row in res["splits"].items():
        for k in SETS:
            if row[k]:
                for t in ROUGE:
                    if row[k][t] is not None:
                        out[f"rolebench/{split}/{k}/{t}"] = row[k][t]
    return out


def evaluate(settings: Any, ctx: Any) -> dict[str, Any]:
    """Load, generate (resumable, ``<out_dir>/rolebench/generations.jsonl``) or read the replies
    (``generation.backend=file``), score. ``settings``: the ``data`` and ``metrics`` groups."""
    data, m = settings.data, settings.metrics
    items, raw_absent = load_items(data, ctx.limit, need_prompts=ctx.backend.generates)
    log.info("RoleBench: %d test items over %s", len(items), ", ".join(dict.fromkeys(i.split for i in items)))
    got = ctx.generate("rolebench", [it.item for it in items])
    kept = [k for k, r in enumerate(got) if r is not None]  # None: no reply in the file (on_missing=skip)
    replies = [got[k] for k in kept]
    n_items = len(items)
    items = [items[k] for k in kept]
    raw_cfg = plain(data.rolebench.raw_answers) or {}
    res = score(items, replies, data.rolebench.chinese_tokenizer,
                raw_enabled={lang: bool(raw_cfg.get(lang)) for lang in ("eng", "zh")},
                use_stemmer=m.rouge_use_stemmer, target=m.rouge_target)
    if raw_absent:
        res["raw_absent"] = raw_absent
    if len(items) < n_items:
        res["replies_missing"] = n_items - len(items)

    res["rocit"] = RoleSystem(plain(data.roles)).describe()
    res["items"] = len(items)
    return res

