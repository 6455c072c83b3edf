"""Pairwise judging: the evaluated model's replies (A) against another model's (B) on the same items.

``pairwise.against`` names B's replies (a JSON-lines replies file, rows as ``generation.path``'s,
matched to the test items the same way: by id, else by the question); a list of files compares A
with each of them in turn (one opponent per file). A's replies are this evaluation's, from any
generation backend (a replies file included, so two files can be compared).

For every (item, opponent) the judge is asked twice, with the two replies in both orders: A
shown first, then B shown first. The prompt is a text template (``pairwise.template``, default
``rolemrc/assets/judge/pairwise.txt``, rolemrc's own wording) with the placeholders of
:data:`TEMPLATE_FIELDS`; the judge's answer must end with a line ``WINNER: 1``, ``WINNER: 2`` or
``WINNER: tie`` (:func:`parse_winner`). The pair's outcome, for model A:

- **win** when both orders prefer A, **loss** when both prefer B;
- **tie** otherwise: both orders say tie, one says tie, or the preference flips with the order
  (the judge picked the same position both times: position bias, not a preference); flips are
  also counted apart.

A pair with an answer missing (a failed request, a request past ``judge.max_requests``, or an
answer without a ``WINNER`` line after the judge's retries) has no outcome: it is counted, never
scored; rates are over the pairs with an outcome. Every answer with a winner line is cached
(``<judge cache>/pairwise_cache.sqlite``), so a rerun asks only for what is missing.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from rolemrc import asset
from rolemrc.api import AnswerCache, Rejected
from rolemrc.config import Judging
from rolemrc.data.schemas import TestItem
from rolemrc.errors import ConfigError, InputNotFound
from rolemrc.eval.generation import match_replies, no_reply_error, read_replies
from rolemrc.eval.bench.ask import ask_judge
from rolemrc.eval.judge import judge_backend, judge_config, obtainable
from rolemrc.eval.report import pct
from rolemrc.fileio import template_fields

log = logging.getLogger(__name__)

CACHE_FILE = "pairwise_cache.sqlite"
DEFAULT_TEMPLATE = "judge/pairwise.txt"  # rolemrc.asset name
TEMPLATE_FIELDS: dict[str, str] = {
    "conversation": "the conversation so far (system message, user and assistant turns), one labelled block per turn",
    "reply_1": "the reply shown first",
    "reply_2": "the reply shown second",
    "reference": "the test item's reference reply (empty when it has none)",
    "task": "the test item's task name",
}
REQUIRED_FIELDS = ("reply_1", "reply_2")
OUTCOMES = ("win", "tie", "loss")

_WINNER = re.compile(r"WINNER:[ \t]*(1|2|tie)", re.IGNORECASE)


def parse_winner(text: str | None) -> str | None:
    """``"1"``, ``"2"`` or ``"tie"`` when the answer's last non-empty line is ``WINNER: 1|2|tie``
    (``*`` emphasis and case ignored), else None."""
    if not text:
        return None
    lines = [ln.strip().replace("*", "") for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return None
    m = _WINNER.fullmatch(lines[-1].strip())
    return m.group(1).lower() if m else None


def check_winner(text: str) -> str:
    """:func:`parse_winner` or :class:`rolemrc.api.Rejected` (so the API client asks again)."""
    w = parse_winner(text)
    if w is None:
        raise Rejected("no_winner", "the answer does not end with 'WINNER: 1', 'WINNER: 2' or 'WINNER: tie'")
    return w


# ---------------------------------------------------------------- config


def enabled(cfg: Any) -> bool:
    """``pairwise.against`` is set."""
    p = cfg.get("pairwise") if hasattr(cfg, "get") else getattr(cfg, "pairwise", None)
    return p is not None and p.against not in (None, "", [])


def opponent_paths(against: Any) -> list[str]:
    """``pairwise.against`` as a list of existing files (one opponent each)."""
    paths = [str(against)] if isinstance(against, (str, Path)) else [str(x) for x in against]
    for p in paths:
        if not Path(p).expanduser().is_file():
            raise InputNotFound(f"pairwise.against: no such file: {p} (a JSON-lines file of the other model's "
                                "replies, rows as generation.path's)")
    return [str(Path(p).expanduser()) for p in paths]


def opponent_names(paths: Sequence[str]) -> list[str]:
    """Each file's stem; the position is added where two stems are equal."""
    stems = [Path(p).stem for p in paths]
    return [s if stems.count(s) == 1 else f"{s}_{i + 1}" for i, s in enumerate(stems)]


def load_template(path: str | None, where: str = "pairwise.template", default: str = DEFAULT_TEMPLATE,
                  fields: dict[str, str] = TEMPLATE_FIELDS, required: Sequence[str] = REQUIRED_FIELDS,
                  needs: str = "it must show both replies") -> str:
    """A judge's prompt template: ``path`` (``where``: the key naming it) or rolemrc's ``default``
    asset; checked for known placeholders (``fields``) and the ``required`` ones (``needs`` says
    why). A fault is a ConfigError naming the file. Defaults: pairwise judging's."""
    p = Path(path).expanduser() if path else Path(asset(default))
    if not p.is_file():
        raise ConfigError(f"{where}={path}: no such file (a text file with the judge's prompt, placeholders "
                          f"{' '.join('{' + f + '}' for f in fields)})")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{where}={p}: not UTF-8 text; re-save it as UTF-8") from None
    if not text.strip():
        raise ConfigError(f"{where}={p}: the file is empty")
    names = template_fields(text, f"{where}={p}", fields)
    lacking = [f for f in required if f not in names]
    if lacking:
        raise ConfigError(f"{where}={p}: the template never shows {', '.join('{' + f + '}' for f in lacking)}; "
                          f"{needs}")
    return text


def check(p: Any, judge: Any) -> None:
    """Everything that can be checked before generation (``p``: the ``pairwise`` group, ``judge``: the
    ``judge`` group): a judge, B's files, the template, on_missing."""
    j = judge_config(judge)
    if judge_backend(j) is None:
        raise ConfigError("pairwise.against is set but there is no judge: add judge=openai (judge.model=..., "
                          "the key in the environment) or judge=hf (judge.model=<local model>)")
    if p.on_missing not in ("error", "skip"):
        raise ConfigError(f"pairwise.on_missing must be error or skip, got {p.on_missing!r}")
    opponent_paths(p.against)
    load_template(p.template)


# ---------------------------------------------------------------- prompts

_LABELS = {"system": "System message", "user": "User", "assistant": "Assistant (the character)"}


def conversation_text(question: Sequence[Any]) -> str:
    """The conversation as the default template shows it: one ``[<label>]`` block per turn."""
    parts = []
    for m in question:
        role = str(m["role"]).strip().lower()
        parts.append(f"[{_LABELS.get(role, role)}]\n{m['content']}")
    return "\n\n".join(parts)


def prompt(template: str, item: TestItem, first: str, second: str) -> list[dict[str, str]]:
    """One user message: the template filled with the item and the two replies in the order given."""
    text = template.format(conversation=conversation_text(item.question), reply_1=first, reply_2=second,
                           reference=item.reference or "", task=item.task)
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------- outcomes


@dataclass
class Pair:
    """One (item, opponent) comparison: the two answers, what each preferred, the outcome for A."""

    item_id: str
    task: str
    opponent: str
    status: str  # ok | unparseable | failed | budget_exhausted (the worse of the two requests)
    outcome: str | None  # win | tie | loss for model A; None without both answers
    a_first: str | None  # the A-first answer's preference: A | B | tie (None: no answer)
    b_first: str | None  # the B-first answer's preference
    flip: bool = False  # the preference followed the position: counted as a tie
    raw_a_first: str | None = None
    raw_b_first: str | None = None
    cached: int = 0  # answers of the two served from the cache
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_WORSE = ("failed", "budget_exhausted", "unparseable", "ok")


def combine(a_first: str | None, b_first: str | None) -> tuple[str | None, bool]:
    """(outcome for A, flip) from the two answers' preferences (``A``/``B``/``tie``): win when both
    prefer A, loss when both prefer B, a tie otherwise; flip: A in one order, B in the other."""
    if a_first is None or b_first is None:
        return None, False
    if a_first == b_first == "A":
        return "win", False
    if a_first == b_first == "B":
        return "loss", False
    return "tie", {a_first, b_first} == {"A", "B"}


def _prefers(winner: str | None, a_shown_first: bool) -> str | None:
    if winner is None:
        return None
    if winner == "tie":
        return "tie"
    return "A" if (winner == "1") == a_shown_first else "B"


def judge_pairs(p: Any, judging: Judging, judge: Any, items: Sequence[TestItem], replies: Sequence[str],
                ids: Sequence[str]) -> dict[str, Any]:
    """Ask ``judge`` (built for ``judging``) about every (item, opponent) of the ``pairwise`` group
    ``p`` in both orders; returns the results section (``pairs``, ``opponents`` with their tables,
    ``missing`` when promised answers are missing)."""
    template = load_template(p.template)
    paths = opponent_paths(p.against)
    names = opponent_names(paths)
    cache_dir = Path(judging.cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)

    jobs: list[tuple[str, int, str]] = []  # (opponent, item index, B's reply)
    no_reply: dict[str, int] = {}
    unmatched: dict[str, int] = {}
    for name, path in zip(names, paths):
        rf = read_replies(path, p.reply_field, path_key="pairwise.against", field_key="pairwise.reply_field")
        got = match_replies(rf, items, ids)
        missing = [k for k, r in enumerate(got) if r is None]
        if missing and p.on_missing == "error":
            raise no_reply_error("pairwise", missing, items, ids, path, "them out of this comparison")
        no_reply[name] = len(missing)
        unmatched[name] = len(rf.unmatched())
        jobs += [(name, k, r) for k, r in enumerate(got) if r is not None]

    prompts = []
    for _, k, b in jobs:
        prompts.append(prompt(template, items[k], replies[k], b))  # A shown first
        prompts.append(prompt(template, items[k], b, replies[k]))  # B shown first
    log.info("pairwise: %d items x %d opponent(s): %d comparisons, %d judge prompts", len(items), len(names),
             len(jobs), len(prompts))
    with AnswerCache(cache_dir / CACHE_FILE) as cache:
        answers, _ = ask_judge(judge.backend, cache, prompts, parse_winner, check_winner, "pairwise prompt",
                               mode="pairwise", no_value="the answer has no 'WINNER: 1|2|tie' line")

    pairs: list[Pair] = []
    for n, (name, k, _) in enumerate(jobs):
        x, y = answers[2 * n], answers[2 * n + 1]
        pa = _prefers(parse_winner(x["text"]) if x["status"] == "ok" else None, True)
        pb = _prefers(parse_winner(y["text"]) if y["status"] == "ok" else None, False)
        status = min((x["status"], y["status"]), key=_WORSE.index)
        outcome, flip = combine(pa, pb)
        errors = [e for e in (x["error"], y["error"]) if e]
        pairs.append(Pair(ids[k], items[k].task, name, status, outcome, pa, pb, flip, x["text"], y["text"],
                          int(x["cached"]) + int(y["cached"]), "; ".join(errors) or None))

    res: dict[str, Any] = {
        "judge_model": judge.backend.model_id,
        "template": str(Path(p.template).expanduser()) if p.template else f"rolemrc default ({DEFAULT_TEMPLATE})",
        "rule": RULE,
        "opponents": {},
        "prompts": len(prompts),
        "cache_hits": sum(a["cached"] for a in answers),
        "requests": sum(a["attempts"] for a in answers),
    }
    for name, path in zip(names, paths):
        mine = [x for x in pairs if x.opponent == name]
        res["opponents"][name] = {
            "path": path,
            "items_without_reply": no_reply[name],
            "rows_unmatched": unmatched[name],
            "overall": table(mine),
            "by_task": {t: table([x for x in mine if x.task == t]) for t in sorted({x.task for x in mine})},
        }
    lacking = obtainable((x.status for x in pairs), not judge_backend(judging.judge).asks_again)
    if lacking:
        res["missing"] = (f"pairwise judge: {len(pairs) - sum(lacking.values())} of {len(pairs)} comparisons decided, "
                          f"missing {', '.join(f'{n} {s}' for s, n in lacking.items())}")
    res["pairs"] = [x.to_dict() for x in pairs]
    return res


RULE = ("Each comparison is asked twice, A's reply shown first and then B's. Win: both answers prefer A; loss: "
        "both prefer B; tie: any other combination (both say tie, one says tie, or the preference flips with the "
        "order: counted as a tie and under 'flips'). A comparison with a failed, unsent or unparseable answer has "
        "no outcome: counted, never scored; rates are over the decided comparisons.")


def table(pairs: Sequence[Pair]) -> dict[str, Any]:
    """Counts and rates of one set of comparisons."""
    decided = [x for x in pairs if x.outcome is not None]
    n = len(decided)
    c = {o: sum(x.outcome == o for x in decided) for o in OUTCOMES}
    return {
        "n": n,
        "wins": c["win"], "ties": c["tie"], "losses": c["loss"],
        "win_rate": c["win"] / n if n else None,
        "tie_rate": c["tie"] / n if n else None,
        "loss_rate": c["loss"] / n if n else None,
        "win_rate_ties_half": (c["win"] + c["tie"] / 2) / n if n else None,
        "flips": sum(x.flip for x in decided),
        "n_unparseable": sum(x.status == "unparseable" for x in pairs),
        "n_failed": sum(x.status == "failed" for x in pairs),
        "n_budget_exhausted": sum(x.status == "budget_exhausted" for x in pairs),
    }


# ---------------------------------------------------------------- report


def _row(label: str, t: dict[str, Any]) -> str:
    return (f"| {label} | {t['n']} | {t['wins']} | {t['ties']} | {t['losses']} | {pct(t['win_rate'])} | "
            f"{pct(t['tie_rate'])} | {pct(t['loss_rate'])} | {pct(t['win_rate_ties_half'])} | {t['flips']} | "
            f"{t['n_unparseable']} | {t['n_failed']} | {t['n_budget_exhausted']} |")


def render(res: dict[str, Any], model: str) -> str:
    """The summary.md section: one table per opponent, overall then per task."""
    lines: list[str] = []
    for name, o in res["opponents"].items():
        lines += [f"## Pairwise: A = {model} vs B = {name} (judge: {res['judge_model']})", "",
                  f"B's replies: {o['path']}" + (f"; {o['items_without_reply']} items without a reply in it, left out"
                                                 if o["items_without_reply"] else ""), "",
                  "| task | decided | win | tie | loss | win rate | tie rate | loss rate | win rate (tie = ½) | flips | "
                  "unparseable | failed | not sent |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
                  _row("**all**", o["overall"])]
        lines += [_row(t, row) for t, row in o["by_task"].items()]
        lines.append("")
    lines += [res["rule"], f"Prompt template: {res['template']}.", ""]
    return "\n".join(lines)


def scalars(res: dict[str, Any]) -> dict[str, float]:
    """``pairwise/<opponent>/<rate>`` overall and ``pairwise/<opponent>/<task>/<rate>`` per task."""
    out: dict[str, float] = {}
    for name, o in res["opponents"].items():
        for scope, t in [("", o["overall"]), *((f"{task}/", row) for task, row in o["by_task"].items())]:
            for key in ("win_rate", "tie_rate", "loss_rate", "win_rate_ties_half"):
                if t[key] is not None:
                    out[f"pairwise/{name}/{scope}{key}"] = t[key]
            if not scope:
                out[f"pairwise/{name}/n"] = float(t["n"])
                out[f"pairwise/{name}/flips"] = float(t["flips"])
    return out


def write_pairs(out_dir: str | Path, res: dict[str, Any]) -> Path:
    """``<out_dir>/pairwise.jsonl``: one comparison per line (both raw answers)."""
    path = Path(out_dir) / "pairwise.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for x in res["pairs"]:
            f.write(json.dumps(x, ensure_ascii=False) + "\n")
    return path
