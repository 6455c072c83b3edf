"""PersonaGym (Findings of EMNLP 2025): PersonaScore, an LLM judge with one rubric per task.

``data.personagym.root`` is a copy of PersonaGym's repository (``vsamuel2003/PersonaGym``); read
from it, in its layout::

    questions/<benchmark>/<persona>.json          {"<task>": [question, ...], ...} (benchmark-v1: 200
                                                  personas x 5 tasks x 10 questions)
    rubrics/<task>.txt                            the task's rubric: {persona} {question} {response} {score_example}
    prompts/rubric_grading/prompt.txt             the grading request around the rubrics: {rubrics}
    prompts/rubric_grading/sys_prompt.txt         the judge's system message
    prompts/score_examples/prompt.txt             one score-examples request: {persona} {question} {rubric}
    prompts/score_examples/parallel_examples.txt  the score-examples request for a group: {rubrics}

The prompt and rubric text is the user's copy (rolemrc ships its own wording only for the sample);
every file is checked for its placeholders before anything is sent.

How a persona is scored (facts of the authors' ``code/run.py``):

- each question is asked with a system message naming the persona (``data.personagym.system``,
  ``{persona}``) and the question as the user turn;
- per task the questions are taken in groups of ``group_size`` (5); for a group the examples model
  is asked once for example answers at each score (``parallel_examples`` around a Python list of
  the per-question requests, each holding the task's rubric as written); the score examples of
  question *i* are, as the released code reads them, the *i*-th character of the processed answer
  (``score_examples=released``; ``per_question``: the *i*-th rubric's own examples; ``none``: no
  request, empty examples);
- the group's rubrics (filled with persona, question, reply and score examples) go, as a Python
  list, into one grading request with the system message; each judge answers once; the answer is
  cut at ``(n) Evaluation:`` markers and each part scored by the number after ``Therefore, the
  final score is`` (0 where there is none); a judge's group score is the mean of its non-zero
  scores (0 when all are 0); the group's score is the mean over the judges (the authors: two,
  gpt-4o-2024-05-13 and Llama-3-70b-chat, temperature 0);
- a task's score is the mean over its groups; a persona's PersonaScore the mean over its tasks;
  the benchmark's figures are means over personas.

Answers are cached (``<judge cache>/personagym_cache.sqlite``); a judge request that failed is
counted as missing (never scored) and a rerun asks only for it.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from rolemrc.api import Rejected
from rolemrc.config import plain
from rolemrc.data.schemas import DataError, TestItem
from rolemrc.errors import ConfigError, InputNotFound
from rolemrc.eval.bench.ask import ask_suite_judge
from rolemrc.eval.judge import check_judge, judge_backend, judge_config, obtainable, passes
from rolemrc.eval.report import fmt, mean
from rolemrc.fileio import template_fields

log = logging.getLogger(__name__)

# The released files' task names -> (scalar key, the name in the authors' scores.json)
TASKS: dict[str, tuple[str, str]] = {
    "Expected Action": ("expected_action", "Expected Action"),
    "Linguistic Habits": ("linguistic_habits", "Linguistic Habits"),
    "Persona Consistency": ("persona_consistency", "Persona Consistency"),
    "Toxicity": ("toxicity_control", "Toxicity Control"),
    "Action Justification": ("action_justification", "Action Justification"),
}
SCORE_EXAMPLES = ("released", "per_question", "none")
SCALE = (1, 5)

# (file, placeholders allowed, placeholders required)
_RUBRIC = ({"persona", "question", "response", "score_example"}, {"response"})
_PROMPTS: dict[str, tuple[str, set[str], set[str]]] = {
    "grading": ("prompts/rubric_grading/prompt.txt", {"rubrics"}, {"rubrics"}),
    "system": ("prompts/rubric_grading/sys_prompt.txt", set(), set()),
    "example": ("prompts/score_examples/prompt.txt", {"persona", "question", "rubric"}, {"question"}),
    "examples": ("prompts/score_examples/parallel_examples.txt", {"rubrics"}, {"rubrics"}),
}


# ---------------------------------------------------------------- files


def _template(path: Path, allowed: set[str], required: set[str], raw: bool = False) -> str:
    if not path.is_file():
        raise InputNotFound(f"PersonaGym file not found: {path} (data.personagym.root is a copy of PersonaGym's "
                            "repository: questions/, rubrics/, prompts/)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text") from None
    if not text.strip():
        raise DataError(f"{path}: empty")
    if raw:
        return text
    names = template_fields(text, str(path), sorted(allowed), "this file may use", DataError)
    lacking = sorted(required - names)
    if lacking:
        raise DataError(f"{path}: placeholder {', '.join('{' + r + '}' for r in lacking)} missing")
    return text


@dataclass(frozen=True)
class Templates:
    rubrics: dict[str, str]  # task -> rubric text
    grading: str
    system: str
    example: str | None  # None with score_examples=none
    examples: str | None


def load_templates(root: Path, tasks: Sequence[str], need_examples: bool) -> Templates:
    """The rubrics and prompts under ``root``, each checked for its placeholders."""
    rubrics = {t: _template(root / "rubrics" / f"{t}.txt", *_RUBRIC) for t in tasks}
    got = {k: _template(root / rel, allowed, req, raw=(k == "system")) if need_examples or k in ("grading", "system")
           else None for k, (rel, allowed, req) in _PROMPTS.items()}
    return Templates(rubrics, got["grading"], got["system"], got["example"], got["examples"])  # type: ignore[arg-type]


def _line_of(text: str, key: str) -> int:
    at = text.find(json.dumps(key))
    return text.count("\n", 0, at) + 1 if at >= 0 else 1


def load_questions(path: Path, tasks: Sequence[str]) -> dict[str, list[str]]:
    """One persona's questions file: ``{task: [question, ...]}`` for ``tasks``; a file that differs
    from the released layout is a :class:`DataError` naming file, line and field."""
    if not path.is_file():
        raise InputNotFound(f"PersonaGym questions not found: {path}")
    text = path.read_text(encoding="utf-8")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(doc, dict):
        raise DataError(f"{path}:1: expected a JSON object {{task: [questions]}} with the tasks {', '.join(TASKS)}")
    for key, value in doc.items():
        where = f"{path}:{_line_of(text, key)}"
        if key not in TASKS:
            raise DataError(f"{where}: field {key!r} is not a PersonaGym task; the released files have "
                            f"{', '.join(TASKS)}")
        if not isinstance(value, list) or not value:
            raise DataError(f"{where}: field {key!r} must be a non-empty list of question strings")
        for i, q in enumerate(value):
            if not isinstance(q, str) or not q.strip():
                raise DataError(f"{where}: field {key!r}[{i}] must be a non-empty string")
    lacking = [t for t in tasks if t not in doc]
    if lacking:
        raise DataError(f"{path}:1: field {lacking[0]!r} missing (data.personagym.tasks asks for it)")
    return {t: list(doc[t]) for t in tasks}


def load(c: Any) -> dict[str, dict[str, list[str]]]:
    """``{persona: {task: [question]}}`` from ``root/questions/<benchmark>/``, questions cut to
    ``c.questions`` per task."""
    root = Path(str(c.root)).expanduser()
    qdir = root / "questions" / str(c.benchmark)
    if not qdir.is_dir():
        raise InputNotFound(f"data.personagym: no questions folder {qdir} (root={c.root}, benchmark={c.benchmark}); "
                            "clone PersonaGym's repository and point data.personagym.root at it")
    names = list(c.personas) if c.personas else sorted(p.stem for p in qdir.glob("*.json"))
    if not names:
        raise InputNotFound(f"data.personagym: {qdir} holds no <persona>.json files")
    out = {}
    for name in names:
        qs = load_questions(qdir / f"{name}.json", list(c.tasks))
        out[name] = {t: v[: c.questions] if c.questions else v for t, v in qs.items()}
    return out


# ---------------------------------------------------------------- answers as the authors read them

_EXAMPLE_HEAD = re.compile(r"Score (\d+): *Response - *")
_EVAL_HEAD = re.compile(r"\(\d+\) Evaluation:")
_FINAL = re.compile(r"Therefore, the final score is\s*(\d+)")


def example_pairs(text: str) -> list[tuple[int, str]]:
    """(score, example) for every ``Score n: Response - ...`` in an examples answer, the text
    running to the next such header; one surrounding pair of quotes dropped."""
    heads = list(_EXAMPLE_HEAD.finditer(text))
    out = []
    for k, m in enumerate(heads):
        seg = text[m.end(): heads[k + 1].start() if k + 1 < len(heads) else len(text)]
        seg = seg[1:] if seg.startswith('"') else seg
        seg = seg.rstrip("\n")
        seg = seg[:-1] if seg.endswith('"') else seg
        out.append((int(m.group(1)), seg.strip()))
    return out


def _examples_text(pairs: Sequence[tuple[int, str]]) -> str:
    joined = "\n\n".join(f'Score {n}: "{t}"' for n, t in pairs)
    return "\n\n".join(line for line in joined.split("\n") if line.startswith("Score"))


def score_examples(text: str | None, n: int, mode: str) -> list[str] | None:
    """The ``n`` questions' score examples from one examples answer; None where the answer holds
    too few (the released code fails there). ``released``: the processed answer's *i*-th
    character, as ``code/run.py`` indexes it; ``per_question``: the *i*-th rubric's examples (a new
    rubric starts where the score number does not increase)."""
    if mode == "none":
        return [""] * n
    pairs = example_pairs(text or "")
    if mode == "released":
        processed = _examples_text(pairs)
        return [processed[i] for i in range(n)] if len(processed) >= n else None
    blocks: list[list[tuple[int, str]]] = []
    for score, ex in pairs:
        if not blocks or score <= blocks[-1][-1][0]:
            blocks.append([])
        blocks[-1].append((score, ex))
    return [_examples_text(b) for b in blocks[:n]] if len(blocks) >= n else None


def evaluation_scores(text: str | None) -> list[int]:
    """One score per ``(n) Evaluation:`` part of a grading answer: the number after ``Therefore,
    the final score is``, 0 where the part has none."""
    text = text or ""
    heads = list(_EVAL_HEAD.finditer(text))
    out = []
    for k, m in enumerate(heads):
        part = text[m.end(): heads[k + 1].start() if k + 1 < len(heads) else len(text)]
        found = _FINAL.search(part)
        out.append(int(found.group(1)) if found else 0)
    return out


def nonzero_mean(scores: Sequence[int]) -> float:
    """The authors' average of one judge's answer: sum over the non-zero scores' count (the sum, 0,
    when every score is 0 or there is none)."""
    n = sum(1 for s in scores if s != 0)
    return sum(scores) / n if n else float(sum(scores))


# ---------------------------------------------------------------- judges


def _judge_cfgs(c: Any, judge: Any) -> list[tuple[str, Any]]:
    """(where, judge config) of each judge: ``data.personagym.judges`` entries over ``judge``."""
    base = plain(judge)
    entries = list(c.judges or []) or [{}]
    out = []
    for k, entry in enumerate(entries):
        where = f"data.personagym.judges[{k}]" if c.judges else "judge"
        over = plain(entry)
        if not isinstance(over, Mapping):
            raise ConfigError(f"{where}: expected a mapping of judge keys (model, base_url, ...), got {over!r}")
        out.append((where, judge_config({**base, **over}, where)))
    return out


def _examples_cfg(c: Any, judge: Any, judges: list[tuple[str, Any]]) -> tuple[str, Any] | None:
    if c.score_examples == "none":
        return None
    if c.examples_judge is None:
        return judges[0]
    base, over = plain(judge), plain(c.examples_judge)
    return "data.personagym.examples_judge", judge_config({**base, **over}, "data.personagym.examples_judge")


def check(c: Any, ctx: Any) -> None:
    """The judges and the examples model are configured and usable (before generation)."""
    if c.score_examples not in SCORE_EXAMPLES:
        raise ConfigError(f"data.personagym.score_examples must be one of {', '.join(SCORE_EXAMPLES)}, "
                          f"got {c.score_examples!r}")
    unknown = [t for t in c.tasks if t not in TASKS]
    if unknown or not c.tasks:
        raise ConfigError(f"data.personagym.tasks: unknown {unknown}; the released tasks are {', '.join(TASKS)}")
    if c.group_size < 1:
        raise ConfigError(f"data.personagym.group_size must be >= 1, got {c.group_size}")
    try:
        c.system.format(persona="x")
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"data.personagym.system: only the placeholder {{persona}} is filled in ({e!r})") from None
    judges = _judge_cfgs(c, ctx.judging.judge)
    ex = _examples_cfg(c, ctx.judging.judge, judges)
    for where, j in judges + ([ex] if ex else []):
        if judge_backend(j) is None:
            raise ConfigError(f"data.personagym is scored by judges: {where}.backend is none; add judge=openai "
                              "(judge.model=...) or judge=hf, or give data.personagym.judges")
        check_judge(j, where)


def _ask(ctx: Any, judge: tuple[str, Any], prompts: Sequence[list[dict[str, str]]], valid: Callable[[str], Any],
         tag: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One ``{"status", "text", "cached", "error", ...}`` per prompt from one judge (``(where, judge
    config)``), through ``<judge cache>/personagym_cache.sqlite`` (answers that pass ``valid``
    only); and the judge's stats."""
    where, jcfg = judge
    answers, st = ask_suite_judge(ctx, "personagym_cache.sqlite", prompts, lambda t: t if passes(valid, t) else None,
                                  valid, tag, judge=jcfg, where=where)
    return answers, {"model": st.pop("judge_model"), **st}


# ---------------------------------------------------------------- the run


@dataclass
class Group:
    persona: str
    task: str
    index: int
    qa: list[tuple[str, str]]


def _groups(loaded: Mapping[str, Mapping[str, list[str]]], replies: Mapping[tuple[str, str, int], str | None],
            size: int) -> list[Group]:
    out = []
    for persona, tasks in loaded.items():
        for task, qs in tasks.items():
            for g, start in enumerate(range(0, len(qs), size)):
                qa = [(q, r) for k, q in enumerate(qs[start: start + size], start)
                      if (r := replies[(persona, task, k)]) is not None]
                if qa:
                    out.append(Group(persona, task, g, qa))
    return out


def _list_text(items: Sequence[str]) -> str:
    """A list of strings as the authors' prompts carry it: Python's ``str(list)``."""
    return str(list(items))


def evaluate(c: Any, ctx: Any) -> dict[str, Any]:
    root = Path(str(c.root)).expanduser()
    mode = str(c.score_examples)
    templates = load_templates(root, list(c.tasks), need_examples=mode != "none")
    loaded = load(c)
    keys = [(p, t, k) for p, ts in loaded.items() for t, qs in ts.items() for k in range(len(qs))]
    items = [TestItem(f"personagym/{TASKS[t][0]}",
                      [{"role": "system", "content": c.system.format(persona=p)},
                       {"role": "user", "content": loaded[p][t][k]}], "",
                      extra={"id": f"personagym/{p}/{t}/{k}"}) for p, t, k in keys]
    log.info("PersonaGym: %d personas, %d questions", len(loaded), len(items))
    got = ctx.generate("personagym", items)
    replies = dict(zip(keys, got))
    groups = _groups(loaded, replies, int(c.group_size))

    judges = _judge_cfgs(c, ctx.judging.judge)
    ex_cfg = _examples_cfg(c, ctx.judging.judge, judges)
    stats: dict[str, Any] = {}
    examples: list[list[str] | None] = [[""] * len(g.qa) for g in groups]
    ex_status: list[str] = ["ok"] * len(groups)
    if ex_cfg is not None:
        assert templates.example is not None and templates.examples is not None
        prompts = [[{"role": "user", "content": templates.examples.format(rubrics=_list_text(
            [templates.example.format(persona=g.persona, question=q, rubric=templates.rubrics[g.task])
             for q, _ in g.qa]))}] for g in groups]
        by_size: dict[int, list[int]] = {}
        for i, g in enumerate(groups):  # the answer must hold examples for as many questions as its group has
            by_size.setdefault(len(g.qa), []).append(i)
        for n, idx in by_size.items():
            answers, st = _ask(ctx, ex_cfg, [prompts[i] for i in idx], _examples_valid(n, mode),
                               "personagym examples")
            _add(stats.setdefault("examples", {**st, "prompts": 0, "cache_hits": 0, "requests": 0}), st)
            for i, a in zip(idx, answers):
                ex_status[i] = a["status"]
                examples[i] = score_examples(a["text"], n, mode) if a["status"] == "ok" else None
    ready = [i for i, e in enumerate(examples) if e is not None]
    grading = []
    for i in ready:
        g = groups[i]
        rubrics = [templates.rubrics[g.task].format(persona=g.persona, question=q, response=r,
                                                    score_example=ex)
                   for (q, r), ex in zip(g.qa, examples[i])]  # type: ignore[arg-type]
        grading.append([{"role": "system", "content": templates.system},
                        {"role": "user", "content": templates.grading.format(rubrics=_list_text(rubrics))}])
    verdicts: list[list[dict[str, Any]]] = []
    stats["judges"] = []
    for k, judge in enumerate(judges):
        answers, st = _ask(ctx, judge, grading, lambda t: t, f"personagym judge {k}")
        verdicts.append(answers)
        stats["judges"].append(st)

    rows: list[dict[str, Any]] = []
    for i, g in enumerate(groups):
        row: dict[str, Any] = {"persona": g.persona, "task": g.task, "group": g.index,
                               "qa": [{"question": q, "reply": r} for q, r in g.qa],
                               "examples_status": ex_status[i], "score_examples": examples[i], "judges": [],
                               "score": None}
        if i in ready:
            n = ready.index(i)
            for k, answers in enumerate(verdicts):
                a = answers[n]
                sc = evaluation_scores(a["text"]) if a["status"] == "ok" else None
                row["judges"].append({"model": stats["judges"][k]["model"], "status": a["status"], "raw": a["text"],
                                      "error": a["error"], "scores": sc,
                                      "score": nonzero_mean(sc) if sc is not None else None})
            if all(x["status"] == "ok" for x in row["judges"]):
                row["score"] = sum(x["score"] for x in row["judges"]) / len(row["judges"])
        rows.append(row)
    asks_again = ex_cfg is not None and getattr(judge_backend(ex_cfg[1]), "asks_again", False)
    return summarise(rows, loaded, list(c.tasks), mode, stats, sum(r is None for r in got), asks_again)


def _examples_valid(n: int, mode: str) -> Callable[[str], Any]:
    def valid(text: str) -> Any:
        if score_examples(text, n, mode) is None:
            raise Rejected("no_examples", f"the answer holds too few 'Score n: Response -' examples for {n} questions")
        return text
    return valid


def _add(total: dict[str, Any], st: Mapping[str, Any]) -> None:
    for k in ("prompts", "cache_hits", "requests"):
        total[k] += st[k]


def summarise(rows: list[dict[str, Any]], loaded: Mapping[str, Any], tasks: Sequence[str], mode: str,
              stats: dict[str, Any], replies_missing: int, asks_again: bool = True) -> dict[str, Any]:
    """Per persona and overall figures; ``missing`` (a sentence) names what a rerun could still
    obtain (failed requests, spent budget; examples answers without examples when the examples
    model can answer differently, ``asks_again``)."""
    personas: dict[str, Any] = {}
    for p in loaded:
        per = {t: mean([r["score"] for r in rows if r["persona"] == p and r["task"] == t and r["score"] is not None])
               for t in tasks}
        complete = all(v is not None for v in per.values())
        personas[p] = {"tasks": per, "PersonaScore": mean(list(per.values())) if complete else None}
    overall = {t: mean([personas[p]["tasks"][t] for p in personas]) for t in tasks}
    overall["PersonaScore"] = mean([personas[p]["PersonaScore"] for p in personas])
    judged = [j for r in rows for j in r["judges"] if j["status"] == "ok"]
    counts = {
        "groups": len(rows),
        "groups_scored": sum(r["score"] is not None for r in rows),
        "examples_unusable": sum(r["examples_status"] == "unparseable" for r in rows),
        "evaluations": sum(len(j["scores"]) for j in judged),
        "evaluations_without_score": sum(s == 0 for j in judged for s in j["scores"]),
        "answers_without_evaluations": sum(not j["scores"] for j in judged),
        "answers_short": sum(len(j["scores"]) < len(r["qa"]) for r in rows for j in r["judges"] if j["status"] == "ok"),
        "scores_off_scale": sum(not (s == 0 or SCALE[0] <= s <= SCALE[1]) for j in judged for s in j["scores"]),
        "replies_missing": replies_missing,
    }
    retry = obtainable([r["examples_status"] for r in rows] + [j["status"] for r in rows for j in r["judges"]],
                       not asks_again)
    res: dict[str, Any] = {"tasks": list(tasks), "score_examples": mode, "overall": overall, "personas": personas,
                           "counts": counts, "judge": stats, "groups": rows, "scale": list(SCALE)}
    if retry:
        res["missing"] = (f"PersonaGym: {counts['groups_scored']} of {len(rows)} groups scored, missing "
                          + ", ".join(f"{n} {s}" for s, n in retry.items()))
    # Answers that hold no score at all (no part with a final score): the authors' reading makes them 0.
    blank = sum(not any(j["scores"]) for j in judged)
    check = "check the judges' models and max_tokens (raw answers in metrics.json, personagym.groups)"
    unusable = counts["groups"] - counts["groups_scored"]
    if not retry and rows and (blank == len(judged) or not judged):
        res["unscored"] = (f"PersonaGym: none of the {len(judged)} judge answers holds a score ('Therefore, the final "
                           f"score is n'){f' and {unusable} group(s) got no usable score examples' if unusable else ''}, "
                           f"so there is no PersonaScore: {check}")
    elif judged and blank * 2 > len(judged):
        res["warning"] = (f"warning: PersonaGym: {blank} of {len(judged)} judge answers hold no score (read as 0, as "
                          f"the authors' code reads them): {check}")
    return res


def render(res: dict[str, Any]) -> str:
    tasks = res["tasks"]
    models = ", ".join(j["model"] for j in res["judge"].get("judges", []))
    ex = res["judge"].get("examples")
    lines = [f"## PersonaGym (PersonaScore, {res['scale'][0]}-{res['scale'][1]}; judges: {models})", "",
             "| | " + " | ".join(TASKS[t][1] for t in tasks) + " | PersonaScore |",
             "|---|" + "---|" * (len(tasks) + 1),
             "| this run | " + " | ".join(fmt(res["overall"][t]) for t in tasks) + f" | {fmt(res['overall']['PersonaScore'])} |",
             ""]
    if len(res["personas"]) <= 20:
        lines += ["| persona | " + " | ".join(TASKS[t][1] for t in tasks) + " | PersonaScore |",
                  "|---|" + "---|" * (len(tasks) + 1)]
        for p, row in res["personas"].items():
            lines.append(f"| {p} | " + " | ".join(fmt(row["tasks"][t]) for t in tasks) + f" | {fmt(row['PersonaScore'])} |")
        lines.append("")
    c = res["counts"]
    lines += [
        f"Means over {len(res['personas'])} personas of each persona's task score (mean over its groups of "
        "questions); PersonaScore = mean over the tasks. A group's score is the mean over the judges of each "
        "judge's mean non-zero evaluation score (the authors' reading).",
        f"Score examples: {res['score_examples']}" + (f" (written by {ex['model']})" if ex else "") + ".",
        f"Groups scored: {c['groups_scored']} of {c['groups']}; evaluations read: {c['evaluations']}, of which "
        f"{c['evaluations_without_score']} without 'Therefore, the final score is' (0, left out of the judge's mean); "
        f"answers without any '(n) Evaluation:' part: {c['answers_without_evaluations']}; answers with fewer parts "
        f"than questions: {c['answers_short']}; scores off the 1-5 scale: {c['scores_off_scale']}.",
    ]
    if c["replies_missing"]:
        lines.append(f"{c['replies_missing']} question(s) had no reply and were left out (generation.on_missing=skip).")
    lines.append("")
    return "\n".join(lines)


def scalars(res: dict[str, Any]) -> dict[str, float]:
    out = {f"personagym/{TASKS[t][0]}": v for t in res["tasks"] if (v := res["overall"][t]) is not None}
    if res["overall"]["PersonaScore"] is not None:
        out["personagym/persona_score"] = res["overall"]["PersonaScore"]
    out["personagym/evaluations_without_score"] = float(res["counts"]["evaluations_without_score"])
    return out
