"""Input data: personas, the MRC pool, and external datasets mixed into the output.

Hub datasets are read with ``datasets``; local files (.jsonl/.json/.txt/.parquet/.csv) are read
here so a bad line is reported with its file and line number.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from rolemrc.synth.config import MixSource, MRCConfig, PersonasConfig
from rolemrc.synth.store import read_jsonl_lines


def _iter_file(path: str, text_field: Optional[str] = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (location, record) from a local file; location is 'file:line' or 'file#row'."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"input file not found: {p}")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json"):
        with open(p, encoding="utf-8") as f:
            head = f.read(1)
            f.seek(0)
            if suffix == ".json" and head == "[":
                try:
                    rows = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{p}:{e.lineno}: not valid JSON ({e.msg})") from None
                for i, rec in enumerate(rows):
                    if not isinstance(rec, dict):
                        raise ValueError(f"{p}#{i}: expected an object, got {type(rec).__name__}")
                    yield f"{p}#{i}", rec
                return
        for lineno, rec in read_jsonl_lines(p):
            yield f"{p}:{lineno}", rec
    elif suffix == ".txt":
        if text_field is None:
            raise ValueError(f"{p}: plain-text input only works for personas (one per line)")
        with open(p, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield f"{p}:{lineno}", {text_field: line.strip()}
    elif suffix in (".parquet", ".csv"):
        import datasets

        ds = datasets.load_dataset(suffix[1:], data_files=str(p), split="train")
        for i, rec in enumerate(ds):
            yield f"{p}#{i}", rec
    else:
        raise ValueError(f"{p}: unsupported input format {suffix!r} (use .jsonl, .json, .txt, .parquet or .csv)")


def _hub(path: str, name: Optional[str], split: str, data_files: Optional[str] = None) -> Any:
    import datasets

    return datasets.load_dataset(path, name, split=split, data_files=data_files)


def _rows(source: str, path: str, name: Optional[str], split: str, text_field: Optional[str], seed: int, data_files: Optional[str] = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """Rows in a seeded random order, with a location for error messages."""
    if source == "hub":
        ds = _hub(path, name, split, data_files).shuffle(seed=seed)
        for i, rec in enumerate(ds):
            yield f"{path}[{split}]#{i}", rec
    else:
        rows = list(_iter_file(path, text_field))
        random.Random(seed).shuffle(rows)
        yield from rows


def _norm(text: str) -> str:
    return re.sub(r"\W+", " ", text.lower()).strip()


def load_personas(cfg: PersonasConfig, seed: int) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Sample ``cfg.n`` personas (seeded), dropping duplicates and too-short lines."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    stats = {"read": 0, "duplicates": 0, "too_short": 0}
    for loc, rec in _rows(cfg.source, cfg.path, cfg.name, cfg.split, cfg.field, seed):
        if len(out) >= cfg.n:
            break
        if cfg.field not in rec:
            raise ValueError(f"{loc}: missing field {cfg.field!r} (fields present: {', '.join(sorted(rec))}); set personas.field")
        text = rec[cfg.field]
        if not isinstance(text, str):
            raise ValueError(f"{loc}: field {cfg.field!r} must be a string, got {type(text).__name__}")
        stats["read"] += 1
        text = " ".join(text.split())
        if len(text) < cfg.min_chars:
            stats["too_short"] += 1
            continue
        key = _norm(text)
        if cfg.dedup and key in seen:
            stats["duplicates"] += 1
            continue
        seen.add(key)
        out.append({"id": f"p{len(out):06d}", "persona": text, "source": loc})
    return out, stats


def _mrc_item(rec: dict[str, Any], loc: str, cfg: MRCConfig) -> Optional[dict[str, Any]]:
    """Normalise one MS MARCO-shaped row to {id, question, passages, selected, answer, answerable}."""
    for f in (cfg.question_field, cfg.answers_field, cfg.passages_field):
        if f not in rec:
            raise ValueError(f"{loc}: missing field {f!r} (fields present: {', '.join(sorted(rec))}); set the mrc.*_field options")
    question = rec[cfg.question_field]
    answers = rec[cfg.answers_field]
    passages = rec[cfg.passages_field]
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{loc}: field {cfg.question_field!r} must be a non-empty string")
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"{loc}: field {cfg.answers_field!r} must be a list of strings")
    # MS MARCO stores passages as a dict of parallel lists; plain lists of strings work too.
    if isinstance(passages, dict):
        if cfg.passage_text_field not in passages:
            raise ValueError(f"{loc}: {cfg.passages_field}.{cfg.passage_text_field} missing")
        texts = passages[cfg.passage_text_field]
        selected = passages.get(cfg.is_selected_field) or [0] * len(texts)
    elif isinstance(passages, list):
        texts, selected = passages, [0] * len(passages)
    else:
        raise ValueError(f"{loc}: field {cfg.passages_field!r} must be a dict of lists or a list of strings")
    if not texts:
        return None  # a few MS MARCO rows have no passages; counted and skipped by the caller
    if not all(isinstance(t, str) for t in texts) or len(selected) != len(texts):
        raise ValueError(f"{loc}: passages must be strings (with a matching {cfg.is_selected_field} list)")
    answers = [a.strip() for a in answers if a.strip()]
    answerable = bool(answers) and answers != [cfg.no_answer_marker]
    # Keep the selected passages when cutting to max_passages, in their original order.
    keep = sorted(range(len(texts)), key=lambda i: (not selected[i], i))[: cfg.max_passages]
    keep.sort()
    rid = rec.get(cfg.id_field)
    return {
        "id": str(rid) if rid is not None else None,
        "question": question.strip(),
        "passages": [" ".join(texts[i].split()) for i in keep],
        "selected": [int(bool(selected[i])) for i in keep],
        "answer": answers[0] if answerable else None,
        "answerable": answerable,
    }


def load_mrc(cfg: MRCConfig, seed: int) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Sample answerable and unanswerable MRC triplets (seeded) up to the configured counts."""
    want = {True: cfg.n_answerable, False: cfg.n_unanswerable}
    got: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    seen: set[str] = set()
    stats = {"read": 0, "duplicates": 0, "no_passages": 0}
    for loc, rec in _rows(cfg.source, cfg.path, cfg.name, cfg.split, None, seed):
        if all(len(got[k]) >= want[k] for k in want):
            break
        item = _mrc_item(rec, loc, cfg)
        stats["read"] += 1
        if item is None:
            stats["no_passages"] += 1
            continue
        key = _norm(item["question"])
        if key in seen:
            stats["duplicates"] += 1
            continue
        if len(got[item["answerable"]]) >= want[item["answerable"]]:
            continue
        seen.add(key)
        got[item["answerable"]].append(item)
    items = got[True] + got[False]
    for i, it in enumerate(items):
        # Source ids may repeat across splits; ours are unique and stable for a given seed.
        it["source_id"] = it.pop("id")
        it["id"] = f"m{i:06d}"
    stats["answerable"] = len(got[True])
    stats["unanswerable"] = len(got[False])
    return items, stats


# ------------------------------------------------------------------ mixing

_ROLE = {"system": "System", "user": "User", "human": "User", "assistant": "Assistant", "gpt": "Assistant"}


def _messages(raw: Any, loc: str, default_system: str) -> Optional[list[dict[str, str]]]:
    """Normalise a chat to capitalised roles with a system message; None if it cannot be."""
    if not isinstance(raw, list):
        raise ValueError(f"{loc}: expected a list of messages, got {type(raw).__name__}")
    out = []
    for m in raw:
        if not isinstance(m, dict) or "content" not in m or "role" not in m:
            raise ValueError(f"{loc}: messages need 'role' and 'content', got {m!r:.100}")
        role = _ROLE.get(str(m["role"]).lower())
        if role is None:
            return None
        content = m["content"] if isinstance(m["content"], str) else ""
        if not content.strip():
            return None
        out.append({"role": role, "content": content})
    if not out or out[0]["role"] != "System":
        out.insert(0, {"role": "System", "content": default_system})
    for i in range(1, len(out)):
        if out[i]["role"] == "System" or (i > 1 and out[i]["role"] == out[i - 1]["role"]):
            return None
    return out if len(out) >= 2 else None


def load_mix(src: MixSource, seed: int) -> tuple[list[dict[str, Any]], int]:
    """Rows of an external dataset in the RoleMRC shapes; returns (records, rows skipped).

    Rows that cannot be put into the shape (empty turns, unknown roles, broken alternation)
    are skipped and counted; a row lacking the configured fields raises, naming it.
    """
    out: list[dict[str, Any]] = []
    skipped = 0
    for loc, rec in _rows(src.source, src.path, src.name, src.split, None, seed, src.data_files):
        if src.n is not None and len(out) >= src.n:
            break
        if src.adapter == "messages":
            if src.messages_field not in rec:
                raise ValueError(f"{loc}: missing field {src.messages_field!r} (fields: {', '.join(sorted(rec))})")
            msgs = _messages(rec[src.messages_field], loc, src.default_system)
            # Training learns from assistant turns: drop a trailing user turn.
            if msgs and msgs[-1]["role"] == "User":
                msgs = msgs[:-1]
            if not msgs or msgs[-1]["role"] != "Assistant":
                skipped += 1
                continue
            out.append({"task": src.task, "conversations": msgs})
        elif src.adapter == "preference":
            for f in (src.chosen_field, src.rejected_field):
                if f not in rec:
                    raise ValueError(f"{loc}: missing field {f!r} (fields: {', '.join(sorted(rec))})")
            ch = _messages(rec[src.chosen_field], loc, src.default_system)
            rj = _messages(rec[src.rejected_field], loc, src.default_system)
            if not ch or not rj or ch[-1]["role"] != "Assistant" or rj[-1]["role"] != "Assistant" or ch[:-1] != rj[:-1] or ch[-1]["content"].strip() == rj[-1]["content"].strip() or len(ch) < 3:
                skipped += 1
                continue
            if src.into == "pairs":
                out.append({"task": src.task, "prompt": ch[:-1], "chosen": ch[-1]["content"], "rejected": rj[-1]["content"]})
            else:
                out.append({"task": src.task, "conversations": ch})
        else:  # role_qa: RoleBench-style rows (role, question, one or more generated answers)
            for f in (src.role_field, src.question_field, src.answer_field):
                if f not in rec:
                    raise ValueError(f"{loc}: missing field {f!r} (fields: {', '.join(sorted(rec))})")
            ans = rec[src.answer_field]
            ans = ans[0] if isinstance(ans, list) and ans else ans
            role, q = rec[src.role_field], rec[src.question_field]
            if not all(isinstance(x, str) and x.strip() for x in (ans, role, q)):
                skipped += 1
                continue
            system = src.default_system.replace("$role", role)
            out.append({"task": src.task, "conversations": [{"role": "System", "content": system}, {"role": "User", "content": q}, {"role": "Assistant", "content": ans}]})
    return out, skipped


# ------------------------------------------------------------------ dry-run stand-ins


def standin_personas(cfg: PersonasConfig) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """``personas.n`` placeholder personas, for a dry run that cannot read ``personas.path``
    (the hub offline): the request count is the real one, token estimates are rough."""
    out = [{"id": f"p{i:06d}", "persona": f"A stand-in persona number {i} for planning a dry run.", "source": "stand-in"}
           for i in range(cfg.n)]
    return out, {"read": 0, "stand_in": cfg.n}


def standin_mrc(cfg: MRCConfig) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """``mrc.n_answerable`` + ``mrc.n_unanswerable`` placeholder MRC items (see standin_personas)."""
    items = []
    for answerable, n in ((True, cfg.n_answerable), (False, cfg.n_unanswerable)):
        for _ in range(n):
            items.append({
                "question": f"Stand-in question {len(items)}?",
                "passages": ["A stand-in passage of typical length for planning a dry run. " * 6],
                "selected": [int(answerable)],
                "answer": "A stand-in answer." if answerable else None,
                "answerable": answerable,
                "source_id": None,
                "id": f"m{len(items):06d}",
            })
    return items, {"read": 0, "stand_in": len(items), "answerable": cfg.n_answerable, "unanswerable": cfg.n_unanswerable}
