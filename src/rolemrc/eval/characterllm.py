"""CharacterLLM Single/Turns (RoleMRC paper, Table 5): interviews judged on a 1-7 scale.

``data.characterllm.root`` is a folder in the layout of CharacterLLM's public release
(``choosewhatulike/trainable-agents``, ``data/seed_data``); the names assumed are::

    profiles/wiki_<Name>.txt                                     free-text profile of the character
    questions/generated_agent_interview_<Name>.json              single-turn interview questions
    questions/generated_agent_interview_for_multiturn_<Name>.json  questions for multi-turn sessions

each questions file a JSON list of ``{"topic_id", "topic", "question"}`` (only ``question`` is
required; ``topic_id`` groups multi-turn sessions).

- **Single**: every question is asked on its own: the RoCIT system instruction
  (:mod:`rolemrc.data.roles`; the character's description is the first
  ``profile_chars`` characters of its profile unless ``data.roles.profiles`` has one) + the
  question.
- **Turns**: consecutive questions of one topic form a session of up to ``turns`` questions,
  asked one after another in one conversation (the model sees its own earlier replies).
  CharacterLLM's interviewer model asked follow-ups instead; here the follow-ups are the
  release's multi-turn questions, so no second model is needed and runs are repeatable.

The judge (``judge=openai`` with any OpenAI-compatible server, or ``judge=hf``) reads the
character's profile and the interview and rates one dimension at a time, CharacterLLM's five:
memorization, values, personality, hallucination, stability, each 1 (worst) to 7 (best), in
rolemrc's own prompt wording; its answer must end with ``SCORE: <1-7>``. The mean per
dimension and per setting (mean of the dimension means) is reported; an answer without a
score is counted as unparseable, a request that failed as failed, and neither is scored.
Every scored answer is cached on disk (``<judge cache>/characterllm_cache.sqlite``).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from rolemrc.api import Rejected
from rolemrc.config import plain
from rolemrc.data.roles import RoleProfile, RoleSystem, render_system
from rolemrc.data.schemas import DataError, TestItem
from rolemrc.errors import ConfigError, InputNotFound
from rolemrc.eval.bench.ask import ask_suite_judge
from rolemrc.eval.judge import STATUSES, check_judge, judge_backend, judge_config, obtainable
from rolemrc.eval.report import fmt, status_table

log = logging.getLogger(__name__)

SCALE = (1, 7)
CRITERIA = {
    "memorization": ("Memorization", "Does the reply recall facts about the character (life, work, people, "
                     "events) that are true to the profile, with detail rather than generic statements?"),
    "values": ("Values", "Do the opinions, goals, priorities and judgements in the reply match what the character "
               "values and believes according to the profile?"),
    "personality": ("Personality", "Do the tone, manner, emotions and way of speaking reflect the character's "
                    "personality as the profile describes it?"),
    "hallucination": ("Hallucination", "Does the character avoid knowledge, skills or experiences it could not "
                      "have had (for example modern technology for a historical figure), declining or deflecting "
                      "in character where needed? 7 means no such slip at all."),
    "stability": ("Stability", "Does the character stay in role throughout the whole interview, without breaking "
                  "character, mentioning being an AI, or drifting into another persona?"),
}
SCORE_SYSTEM = (
    "You rate how well an AI model plays a character. You get the character's profile, an interview with the "
    "model playing the character, and one criterion. Think briefly about the criterion, then give an integer "
    "score from 1 (very poor) to 7 (excellent). End your answer with a last line of exactly this form:\n"
    "SCORE: <an integer from 1 to 7>"
)
_SCORE_LINE = re.compile(r"SCORE:[ \t]*(\d+)\s*$")


def parse_score(text: str | None) -> int | None:
    """The 1-7 score of a judge answer whose last non-empty line is ``SCORE: n``; else None."""
    if not text:
        return None
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return None
    m = _SCORE_LINE.search(lines[-1].replace("*", ""))
    if m is None:
        return None
    n = int(m.group(1))
    return n if SCALE[0] <= n <= SCALE[1] else None


def check_score(text: str) -> int:
    """``parse_score`` or :class:`rolemrc.api.Rejected` (so the API client retries)."""
    n = parse_score(text)
    if n is None:
        raise Rejected("no_score", "the answer does not end with 'SCORE: <1-7>'")
    return n


@dataclass
class Interview:
    setting: str  # single | turns
    character: str
    session: str
    turns: list[tuple[str, str]] = field(default_factory=list)  # (question, reply)


@dataclass
class Score:
    setting: str
    character: str
    session: str
    dimension: str
    status: str  # ok | unparseable | failed | budget_exhausted
    score: int | None
    raw: str | None
    cached: bool = False
    error: str | None = None


# ---------------------------------------------------------------- data


def _questions(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise InputNotFound(f"CharacterLLM questions not found: {path}")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
    if not isinstance(doc, list):
        raise DataError(f"{path}: expected a JSON list of {{topic_id, topic, question}} objects")
    out = []
    for i, q in enumerate(doc):
        if not isinstance(q, dict) or not isinstance(q.get("question"), str) or not q["question"].strip():
            raise DataError(f"{path}: entry [{i}] needs a non-empty string field 'question'")
        out.append(q)
    return out


def load(data: Any) -> dict[str, Any]:
    """``{"profiles": {name: text}, "single": {name: [question]}, "turns": {name: [[question]]}}``."""
    c = data.characterllm
    root = Path(str(c.root)).expanduser()
    if not root.is_dir():
        raise InputNotFound(f"data.characterllm.root: not a folder: {root} (see README for the layout)")
    bad = [s for s in c.settings if s not in ("single", "turns")]
    if bad:
        raise ConfigError(f"data.characterllm.settings: unknown {bad}; use single and/or turns")
    unknown = [d for d in c.dimensions if d not in CRITERIA]
    if unknown:
        raise ConfigError(f"data.characterllm.dimensions: unknown {unknown}; known: {', '.join(CRITERIA)}")
    if c.turns < 1:
        raise ConfigError(f"data.characterllm.turns must be >= 1, got {c.turns}")
    out: dict[str, Any] = {"profiles": {}, "single": {}, "turns": {}}
    for name in c.characters:
        prof = root / "profiles" / f"wiki_{name}.txt"
        if not prof.is_file():
            raise InputNotFound(f"CharacterLLM profile not found: {prof}")
        text = prof.read_text(encoding="utf-8").strip()
        if not text:
            raise DataError(f"{prof}: empty profile")
        out["profiles"][name] = text
        if "single" in c.settings:
            qs = [q["question"] for q in _questions(root / "questions" / f"generated_agent_interview_{name}.json")]
            out["single"][name] = qs[: c.questions] if c.questions else qs
        if "turns" in c.settings:
            qs = _questions(root / "questions" / f"generated_agent_interview_for_multiturn_{name}.json")
            sessions: list[list[str]] = []
            last = object()
            for q in qs:
                topic = q.get("topic_id")
                if not sessions or topic != last or len(sessions[-1]) >= c.turns:
                    sessions.append([])
                sessions[-1].append(q["question"])
                last = topic
            out["turns"][name] = sessions[: c.questions] if c.questions else sessions
    return out


# ---------------------------------------------------------------- interviews


def _system(data: Any, name: str, profile: str, profile_chars: int) -> str:
    system = RoleSystem(plain(data.roles))
    if name in system.profiles:
        return system(name)
    desc = profile[:profile_chars].rsplit(" ", 1)[0] if len(profile) > profile_chars else profile
    return render_system(RoleProfile(name, desc), system.template, system.few_shot)


def interview(data: Any, ctx: Any, loaded: dict[str, Any]) -> list[Interview]:
    """Generate every single-turn answer and every multi-turn session (resumable per round)."""
    c = data.characterllm
    systems = {n: _system(data, n, p, c.profile_chars) for n, p in loaded["profiles"].items()}
    out: list[Interview] = []
    if "single" in c.settings:
        ivs = [Interview("single", n, f"{n}/single/{i}", []) for n, qs in loaded["single"].items()
               for i, _ in enumerate(qs)]
        qs = [q for n, qs in loaded["single"].items() for q in qs]
        items = [TestItem("characterllm_single", [{"role": "system", "content": systems[iv.character]},
                                                  {"role": "user", "content": q}], "") for iv, q in zip(ivs, qs)]
        replies = ctx.generate("characterllm/single", items) if items else []
        for iv, q, r in zip(ivs, qs, replies):
            iv.turns.append((q, r))
        out += ivs
    if "turns" in c.settings:
        sessions = [(n, i, s) for n, ss in loaded["turns"].items() for i, s in enumerate(ss)]
        ivs = [Interview("turns", n, f"{n}/turns/{i}", []) for n, i, _ in sessions]
        rounds = max((len(s) for _, _, s in sessions), default=0)
        for r in range(rounds):
            live = [k for k, (_, _, s) in enumerate(sessions) if len(s) > r]
            items = []
            for k in live:
                msgs = [{"role": "system", "content": systems[ivs[k].character]}]
                for q, a in ivs[k].turns:
                    msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a if a.strip() else "..."}]
                msgs.append({"role": "user", "content": sessions[k][2][r]})
                items.append(TestItem("characterllm_turns", msgs, ""))
            replies = ctx.generate(f"characterllm/turns/round_{r + 1}", items)
            for k, reply in zip(live, replies):
                ivs[k].turns.append((sessions[k][2][r], reply))
        out += ivs
    return out


def score_messages(iv: Interview, dimension: str, profile: str) -> list[dict[str, str]]:
    title, question = CRITERIA[dimension]
    talk = "\n\n".join(f"Interviewer: {q}\n{iv.character}: {a}" for q, a in iv.turns)
    user = (f"[Character]\n{iv.character}\n\n[Profile]\n{profile}\n\n[Interview]\n{talk}\n\n"
            f"[Criterion]\n{title} (1-7): {question}\n\nRate the {iv.character} played by the model on this "
            f"criterion only. End with the line 'SCORE: <1-7>'.")
    return [{"role": "system", "content": SCORE_SYSTEM}, {"role": "user", "content": user}]


# ---------------------------------------------------------------- scoring


def check_scorer(judge: Any) -> None:
    """The judge (the ``judge`` group) is configured and usable (checked before generation)."""
    j = judge_config(judge)
    if judge_backend(j) is None:
        raise ConfigError("data.characterllm is scored by a judge: add judge=openai (judge.model=..., the key in "
                          "the environment) or judge=hf (judge.model=<local model>; null = the evaluated model)")
    check_judge(j)


def summarise(scores: Sequence[Score], settings: Sequence[str], dimensions: Sequence[str]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for s in settings:
        row: dict[str, Any] = {}
        for d in dimensions:
            got = [x for x in scores if x.setting == s and x.dimension == d]
            ok = [x.score for x in got if x.status == "ok" and x.score is not None]
            row[d] = {"mean": sum(ok) / len(ok) if ok else None, "n_ok": len(ok),
                      "n_unparseable": sum(x.status == "unparseable" for x in got),
                      "n_failed": sum(x.status == "failed" for x in got),
                      "n_budget_exhausted": sum(x.status == "budget_exhausted" for x in got)}
        means = [row[d]["mean"] for d in dimensions if row[d]["mean"] is not None]
        row["mean"] = sum(means) / len(means) if means else None
        table[s] = row
    return table


def evaluate(settings: Any, ctx: Any) -> dict[str, Any]:
    """``settings``: the ``data`` group (``data.characterllm`` and the role prompts of ``data.roles``)."""
    c = settings.data.characterllm
    loaded = load(settings.data)
    ivs = interview(settings.data, ctx, loaded)
    dims = list(c.dimensions)
    pairs = [(iv, d) for iv in ivs for d in dims]
    prompts = [score_messages(iv, d, loaded["profiles"][iv.character]) for iv, d in pairs]
    log.info("CharacterLLM: %d interviews, %d judge prompts", len(ivs), len(prompts))
    answers, stats = ask_suite_judge(ctx, "characterllm_cache.sqlite", prompts, parse_score, check_score,
                                     "characterllm prompt")
    scores = [Score(iv.setting, iv.character, iv.session, d, a["status"], a["value"], a["text"], a["cached"],
                    a["error"]) for (iv, d), a in zip(pairs, answers)]
    table = summarise(scores, list(c.settings), dims)
    missing = obtainable((x.status for x in scores), not judge_backend(ctx.judging.judge).asks_again)
    res: dict[str, Any] = {
        "settings": table,
        "dimensions": dims,
        "scale": list(SCALE),
        "judge": stats,
        "interviews": [{"setting": iv.setting, "character": iv.character, "session": iv.session,
                        "turns": [{"question": q, "reply": a} for q, a in iv.turns]} for iv in ivs],
        "scores": [s.__dict__ for s in scores],
        "layout_assumed": {"profiles": "profiles/wiki_<Name>.txt",
                           "single": "questions/generated_agent_interview_<Name>.json",
                           "turns": "questions/generated_agent_interview_for_multiturn_<Name>.json",
                           "fields": ["topic_id", "topic", "question"]},
    }
    if missing:
        res["missing"] = (f"CharacterLLM judge: {len(scores) - sum(missing.values())} of {len(scores)} scores obtained, "
                          f"missing {', '.join(f'{n} {s}' for s, n in missing.items())}")
    # Answers that are final but carry no score (a greedy hf judge): the table has no number to show.
    answered = sum(x.status in ("ok", "unparseable") for x in scores)
    bad = sum(x.status == "unparseable" for x in scores)
    check = "check judge.model and judge.max_tokens (raw answers in metrics.json, characterllm.scores)"
    if answered and bad == answered and not missing:
        res["unscored"] = (f"CharacterLLM judge: all {answered} answers were unparseable (no 'SCORE: <1-7>'), so "
                           f"there is no score: {check}")
    elif answered and bad * 2 > answered:
        res["warning"] = (f"warning: CharacterLLM judge: {bad} of {answered} answers were unparseable; the means rest "
                          f"on the other {answered - bad}: {check}")
    return res


def render(res: dict[str, Any]) -> str:
    dims = res["dimensions"]
    lines = [f"## CharacterLLM (RoleMRC paper Table 5; judge: {res['judge']['judge_model']})", "",
             f"Mean judge score per dimension, scale {res['scale'][0]}-{res['scale'][1]} (higher is better); "
             "mean = mean of the dimension means.", "",
             "| setting | " + " | ".join(CRITERIA[d][0] for d in dims) + " | mean |",
             "|---|" + "---|" * (len(dims) + 1)]
    names = {"single": "Single", "turns": "Turns"}
    for s, row in res["settings"].items():
        lines.append(f"| {names[s]} | " + " | ".join(fmt(row[d]["mean"]) for d in dims) + f" | {fmt(row['mean'])} |")
    counts = (([names[s], CRITERIA[d][0]], {k: row[d][f"n_{k}"] for k in STATUSES})
              for s, row in res["settings"].items() for d in dims)
    lines += ["", *status_table(["setting", "dimension"], counts)]
    lines += ["", "Answers without a score and failed requests are counted above, never scored.", ""]
    return "\n".join(lines)


def scalars(res: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for s, row in res["settings"].items():
        if row["mean"] is not None:
            out[f"characterllm/{s}/mean"] = row["mean"]
        for d in res["dimensions"]:
            if row[d]["mean"] is not None:
                out[f"characterllm/{s}/{d}"] = row[d]["mean"]
            out[f"characterllm/{s}/{d}/n_unparseable"] = float(row[d]["n_unparseable"])
    return out
