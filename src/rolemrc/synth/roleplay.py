"""RoleLLM's data stages for ``synthesize.py``: Context-Instruct and RoleGPT.

    python synthesize.py stages=[context_instruct] context_instruct.roles=<roles.jsonl>
    python synthesize.py stages=[rolegpt] rolegpt.roles=<roles.jsonl> rolegpt.questions=<instructions.jsonl>

The roles file holds one record per role (JSON list or JSONL): ``{"name", "description",
"catchphrases": [str], "dialogue": [{"user", "assistant"}], "script"}`` (the RoCIT profile
fields of :mod:`rolemrc.data.roles`, plus the long profile/script text, or ``script_file``, a
path relative to the roles file).

- **context_instruct** (role-specific knowledge): each role's script is cut into segments of
  at most ``segment_chars`` characters at paragraph ends; for each segment the generator writes
  ``per_segment`` question-answer-confidence triples (JSON, checked; an answer that does not
  parse is asked again); triples with ``confidence >= min_confidence`` (1-10) are kept.
- **rolegpt** (speaking style): each general instruction is put to each role in dialogue mode:
  a system instruction with the role's description and catchphrases, then ``few_shot`` of the
  role's own dialogue exchanges as earlier user/assistant turns, then the instruction.

Each writes ``<out_dir>/<stage>/rows.jsonl`` in RoleBench's row shape (``{"role", "question",
"generated": [answer]}``), ``roles.jsonl`` (the profiles, for RoCIT) and ``sft.jsonl`` (the rows
as conversations whose system turn is the RoCIT instruction), so the output trains as it is::

    python train.py 'data.sft=[{path: <out_dir>/context_instruct/sft.jsonl}]'

Requests go through the synthesis generator (:class:`rolemrc.synth.client.Generator` on
:class:`rolemrc.api.ApiClient`): cached on disk as answers arrive, retried on faults, resumed
by a rerun; records without a usable answer go to ``<stage>/missing.jsonl`` and the run ends
non-zero until a rerun fills them in. Prompt wording lives in
``rolemrc/assets/synth/roleplay_prompts.yaml`` (``assets_dir`` overrides it like the others).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from rolemrc.api import Rejected
from rolemrc.data.readers import iter_source
from rolemrc.data.roles import RoleProfile, render_system
from rolemrc.data.schemas import DataError
from rolemrc.errors import InputNotFound
from rolemrc.synth.client import ChatRequest
from rolemrc.synth.records import extract_json_text, wire_schema
from rolemrc.synth.roleplay_config import ContextInstructConfig, RoleGPTConfig
from rolemrc.synth.store import fingerprint, write_jsonl

PROMPTS = "roleplay_prompts.yaml"  # its keys: rolemrc.synth.assets.ROLEPLAY
_AI_SLIP = re.compile(r"\b(as an ai|an ai (language )?model|as a language model|i am an ai)\b", re.I)


class Triple(BaseModel):
    question: str = Field(min_length=1)
    answer: str = Field(min_length=1)
    confidence: int = Field(ge=1, le=10)


class Triples(BaseModel):
    items: list[Triple]


# ---------------------------------------------------------------- inputs


def load_roles(path: str, need_script: bool) -> list[dict[str, Any]]:
    """Role records from ``path``, checked (errors name ``file:line`` and the field)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise InputNotFound(f"roles file not found: {p}")
    out, errors, seen = [], [], set()
    for file, line, rec in iter_source({"path": str(p)}):
        where = f"{file}:{line}"
        if not isinstance(rec, dict) or not isinstance(rec.get("name"), str) or not rec["name"].strip():
            errors.append(f"{where}: a role needs a non-empty string 'name'")
            continue
        name = rec["name"].strip()
        if name in seen:
            errors.append(f"{where}: role {name!r} appears twice")
            continue
        seen.add(name)
        phrases = rec.get("catchphrases") or []
        dialogue = rec.get("dialogue") or []
        if not (isinstance(phrases, list) and all(isinstance(x, str) for x in phrases)):
            errors.append(f"{where}: 'catchphrases' must be a list of strings")
            continue
        if not (isinstance(dialogue, list) and all(isinstance(d, dict) and isinstance(d.get("user"), str)
                                                  and isinstance(d.get("assistant"), str) for d in dialogue)):
            errors.append(f"{where}: 'dialogue' must be a list of {{user, assistant}} strings")
            continue
        script = rec.get("script")
        if script is None and rec.get("script_file"):
            sp = p.parent / str(rec["script_file"])
            if not sp.is_file():
                errors.append(f"{where}: script_file not found: {sp}")
                continue
            script = sp.read_text(encoding="utf-8")
        if need_script and not (isinstance(script, str) and script.strip()):
            errors.append(f"{where}: role {name!r} has no 'script' (or 'script_file') to read knowledge from")
            continue
        out.append({"name": name, "description": str(rec.get("description") or ""), "catchphrases": phrases,
                    "dialogue": dialogue, "script": script or ""})
    if errors:
        raise DataError(f"{len(errors)} invalid role record(s):\n  " + "\n  ".join(errors[:20]))
    if not out:
        raise DataError(f"{p}: no roles")
    return out


def load_questions(path: str) -> list[str]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise InputNotFound(f"rolegpt.questions: file not found: {p}")
    if p.suffix == ".txt":
        qs = [ln.strip() for ln in p.read_text(encoding="utf-8").splitlines() if ln.strip()]
    else:
        qs, errors = [], []
        for file, line, rec in iter_source({"path": str(p)}):
            q = rec.get("question") if isinstance(rec, dict) else None
            if not isinstance(q, str) or not q.strip():
                errors.append(f"{file}:{line}: needs a non-empty string 'question'")
            else:
                qs.append(q.strip())
        if errors:
            raise DataError(f"{len(errors)} invalid instruction(s):\n  " + "\n  ".join(errors[:20]))
    if not qs:
        raise DataError(f"{p}: no instructions")
    return list(dict.fromkeys(qs))


def segments(script: str, size: int) -> list[str]:
    """The script cut into pieces of at most ``size`` characters, at paragraph (else line,
    else character) boundaries; whitespace-only pieces dropped."""
    out: list[str] = []
    cur = ""
    for para in re.split(r"\n\s*\n", script.strip()):
        para = para.strip()
        while len(para) > size:  # a paragraph longer than a segment: cut at a line or a space
            cut = max(para.rfind("\n", 0, size), para.rfind(" ", 0, size))
            cut = cut if cut > size // 2 else size
            if cur:
                out.append(cur)
                cur = ""
            out.append(para[:cut].strip())
            para = para[cut:].strip()
        if cur and len(cur) + 2 + len(para) > size:
            out.append(cur)
            cur = ""
        cur = f"{cur}\n\n{para}" if cur else para
    if cur:
        out.append(cur)
    return [s for s in out if s.strip()]


def profile(role: dict[str, Any]) -> RoleProfile:
    return RoleProfile(role["name"], role["description"], list(role["catchphrases"]),
                       [(d["user"], d["assistant"]) for d in role["dialogue"]])


def _file_hash(path: str | None) -> str:
    if not path:
        return ""
    p = Path(path).expanduser()
    return hashlib.sha256(p.read_bytes()).hexdigest()[:16] if p.is_file() else "missing"


def _write_outputs(ctx: Any, stage: str, roles: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    d = ctx.stage(stage)
    write_jsonl(d.file("rows.jsonl"), rows)
    write_jsonl(d.file("roles.jsonl"), ({k: r[k] for k in ("name", "description", "catchphrases", "dialogue")}
                                        for r in roles))
    systems = {r["name"]: render_system(profile(r)) for r in roles}
    write_jsonl(d.file("sft.jsonl"), ({"task": stage, "conversations": [
        {"role": "System", "content": systems[row["role"]]}, {"role": "User", "content": row["question"]},
        {"role": "Assistant", "content": row["generated"][0]}]} for row in rows))


# ---------------------------------------------------------------- Context-Instruct


def check_triples(text: str) -> Triples:
    """A Context-Instruct answer's check: JSON ``{"items": [{question, answer, confidence}]}``."""
    try:
        data = json.loads(extract_json_text(text))
    except json.JSONDecodeError as e:
        raise Rejected("json", f"{e.msg} at char {e.pos}") from None
    try:
        return Triples.model_validate(data)
    except Exception as e:  # pydantic ValidationError
        raise Rejected("schema", str(e).splitlines()[0]) from None


def run_context_instruct(ctx: Any, c: ContextInstructConfig) -> dict[str, Any]:
    roles = load_roles(c.roles, need_script=True)
    plans: list[tuple[dict[str, Any], int, str]] = []
    for role in roles:
        segs = segments(role["script"], c.segment_chars)
        for i, seg in enumerate(segs[: c.max_segments] if c.max_segments else segs):
            plans.append((role, i, seg))
    placeholder = json.dumps({"items": [{"question": "What is a thing you know well?", "answer": "Much, friend.",
                                         "confidence": 10}] * c.per_segment})
    requests = [
        ChatRequest(
            kind="context_instruct", tag=f"{role['name']}#{i}",
            messages=[{"role": "system", "content": ctx.assets.render(PROMPTS, "context_instruct_system").strip()},
                      {"role": "user", "content": ctx.assets.render(
                          PROMPTS, "context_instruct_user", name=role["name"],
                          description=role["description"] or "(none given)", segment=seg, n=c.per_segment).strip()}],
            schema_name="qa_confidence_triples", schema=wire_schema(Triples), placeholder=placeholder,
            check=check_triples,
        )
        for role, i, seg in plans
    ]
    answers = ctx.generate("context_instruct", requests)
    rows: list[dict[str, Any]] = []
    seen: set[tuple[str, str]] = set()
    low = dup = 0
    for (role, i, _), text in zip(plans, answers):
        if text is None:
            continue  # missing: reported, asked again by a rerun
        for t in check_triples(text).items:
            key = (role["name"], t.question.strip().lower())
            if t.confidence < c.min_confidence:
                low += 1
            elif key in seen:
                dup += 1
            else:
                seen.add(key)
                rows.append({"role": role["name"], "question": t.question.strip(), "generated": [t.answer.strip()],
                             "confidence": t.confidence, "segment": i})
    _write_outputs(ctx, "context_instruct", roles, rows)
    return {"roles": len(roles), "segments": len(plans), "kept": len(rows), "below_confidence": low,
            "duplicates": dup, "missing": ctx.write_missing("context_instruct")}


# ---------------------------------------------------------------- RoleGPT


def check_reply(text: str) -> str:
    """A RoleGPT answer's check: non-empty and in character (no "as an AI" slip)."""
    if not text.strip():
        raise Rejected("empty", "empty reply")
    if _AI_SLIP.search(text):
        raise Rejected("out_of_character", "the reply says it is an AI")
    return text.strip()


def rolegpt_messages(ctx: Any, role: dict[str, Any], question: str, few_shot: int) -> list[dict[str, str]]:
    phrases = ", ".join(f'"{p}"' for p in role["catchphrases"]) or "(none given)"
    msgs = [{"role": "system", "content": ctx.assets.render(
        PROMPTS, "rolegpt_system", name=role["name"], description=role["description"] or "(none given)",
        catchphrases=phrases).strip()}]
    for d in role["dialogue"][:few_shot]:
        msgs += [{"role": "user", "content": d["user"]}, {"role": "assistant", "content": d["assistant"]}]
    msgs.append({"role": "user", "content": question})
    return msgs


def run_rolegpt(ctx: Any, c: RoleGPTConfig) -> dict[str, Any]:
    roles = load_roles(c.roles, need_script=False)
    questions = load_questions(c.questions)
    plans = [(role, q) for role in roles for q in (questions[: c.per_role] if c.per_role else questions)]
    requests = [ChatRequest(kind="rolegpt", tag=f"{role['name']}#{k}", messages=rolegpt_messages(ctx, role, q, c.few_shot),
                            schema_name="", schema=None, placeholder="Well, friend, that is a fine question.",
                            check=check_reply)
                for k, (role, q) in enumerate(plans)]
    answers = ctx.generate("rolegpt", requests)
    rows = [{"role": role["name"], "question": q, "generated": [check_reply(text)]}
            for (role, q), text in zip(plans, answers) if text is not None]
    _write_outputs(ctx, "rolegpt", roles, rows)
    return {"roles": len(roles), "instructions": len(questions), "requests": len(plans), "rows": len(rows),
            "missing": ctx.write_missing("rolegpt")}


def stage_fingerprint(ctx: Any, name: str, c: ContextInstructConfig | RoleGPTConfig,
                      generator_fp: dict[str, Any]) -> str:
    prompts = hashlib.sha256(ctx.assets.path(PROMPTS).read_bytes()).hexdigest()[:16]
    if name == "context_instruct":  # the roles as read: a changed script_file redoes the stage
        return fingerprint(name, asdict(c), load_roles(c.roles, need_script=True), generator_fp, prompts)
    if name == "rolegpt":
        return fingerprint(name, asdict(c), load_roles(c.roles, need_script=False), _file_hash(c.questions),
                           generator_fp, prompts)
    raise ValueError(name)

