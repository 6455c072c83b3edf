"""CharacterBench (Zhou et al., AAAI 2025): replies to character dialogues, in Chinese and English,
judged by the released CharacterJudge model on eleven dimensions (thirteen test files).

``data.characterbench.root`` is the ``eval_data/raw_data`` folder of ``thu-coai/CharacterBench``,
as released: ``<dimension>_test.json``, each a JSON list of sessions ``{character_name,
character_profile, user_name, user_profile?, greeting?, dialogue: [{speaker, utterance}],
annotation_score, messages, response_messages, translation_en: {the same in English}}``.

**Generation**: the session's dialogue (the authors' ``process.py``, as facts: speakers mapped to
user/assistant, the greeting as the character's first turn, the last turn the user's). By
default the model gets a system message with both profiles and the turns as chat messages;
``prompt_template`` (a YAML file ``{zh: str, en: str}``, e.g. the authors' role-play prompt)
sends one user message instead, filled with ``{character_profile}``, ``{user_profile}`` and
``{dialogue}`` (``<role>: <content>`` lines). ``json_reply``: the reply is a JSON object whose
``response`` is the reply (their prompt asks for one); a reply that is not is counted, not judged.

**Judging** (``construct_prompts/process_wo_context_*_all.py``, ``model_generation_qwen_chat.py``
and ``all_eval.py``, as facts): per test file, the user's template (``templates``: YAML
``{zh: {<dimension>: str}, en: {...}}``, the authors' prompts are theirs to copy) filled with
``{character_profile}``, ``{dialogue}`` (the turns before the last, alternately
``用户：``/``User：`` and ``<character>：``; empty for the files judged without context),
``{user_query}``, ``{character_response}`` (``<character>：<reply>``) and, where the file has
one, the reference (``{reference}``, or the name the authors' Chinese prompt gives it); sent as
a system message (``judge_system``) and that user message to the judge (``judge=hf
judge.model=<CharacterJudge>``, greedy; or ``judge=openai`` for a served copy). The score is the
answer's first line read as a number; an answer that is not one counts as 3.0 in the authors'
figure (their fallback) and is left out of the strict one; an empty reply is not judged, as
theirs. Per file: the mean score over the largest annotation score of the rows judged (on the
whole file, its scale) times 5; the average: the mean over the files.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from rolemrc.api import Rejected
from rolemrc.data.schemas import DataError, TestItem
from rolemrc.errors import ConfigError, InputNotFound
from rolemrc.eval.bench.ask import ask_suite_judge
from rolemrc.eval.bench.files import field_of, read_json_list
from rolemrc.eval.judge import check_judge, judge_backend, judge_config
from rolemrc.eval.report import fmt
from rolemrc.fileio import read_mapping, template_fields

log = logging.getLogger(__name__)

# file (without _test.json) -> (where its reference is, the name the authors' Chinese prompt gives it,
# judged with the dialogue context)
DIMENSIONS: dict[str, tuple[tuple[str, ...] | None, str | None, bool]] = {
    "memory_consistency": (("messages", "output", "dialogue_segments"), "reference_dialogue", False),
    "fact_accuracy": (("messages", "output", "answer"), "answer", False),
    "boundary_consistency": (("response_messages", "reference_response"), "reference_response", False),
    "attribute_consistency_bot": (("messages", "output", "answer"), "answer", False),
    "attribute_consistency_human": (("messages", "reference"), "reference", True),
    "behavior_consistency_bot": (("messages", "output", "reference"), "behavior_style", True),
    "behavior_consistency_human": (("response_messages", "character_style"), "behavior_style", True),
    "emotion_self_regulation": (("messages", "output", "emotion"), "emotion", False),
    "empathetic_responsiveness": (("messages", "output", "emotion"), "emotion", False),
    "morality_stability": (None, None, True),
    "morality_robustness": (None, None, True),
    "human_likeness": (None, None, True),
    "engagement": (None, None, True),
}
LANGUAGES = ("zh", "en")
USER_PREFIX = {"zh": "用户", "en": "User"}
SEP = "："
FALLBACK = 3.0  # the authors' score for an answer that is not a number
BASE_FIELDS = {"character_profile", "dialogue", "user_query", "character_response"}


class Dropped(DataError):
    """A session the authors' normalisation rejects (their ``process.py`` leaves it out, in both
    languages): counted and named in the log, not an error."""


@dataclass
class Session:
    lang: str
    dim: str
    id: str
    where: str
    name: str
    profile: str
    user_profile: str
    messages: list[dict[str, str]]  # user/assistant turns, the last the user's
    judge_fields: dict[str, str]  # every template field but character_response
    gold: float


# ---------------------------------------------------------------- files


def _dig(row: Any, path: Sequence[str], where: str) -> Any:
    node = row
    for k in path:
        if not isinstance(node, dict) or k not in node:
            raise DataError(f"{where}: field {'.'.join(path)!r} is missing (this file's reference)")
        node = node[k]
    return node


def _turns(view: dict[str, Any], lang: str, where: str) -> list[dict[str, str]]:
    """The dialogue as user/assistant turns (the authors' session normalisation)."""
    name = str(view.get("character_name", ""))
    user = str(view.get("user_name", ""))
    out: list[dict[str, str]] = []
    for k, m in enumerate(field_of(view, "dialogue", list, where)):
        turn = f"{where}: dialogue[{k}]"
        speaker = field_of(m, "speaker", str, turn)
        text = field_of(m, "utterance", str, turn)
        if lang == "en":
            s = speaker.lstrip()
            if s in ("user", "User") or s == user.lstrip():
                role = "user"
            elif s in ("character", "Character") or s == name.lstrip() or s in name.lstrip():
                role = "assistant"
            elif out and out[-1]["role"] == "user":
                role = "assistant"
            else:
                raise Dropped(f"{turn}: speaker {speaker!r} is neither the user nor the character")
        elif speaker == "user" or (speaker != "character" and speaker == user):
            role = "user"
        elif speaker == "character" or speaker == name:
            role = "assistant"
        else:
            raise Dropped(f"{turn}: speaker {speaker!r} is neither the user ({user!r}) nor the character ({name!r})")
        out.append({"role": role, "content": text})
    if not out or out[-1]["role"] != "user":
        raise Dropped(f"{where}: the dialogue must end with the user's turn (the one the character answers)")
    greeting = view.get("greeting") or ""
    if greeting == "N/A" and lang == "en":
        greeting = ""
    if greeting:
        if out[0]["role"] != "user":
            raise Dropped(f"{where}: a session with a greeting must start with the user's turn")
        out.insert(0, {"role": "assistant", "content": str(greeting)})
    return out


def _session(row: Any, lang: str, dim: str, where: str) -> Session:
    gold_raw = field_of(row, "annotation_score", (int, float, str), where)
    try:
        gold = float(gold_raw)
    except ValueError:
        raise DataError(f"{where}: field 'annotation_score' must be a number, got {gold_raw!r}") from None
    view = row
    if lang == "en":
        view = field_of(row, "translation_en", dict, where)
        where = f"{where}: translation_en"
    name = view.get("character_name", row.get("character_name"))
    if not isinstance(name, str):
        raise DataError(f"{where}: field 'character_name' must be a string")
    view = {**view, "character_name": name}
    profile = str(field_of(view, "character_profile", (str, dict, list), where))
    turns = _turns(view, lang, where)
    dialogue = [field_of(m, "utterance", str, where) for m in view["dialogue"]]
    ref_path, _, with_context = DIMENSIONS[dim]
    fields = {"character_profile": profile, "user_query": f"{USER_PREFIX[lang]}{SEP}{dialogue[-1]}", "dialogue": ""}
    if with_context:
        fields["dialogue"] = "".join(f"{USER_PREFIX[lang] if i % 2 == 0 else name}{SEP}{u}\n"
                                     for i, u in enumerate(dialogue[:-1]))
    if ref_path is not None:
        try:
            ref = _dig(view, ref_path, where)
        except DataError:
            if lang != "en" or dim != "behavior_consistency_bot":
                raise
            ref = _dig(row, ref_path, where.rsplit(": translation_en", 1)[0])  # the authors fall back to the original
        if dim == "memory_consistency":
            if not isinstance(ref, list):
                raise DataError(f"{where}: field {'.'.join(ref_path)!r} must be a list of lines")
            ref = "".join(f"{name}{SEP}{s}\n" for s in ref)
        fields["reference"] = str(ref)
        if dim == "behavior_consistency_human":
            fields["character_profile"] = profile + str(ref)
    user_profile = view.get("user_profile") or "无"
    return Session(lang, dim, f"{lang}/{dim}/{row.get('id', '')}", where, name, profile, str(user_profile), turns,
                   fields, gold)


def load(c: Any) -> tuple[list[Session], list[str]]:
    """The sessions of the chosen files and languages, and why each left-out row was left out."""
    root = Path(str(c.root)).expanduser()
    if not root.is_dir():
        raise InputNotFound(f"data.characterbench.root: not a folder: {root} (CharacterBench's eval_data/raw_data)")
    dims = list(c.dimensions or DIMENSIONS)
    unknown = [d for d in dims if d not in DIMENSIONS]
    if unknown:
        raise ConfigError(f"data.characterbench.dimensions: unknown {unknown}; known: {', '.join(DIMENSIONS)}")
    bad = [x for x in c.languages if x not in LANGUAGES]
    if bad or not c.languages:
        raise ConfigError(f"data.characterbench.languages: use zh and/or en, got {list(c.languages)}")
    out: list[Session] = []
    dropped: list[str] = []
    for dim in dims:
        path = root / f"{dim}_test.json"
        rows = read_json_list(path, f"CharacterBench's {dim}_test.json")
        seen: dict[str, str] = {}
        for line, row in rows[: c.limit] if c.limit else rows:
            where = f"{path}:{line}"
            rid = str(field_of(row, "id", (int, str), where))
            if rid in seen:
                raise DataError(f"{where}: id {rid} again (first at {seen[rid]})")
            seen[rid] = where
            try:  # a row either language's normalisation rejects is left out of both, as theirs
                both = {lang: _session(row, lang, dim, where) for lang in LANGUAGES}
            except Dropped as e:
                dropped.append(str(e))
                continue
            out += [both[lang] for lang in c.languages]
    if dropped:
        log.warning("CharacterBench: %d rows left out, as the authors' process.py leaves them out (first: %s)",
                    len(dropped), "; ".join(dropped[:3]))
    return out, dropped


# ---------------------------------------------------------------- prompts


def allowed_fields(dim: str) -> set[str]:
    alias = DIMENSIONS[dim][1]
    return BASE_FIELDS | ({"reference", alias} if alias else set())


def load_templates(c: Any, langs: Sequence[str], dims: Sequence[str]) -> dict[tuple[str, str], str]:
    """``{(language, dimension): template}`` from ``data.characterbench.templates``, validated."""
    key = "data.characterbench.templates"
    if not c.templates:
        raise ConfigError(f"{key}: set it to a YAML file of the judge prompts, {{zh: {{<dimension>: prompt}}, en: "
                          "{...}} (CharacterBench's construct_prompts/eval_prompts_*; see docs/characterbench.md)")
    _, raw = read_mapping(str(c.templates), key, "a mapping of language (zh, en) to templates")
    out = {}
    for lang in langs:
        block = raw.get(lang)
        if not isinstance(block, dict):
            raise ConfigError(f"{key}={c.templates}: no '{lang}' mapping of dimension to prompt")
        for dim in dims:
            text = block.get(dim)
            where = f"{key}={c.templates}: {lang}.{dim}"
            if not isinstance(text, str) or not text.strip():
                raise ConfigError(f"{where}: missing (a non-empty prompt for this dimension)")
            names = template_fields(text, where, sorted(allowed_fields(dim)), f"{dim} may use")
            if "character_response" not in names:
                raise ConfigError(f"{where}: the prompt never shows the reply ({{character_response}})")
            out[(lang, dim)] = text
    return out


def load_prompt_template(c: Any, langs: Sequence[str]) -> dict[str, str] | None:
    if not c.prompt_template:
        return None
    key = "data.characterbench.prompt_template"
    _, raw = read_mapping(str(c.prompt_template), key, "a mapping of language (zh, en) to templates")
    out = {}
    for lang in langs:
        text = raw.get(lang)
        where = f"{key}={c.prompt_template}: {lang}"
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{where}: missing (the role-play prompt for this language)")
        template_fields(text, where, ("character_profile", "user_profile", "dialogue"), "use")
        out[lang] = text
    return out


def conversation(s: Session, template: str | None) -> list[dict[str, str]]:
    """What the evaluated model answers: the user's one-message template, or ours as chat turns."""
    if template is not None:
        turns = s.messages if s.messages[0]["role"] == "user" else [{"role": "user", "content": ""}, *s.messages]
        dialogue = "\n".join(f"{m['role']}: {m['content']}" for m in turns)
        return [{"role": "user", "content": template.format(character_profile=s.profile, user_profile=s.user_profile,
                                                             dialogue=dialogue)}]
    system = (f"You are {s.name}. Stay in character and answer the user's last turn with one short reply.\n\n"
              f"[{s.name}]\n{s.profile}\n\n[The user]\n{s.user_profile}")
    return [{"role": "system", "content": system}, *s.messages]


_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$")


def json_response(reply: str) -> str | None:
    """The ``response`` of a JSON-object reply (code fences allowed), None when it has none."""
    text = _FENCE.sub("", reply.strip())
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return None
    return doc["response"] if isinstance(doc, dict) and isinstance(doc.get("response"), str) else None


def judge_messages(s: Session, template: str, reply: str, system: str) -> list[dict[str, str]]:
    values = {**s.judge_fields, "character_response": f"{s.name}{SEP}{reply}"}
    alias = DIMENSIONS[s.dim][1]
    if alias:
        values[alias] = values["reference"]
    return [{"role": "system", "content": system}, {"role": "user", "content": template.format(**values)}]


def parse_score(text: str | None) -> float | None:
    """The judge's score: the answer's first line as a number, else None."""
    if text is None:
        return None
    try:
        return float(text.split("\n")[0])
    except ValueError:
        return None


def _check_score(text: str) -> float:
    n = parse_score(text)
    if n is None:
        raise Rejected("no_score", "the answer's first line is not a number")
    return n


# ---------------------------------------------------------------- judging


def check(c: Any, ctx: Any) -> None:
    """Before anything slow: a judge that can run, the templates."""
    j = judge_config(ctx.judging.judge)
    cls = judge_backend(j)
    if cls is None:
        raise ConfigError("data.characterbench is scored by CharacterJudge: add judge=hf judge.model=<CharacterJudge "
                          "folder> (or judge=openai with a served copy)")
    if cls.judges_evaluated_model and j.model is None and not ctx.backend.loads_model:
        raise ConfigError(f"judge=hf needs judge.model (the CharacterJudge folder): with generation.backend="
                          f"{ctx.backend.name} there is no evaluated model to judge with")
    check_judge(j)
    load_templates(c, list(c.languages), list(c.dimensions or DIMENSIONS))
    load_prompt_template(c, list(c.languages))


def evaluate(c: Any, ctx: Any) -> dict[str, Any]:
    langs, dims = list(c.languages), list(c.dimensions or DIMENSIONS)
    templates = load_templates(c, langs, dims)
    gen_templates = load_prompt_template(c, langs)
    sessions, dropped = load(c)
    items = [TestItem(f"characterbench_{s.lang}", conversation(s, gen_templates[s.lang] if gen_templates else None),
                      "", origin=s.where, extra={"id": s.id}) for s in sessions]
    replies = ctx.generate("characterbench", items)
    judged: list[tuple[Session, str]] = []
    counts = {"replies_missing": 0, "replies_empty": 0, "replies_not_json": 0}
    for s, r in zip(sessions, replies, strict=True):
        if r is None:
            counts["replies_missing"] += 1
            continue
        if c.json_reply:
            r = json_response(r)
            if r is None:
                counts["replies_not_json"] += 1
                continue
        if r == "":  # the authors leave empty replies out
            counts["replies_empty"] += 1
            continue
        judged.append((s, r))
    prompts = [judge_messages(s, templates[(s.lang, s.dim)], r, c.judge_system) for s, r in judged]
    log.info("CharacterBench: %d sessions, %d judge prompts", len(sessions), len(prompts))
    answers, stats = ask_suite_judge(ctx, "characterbench_cache.sqlite", prompts, parse_score, _check_score,
                                     "characterbench prompt")
    rows = [{"id": s.id, "language": s.lang, "dimension": s.dim, "reply": r, "status": a["status"],
             "score": a["value"], "answer": a["text"], "gold": s.gold} for (s, r), a in zip(judged, answers)]
    table: dict[str, Any] = {}
    for lang in langs:
        per: dict[str, Any] = {}
        for dim in dims:
            mine = [x for x in rows if x["language"] == lang and x["dimension"] == dim]
            # The authors' scale: the largest annotation score among the rows judged (their results file)
            golds = [x["gold"] for x in mine if x["status"] in ("ok", "unparseable")]
            top = max(golds) if golds else None
            ok = [x["score"] for x in mine if x["status"] == "ok"]
            authors = ok + [FALLBACK] * sum(x["status"] == "unparseable" for x in mine)
            per[dim] = {"score": sum(authors) / len(authors) / top * 5 if authors and top else None,
                        "score_strict": sum(ok) / len(ok) / top * 5 if ok and top else None,
                        "n": len(mine), "n_ok": len(ok), "n_unparseable": len(authors) - len(ok),
                        "n_failed": sum(x["status"] in ("failed", "budget_exhausted") for x in mine), "max_gold": top}
        scored = [v["score"] for v in per.values() if v["score"] is not None]
        table[lang] = {"dimensions": per, "average": sum(scored) / len(scored) if scored else None}
    out_dir = Path(ctx.out_dir) / "characterbench"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "judgements.jsonl").write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in rows),
                                              encoding="utf-8")
    res: dict[str, Any] = {"languages": table, "dimension_order": dims, "judge": stats, "sessions": len(sessions),
                           "rows_left_out": len(dropped), "rows_left_out_why": dropped[:20], **counts}
    failed = sum(x["status"] in ("failed", "budget_exhausted") for x in rows)
    if failed:
        res["missing"] = f"CharacterBench judge: {len(rows) - failed} of {len(rows)} answers obtained, {failed} failed"
    return res


def render(res: dict[str, Any]) -> str:
    langs = list(res["languages"])
    lines = [f"## CharacterBench (judge: {res['judge']['judge_model']})", "",
             "Per test file: mean judge score / the largest annotation score of the rows judged x 5 (unparseable answers count "
             "3.0, as the authors' all_eval.py; strict: left out); average: the mean over the files.", "",
             "| dimension | " + " | ".join(f"{x} | {x} strict | {x} unparseable" for x in langs) + " |",
             "|---|" + "---|---|---|" * len(langs)]
    for dim in res["dimension_order"]:
        cells = []
        for x in langs:
            d = res["languages"][x]["dimensions"][dim]
            cells += [fmt(d["score"], 3), fmt(d["score_strict"], 3), f"{d['n_unparseable']}/{d['n']}"]
        lines.append(f"| {dim} | " + " | ".join(cells) + " |")
    lines.append("| **average** | " + " | ".join(f"{fmt(res['languages'][x]['average'], 3)} | |" for x in langs) + " |")
    notes = [f"{res[k]} {w}" for k, w in (("rows_left_out", "rows left out as the authors' process.py leaves them out "
                                                             "(speakers it cannot place; metrics.json says why)"),
                                          ("replies_missing", "sessions without a reply"),
                                          ("replies_empty", "empty replies (not judged, as the authors)"),
                                          ("replies_not_json", "replies without a JSON 'response' (not judged)"))
             if res[k]]
    lines += ["", "; ".join(notes) + "." if notes else "", ""]
    return "\n".join(lines)


def scalars(res: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for lang, t in res["languages"].items():
        if t["average"] is not None:
            out[f"characterbench/{lang}/average"] = t["average"]
        for dim, d in t["dimensions"].items():
            if d["score"] is not None:
                out[f"characterbench/{lang}/{dim}"] = d["score"]
            out[f"characterbench/{lang}/{dim}/n_unparseable"] = float(d["n_unparseable"])
    return out
