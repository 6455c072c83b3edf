"""CharacterEval (Tu et al., 2024, arXiv 2401.01275): Chinese role-play replies scored by the
released reward model BaichuanCharRM on twelve metrics.

``data.charactereval.root`` holds the files of ``morecry/CharacterEval``'s ``data/`` folder, as
released (each a JSON document despite the ``.jsonl`` names)::

    test_data.jsonl           [{"id", "role", "novel_name", "context"}]; context: "<speaker>：<line>" lines
    character_profiles.json   {role: {field: value}}
    id2metric.jsonl           {"<id>": [["<English metric>", "<Chinese metric>"], ...]}

**Generation** (the layout of the authors' ``get_response.py``, as facts; the two sentences are
config keys in rolemrc's wording): the first user turn is the profile (Python's ``str()`` of its
dict) and ``instruction``; the first assistant turn ``acknowledgement`` (plus ``opening`` and the
role's line when the role speaks first); then every line of the role with the line just before
it, as ``<speaker>：<line>`` user/assistant turns; the context's last line is the question. Only
examples that ``id2metric`` names are generated (the others are never scored).

**Scoring**: the reply's first line (``first_line_only``, the authors' ``transform_format.py``) is
scored once per metric id2metric lists for the example: the reward model reads
``<RoleInfo>`` profile ``<Context>`` context ``<Response>`` reply ``<Dimension>`` Chinese metric
name, each tag and part separated by blank lines (:func:`rm_input`), and its output times 4 plus 1
is the score (1-5). Per metric: the mean of its scores (``compute_score.py``); per dimension of
the paper (conversational ability, character consistency, role-playing attractiveness): the mean
of its metric means; overall: the mean of the metric means. The thirteenth metric of the paper,
the MBTI personality back-test, has no released data or scorer and is not computed.

Scores are cached on disk (``<judge cache>/charactereval_rm.sqlite``) by (reward model, input).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from rolemrc.api import AnswerCache, request_key
from rolemrc.data.schemas import DataError, TestItem
from rolemrc.errors import ConfigError, InputNotFound
from rolemrc.eval.bench.files import field_of, read_json, read_json_list
from rolemrc.eval.bench.reward import RewardJudge
from rolemrc.eval.report import fmt, mean

log = logging.getLogger(__name__)

FILES = {"test": "test_data.jsonl", "profiles": "character_profiles.json", "metrics": "id2metric.jsonl"}
# The paper's dimensions and their metrics (id2metric's English names).
DIMENSIONS: dict[str, tuple[str, ...]] = {
    "conversational_ability": ("Fluency", "Coherence", "Consistency"),
    "character_consistency": ("Exposure", "Accuracy", "Hallucination", "Behavior", "Utterance"),
    "roleplay_attractiveness": ("Humanlikeness", "Communication_skills", "Diversity", "Empathy"),
}
METRICS: tuple[str, ...] = tuple(m for ms in DIMENSIONS.values() for m in ms)
SEP = "："  # the full-width colon between speaker and line


@dataclass
class Example:
    id: Any
    role: str
    context: str
    where: str  # file:line of the example
    metrics: list[tuple[str, str]]  # (English, Chinese) names to score


def parse_context(context: str) -> list[tuple[str, str]]:
    """``(speaker, line)`` per line of a context: split at the first full-width colon."""
    out = []
    for line in context.split("\n"):
        speaker, _, text = line.partition(SEP)
        out.append((speaker, text))
    return out


def load(c: Any) -> tuple[list[Example], dict[str, Any]]:
    """The examples to score (those id2metric names, the chosen metrics) and the profiles."""
    root = Path(str(c.root)).expanduser()
    if not root.is_dir():
        raise InputNotFound(f"data.charactereval.root: not a folder: {root} (it holds {', '.join(FILES.values())})")
    unknown = [m for m in (c.metrics or []) if m not in METRICS]
    if unknown:
        raise ConfigError(f"data.charactereval.metrics: unknown {unknown}; known: {', '.join(METRICS)}")
    wanted = set(c.metrics or METRICS)
    profiles = read_json(root / FILES["profiles"], "CharacterEval's character_profiles.json")
    if not isinstance(profiles, dict):
        raise DataError(f"{root / FILES['profiles']}: expected a JSON object {{role: profile}}")
    metrics_path = root / FILES["metrics"]
    id2metric = read_json(metrics_path, "CharacterEval's id2metric.jsonl")
    if not isinstance(id2metric, dict):
        raise DataError(f"{metrics_path}: expected a JSON object {{\"<id>\": [[English, Chinese], ...]}}")
    for key, pairs in id2metric.items():
        if not (isinstance(pairs, list) and all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p)
                                                for p in pairs)):
            raise DataError(f"{metrics_path}: entry {key!r}: expected a list of [English name, Chinese name] pairs")
        for en, _ in pairs:
            if en not in METRICS:
                raise DataError(f"{metrics_path}: entry {key!r}: unknown metric {en!r}; known: {', '.join(METRICS)}")
    test_path = root / FILES["test"]
    out: list[Example] = []
    seen: dict[str, str] = {}
    for line, row in read_json_list(test_path, "CharacterEval's test_data.jsonl"):
        where = f"{test_path}:{line}"
        rid = field_of(row, "id", (int, str), where)
        role = field_of(row, "role", str, where)
        context = field_of(row, "context", str, where)
        if str(rid) in seen:
            raise DataError(f"{where}: id {rid} again (first at {seen[str(rid)]})")
        seen[str(rid)] = where
        if role not in profiles:
            raise DataError(f"{where}: role {role!r} has no profile in {root / FILES['profiles']}")
        pairs = [(en, zh) for en, zh in id2metric.get(str(rid), []) if en in wanted]
        if pairs:
            out.append(Example(rid, role, context, where, pairs))
    if c.limit is not None:
        out = out[: c.limit]
    if not out:
        raise DataError(f"{test_path}: no example to score (none of its ids has a chosen metric in {metrics_path})")
    return out, profiles


def conversation(c: Any, ex: Example, profile: Any) -> list[dict[str, str]]:
    """The messages the evaluated model answers (see the module docstring)."""
    lines = parse_context(ex.context)
    role = ex.role
    first = c.acknowledgement.format(role=role)
    if lines[0][0] == role:
        first += c.opening + lines[0][1]
    msgs = [{"role": "user", "content": f"{profile}\n{c.instruction.format(role=role)}\n"},
            {"role": "assistant", "content": first}]
    for i, (speaker, text) in enumerate(lines):
        if speaker != role or i == 0:
            continue
        if lines[i - 1][0] == role:
            raise DataError(f"{ex.where}: id {ex.id}: two lines of {role} in a row in 'context' (line {i} and {i + 1})")
        msgs += [{"role": "user", "content": f"{lines[i - 1][0]}{SEP}{lines[i - 1][1]}"},
                 {"role": "assistant", "content": f"{speaker}{SEP}{text}"}]
    if lines[-1][0] == role:
        raise DataError(f"{ex.where}: id {ex.id}: 'context' ends with a line of {role}; it must end with the line "
                        "the role answers")
    msgs.append({"role": "user", "content": f"{lines[-1][0]}{SEP}{lines[-1][1]}"})
    return msgs


def rm_input(profile: Any, context: str, reply: str, metric_zh: str) -> str:
    """The reward model's input for one (example, metric)."""
    return (f"<RoleInfo>\n\n{profile}\n\n<Context>\n\n{context}\n\n<Response>\n\n{reply}\n\n"
            f"<Dimension>\n\n{metric_zh}")


def check(c: Any, ctx: Any) -> None:
    """Before anything slow: the reward model's folder and settings."""
    RewardJudge.check(c.reward_model, "data.charactereval.reward_model")


def summarise(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    metrics = {m: {"mean": mean(s := [r["score"] for r in records if r["metric"] == m]), "n": len(s)}
               for m in METRICS if any(r["metric"] == m for r in records)}
    dims = {d: mean([metrics[m]["mean"] for m in ms if m in metrics]) for d, ms in DIMENSIONS.items()}
    return {"metrics": metrics, "dimensions": {d: v for d, v in dims.items() if v is not None},
            "overall": mean([v["mean"] for v in metrics.values()])}


def evaluate(c: Any, ctx: Any) -> dict[str, Any]:
    examples, profiles = load(c)
    texts = {ex.role: str(profiles[ex.role]) for ex in examples}
    items = [TestItem("charactereval", conversation(c, ex, texts[ex.role]), "", origin=ex.where,
                      extra={"id": ex.id}) for ex in examples]
    replies = ctx.generate("charactereval", items)
    rm = RewardJudge.load(c.reward_model, "data.charactereval.reward_model")
    records: list[dict[str, Any]] = []
    hits = 0
    with AnswerCache(Path(ctx.judging.cache_dir) / "charactereval_rm.sqlite") as cache:
        for ex, reply in zip(examples, replies, strict=True):
            if reply is None:  # generation.on_missing=skip: counted, not scored
                continue
            scored = reply.split("\n")[0] if c.first_line_only else reply
            for en, zh in ex.metrics:
                text = rm_input(texts[ex.role], ex.context, scored, zh)
                key = request_key({"model": rm.model_id, "input": text, "output": str(c.reward_model.output)})
                got = cache.get(key, valid=float)
                if got is None:
                    raw = rm.raw(text)
                    cache.put(key, repr(raw), rm.model_id)
                else:
                    raw, hits = float(got), hits + 1
                records.append({"id": ex.id, "role": ex.role, "metric": en, "metric_zh": zh, "reply": scored,
                                "score": raw * rm.scale + rm.offset})
    out_dir = Path(ctx.out_dir) / "charactereval"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "scores.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
                                          encoding="utf-8")
    log.info("CharacterEval: %d examples, %d scores (%d from the cache)", len(examples), len(records), hits)
    return {**summarise(records), "examples": len(examples), "scored_examples": sum(r is not None for r in replies),
            "replies_missing": sum(r is None for r in replies), "scores": len(records), "cache_hits": hits,
            "reward_model": rm.model_id}


def render(res: dict[str, Any]) -> str:
    lines = [f"## CharacterEval (reward model: {res['reward_model']})", "",
             f"{res['scored_examples']} of {res['examples']} examples scored ({res['scores']} scores, 1-5, higher is "
             "better); a dimension is the mean of its metric means, overall the mean of all metric means.", "",
             "| dimension | metric | mean | n |", "|---|---|---|---|"]
    for d, ms in DIMENSIONS.items():
        for m in ms:
            if m in res["metrics"]:
                lines.append(f"| {d} | {m} | {fmt(res['metrics'][m]['mean'], 3)} | {res['metrics'][m]['n']} |")
        if d in res["dimensions"]:
            lines.append(f"| {d} | **mean** | {fmt(res['dimensions'][d], 3)} | |")
    lines += [f"| overall | **mean** | {fmt(res['overall'], 3)} | |", ""]
    if res["replies_missing"]:
        lines += [f"{res['replies_missing']} examples have no reply (generation.on_missing=skip): not scored.", ""]
    return "\n".join(lines)


def scalars(res: dict[str, Any]) -> dict[str, float]:
    out = {f"charactereval/{m}": v["mean"] for m, v in res["metrics"].items()}
    out.update({f"charactereval/{d}": v for d, v in res["dimensions"].items()})
    if res["overall"] is not None:
        out["charactereval/overall"] = res["overall"]
    return out
