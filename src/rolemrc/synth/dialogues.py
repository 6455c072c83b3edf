"""Dialogues stage: plan items per kind from quotas, ask the generator, build conversations.

Every item is planned deterministically from (seed, kind, index), so a resumed or repeated run
sends byte-identical requests and hits the cache. One request per item:

- free_chat / mrc_dialogue: a whole chat as JSON (opening line + user/role exchanges);
- answer, no_answer, refusal, attempt, nested_*, system_refusal: one stylised reply that rewrites a
  plain seed reply (the seed is the pair's "rejected");
- multi_turn_*: two stylised replies around a user turn that presses the role.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from rolemrc.synth import rules as rulebook
from rolemrc.synth.assets import Assets
from rolemrc.synth.client import ChatRequest
from rolemrc.synth.config import KINDS, DialoguesConfig
from rolemrc.synth.profiles import parse, parser
from rolemrc.synth.records import (
    Profile,
    Reply,
    TwoReplies,
    chat_model,
    check_messages,
    wire_schema,
)
from rolemrc.synth.text import fill, tidy

# kind -> (MRC partition it draws from, or None for free chats)
PARTITION: dict[str, Optional[tuple[str, str]]] = {
    "free_chat": None,
    "mrc_dialogue": ("related", "answerable"),
    "answer": ("related", "answerable"),
    "no_answer": ("related", "unanswerable"),
    "refusal": ("unrelated", "answerable"),
    "attempt": ("unrelated", "answerable"),
    "multi_turn_refuse": ("related", "unanswerable"),
    "multi_turn_attempt": ("unrelated", "answerable"),
    "nested_format": ("related", "answerable"),
    "nested_content": ("related", "answerable"),
    "system_refusal": ("related", "answerable"),
}

# kind -> (relation, outcome, suffix) of the task name role_{relation}_mrc_{outcome}_{narration}{suffix}
TASK_PARTS: dict[str, tuple[str, str, str]] = {
    "answer": ("related", "answer", ""),
    "no_answer": ("related", "refused", ""),
    "refusal": ("unrelated", "refused", ""),
    "attempt": ("unrelated", "answer", ""),
    "multi_turn_refuse": ("related", "refused", "-2ndrefused"),
    "multi_turn_attempt": ("unrelated", "refused", "-2ndanswer"),
    "nested_format": ("related", "answer", "-special-format"),
    "nested_content": ("related", "answer", "-special-content"),
    "system_refusal": ("related", "answer", "-refused"),
}


def category(kind: str, narration: bool, role_first: bool) -> str:
    """Task name written to the data (the dataset card's names)."""
    narr = "with_narration" if narration else "no_narration"
    if kind in ("free_chat", "mrc_dialogue"):
        base = "role_related_dialogue" if kind == "free_chat" else "role_related_mrc_dialogue"
        return f"{base}---{'role_first' if role_first else 'user_first'}---{narr}---answer"
    rel, outcome, suffix = TASK_PARTS[kind]
    return f"role_{rel}_mrc_{outcome}_{narr}{suffix}"


@dataclass
class Plan:
    id: str
    kind: str
    profile_id: str
    mrc_id: Optional[str]
    narration: bool
    role_first: bool


def _split_flags(n: int, ratio: float, rng: random.Random) -> list[bool]:
    """Exactly round(n * ratio) True values, shuffled (a ratio, not a coin per item)."""
    k = round(n * ratio)
    flags = [True] * k + [False] * (n - k)
    rng.shuffle(flags)
    return flags


def plan(cfg: DialoguesConfig, profile_ids: list[str], matches: dict[str, dict[str, Any]], seed: int) -> tuple[list[Plan], dict[str, int]]:
    """Items to build, per kind: quota items spread over profiles, then over their k matches."""
    plans: list[Plan] = []
    short: dict[str, int] = {}
    for kind in KINDS:
        quota = cfg.quotas.get(kind)
        part = PARTITION[kind]
        eligible = [p for p in profile_ids if part is None or matches[p][part[0]][part[1]]]
        n = len(profile_ids) if quota is None else quota
        if n and not eligible:
            short[kind] = n
            continue
        rng = random.Random(f"{seed}:plan:{kind}")
        order = eligible[:]
        rng.shuffle(order)
        narr = _split_flags(n, cfg.narration_ratio, rng)
        first = _split_flags(n, cfg.role_first_ratio, rng) if kind in ("free_chat", "mrc_dialogue") else [False] * n
        for j in range(n):
            pid = order[j % len(order)]
            mrc_id = None
            if part is not None:
                cands = matches[pid][part[0]][part[1]]
                # Reuse a profile only with its next-best match; wrap when k is exhausted.
                mrc_id = cands[(j // len(order)) % len(cands)]["id"]
            plans.append(Plan(id=f"{kind}-{j:06d}", kind=kind, profile_id=pid, mrc_id=mrc_id, narration=narr[j], role_first=first[j]))
    return plans, short


# ------------------------------------------------------------------ narration

_LEAD = r"(?:\([^()]*\)|\[[^\[\]]*\]|\*[^*\n]+\*)"
# Bracketed or starred stage directions at the start of a reply or of a sentence.
_NARRATION = re.compile(rf"(?:^|(?<=[.!?…]))\s*{_LEAD}|\*[^*\n]+\*")


def has_narration(text: str) -> bool:
    return bool(_NARRATION.search(text.strip()))


def strip_narration(text: str) -> str:
    return re.sub(r"\s{2,}", " ", _NARRATION.sub(" ", text.strip())).strip()


# ------------------------------------------------------------------ building

# Dry-run stand-in answers differ from their seed, so they count as valid items.
_DRY = " (stylised in a real run)"


@dataclass
class Built:
    """A request plus the function that turns its answer into an item (or an invalid record)."""

    request: ChatRequest
    finish: Callable[[str], tuple[Optional[dict[str, Any]], Optional[dict[str, Any]]]]


class Builder:
    def __init__(self, cfg: DialoguesConfig, assets: Assets, seed: int) -> None:
        self.cfg = cfg
        self.a = assets
        self.seed = seed
        self.counters: dict[str, int] = {"narration_stripped": 0, "rules_repaired": 0}

    # --- shared pieces
    def passages_block(self, mrc: dict[str, Any]) -> str:
        items = "\n".join(self.a.render("templates", "passage_item", n=i + 1, text=t) for i, t in enumerate(mrc["passages"]))
        return self.a.render("templates", "passages", items=items)

    def system(self, prof: Profile, narration: bool, mrc: Optional[dict[str, Any]] = None, extra: str = "") -> str:
        return tidy(
            self.a.render(
                "templates", "role_system", role_name=prof.role_name, profile=prof.render(),
                passages=self.passages_block(mrc) if mrc else "",
                narration=self.a.templates["narration_on" if narration else "narration_off"], extra=extra,
            )
        )

    def _common(self, prof: Profile, narration: bool) -> dict[str, Any]:
        lo, hi = self.cfg.reply_words
        return {
            "role_name": prof.role_name, "profile": prof.render(), "min_words": lo, "max_words": hi,
            "narration_rule": fill(self.a.prompts["narration_on" if narration else "narration_off"], "prompts.yaml: narration", role_name=prof.role_name),
        }

    def _messages(self, user: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.a.prompts["system"].strip()}, {"role": "user", "content": tidy(user)}]

    def _speech(self, text: str, narration: bool, where: str) -> tuple[Optional[str], str]:
        """Apply the narration policy to one role turn; (text, "") or (None, reason)."""
        text = text.strip()
        if not narration and has_narration(text):
            if self.cfg.on_narration_violation == "drop":
                return None, f"narration in a no-narration reply ({where})"
            text = strip_narration(text)
            self.counters["narration_stripped"] += 1
            if not text:
                return None, f"reply empty after removing narration ({where})"
        return text, ""

    def build(self, p: Plan, prof: Profile, mrc: Optional[dict[str, Any]]) -> Built:
        rng = random.Random(f"{self.seed}:item:{p.id}:{p.profile_id}:{p.mrc_id}")
        if p.kind in ("free_chat", "mrc_dialogue"):
            return self._chat(p, prof, mrc, rng)
        if p.kind in ("multi_turn_refuse", "multi_turn_attempt"):
            return self._two_turn(p, prof, mrc, rng)
        return self._single(p, prof, mrc, rng)

    def _item(self, p: Plan, conversation: list[dict[str, str]], pair: Optional[dict[str, Any]] = None, rule: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        check_messages(conversation, where=f"item {p.id}", last="Assistant")
        rec = {"id": p.id, "kind": p.kind, "task": category(p.kind, p.narration, p.role_first), "profile_id": p.profile_id, "mrc_id": p.mrc_id, "conversation": conversation, "pair": pair}
        if rule is not None:
            rec["rule"] = rule
        return rec

    def _invalid(self, p: Plan, reason: str, detail: str, text: str) -> dict[str, Any]:
        return {"id": p.id, "kind": p.kind, "profile_id": p.profile_id, "mrc_id": p.mrc_id, "reason": reason, "detail": detail, "raw": text[:4000]}

    # --- free chats and on-scene chats
    def _chat(self, p: Plan, prof: Profile, mrc: Optional[dict[str, Any]], rng: random.Random) -> Built:
        lo, hi = self.cfg.free_chat_exchanges if p.kind == "free_chat" else self.cfg.mrc_dialogue_exchanges
        n = rng.randint(lo, hi)
        model = chat_model(p.role_first, lo, hi)
        values = {**self._common(prof, p.narration), "n_exchanges": n}
        values["opening_rule"] = fill(self.a.prompts["role_opens" if p.role_first else "user_opens"], "prompts.yaml: role_opens/user_opens", role_name=prof.role_name)
        if p.kind == "mrc_dialogue":
            assert mrc is not None and mrc["answer"]
            values.update(passages=self.passages_block(mrc), question=mrc["question"], answer=mrc["answer"])
        user = self.a.render("prompts", p.kind, **values)
        placeholder = {"exchanges": [{"user": "…", "role": "…"}] * n}
        if p.role_first:
            placeholder = {"opening": "…", **placeholder}
        req = ChatRequest(kind=p.kind, tag=p.id, messages=self._messages(user), schema_name=model.__name__, schema=wire_schema(model), placeholder=json.dumps(placeholder), check=parser(model))
        system = self.system(prof, p.narration, mrc)

        def finish(text: str) -> tuple[Optional[dict[str, Any]], Optional[dict[str, Any]]]:
            obj, reason, detail = parse(model, text)
            if obj is None:
                return None, self._invalid(p, reason, detail, text)
            conv = [{"role": "System", "content": system}]
            turns: list[tuple[str, str]] = []
            if p.role_first:
                turns.append(("Assistant", obj.opening))
            for ex in obj.exchanges:
                turns += [("User", ex.user), ("Assistant", ex.role)]
            for i, (role, content) in enumerate(turns):
                if role == "Assistant":
                    content, why = self._speech(content, p.narration, f"turn {i}")
                    if content is None:
                        return None, self._invalid(p, "narration", why, text)
                conv.append({"role": role, "content": content.strip()})
            return self._item(p, conv), None

        return Built(req, finish)

    # --- single-turn replies (the eight MRC types and the nested / prioritized ones)
    def _single(self, p: Plan, prof: Profile, mrc: Optional[dict[str, Any]], rng: random.Random) -> Built:
        assert mrc is not None
        s, d = self.a.seeds, self.a.directives
        question = mrc["question"]
        extra, rule, rule_text = "", None, ""
        if p.kind in ("answer", "nested_format", "nested_content"):
            seed_reply = rejected = mrc["answer"]
        elif p.kind == "no_answer":
            seed_reply = rejected = rng.choice(s["no_answer"])
        elif p.kind == "refusal":
            seed_reply = rejected = rng.choice(s["refusal"])
        elif p.kind == "attempt":
            # MS MARCO questions are bare ("how do tides work"); close them before the request.
            q = question.rstrip()
            question = f"{q}{'' if q.endswith(('?', '.', '!')) else '?'} {rng.choice(s['attempt_requests'])}"
            seed_reply = rejected = fill(rng.choice(s["attempt"]), "seeds.yaml: attempt", answer=mrc["answer"])
        elif p.kind == "system_refusal":
            extra = self.a.render("templates", "directive", directive=rng.choice(d["directives"]))
            seed_reply = rng.choice(d["refusals"])
            # What the directive forbids is the raw answer: the most instructive rejected reply.
            rejected = mrc["answer"]
        else:
            raise ValueError(f"not a single-reply kind: {p.kind}")
        if p.kind in ("nested_format", "nested_content"):
            rule, rule_text = rulebook.sample(self.a.rules, p.kind.split("_")[1], rng)
            extra = self.a.render("templates", "rule", rule=rule_text)
        values = {**self._common(prof, p.narration), "context": self.passages_block(mrc), "question": question, "seed": seed_reply}
        if rule is not None and rule["type"] == "max_words":
            # Keep the asked-for length inside the word limit, or the prompt contradicts itself.
            values["min_words"] = min(values["min_words"], max(1, rule["n"] // 2))
            values["max_words"] = min(values["max_words"], rule["n"])
        values["rule_line"] = fill(self.a.prompts["rule_line"], "prompts.yaml: rule_line", rule=rule_text) if rule else ""
        req = ChatRequest(kind="reply", tag=p.id, messages=self._messages(self.a.render("prompts", "reply", **values)), schema_name="role_reply", schema=wire_schema(Reply), placeholder=json.dumps({"reply": seed_reply + _DRY}), check=parser(Reply))
        system = self.system(prof, p.narration, mrc, extra)

        def finish(text: str) -> tuple[Optional[dict[str, Any]], Optional[dict[str, Any]]]:
            obj, reason, detail = parse(Reply, text)
            if obj is None:
                return None, self._invalid(p, reason, detail, text)
            reply, why = self._speech(obj.reply, p.narration, "reply")
            if reply is None:
                return None, self._invalid(p, "narration", why, text)
            if rule is not None and not rulebook.check(rule, reply):
                if self.cfg.on_rule_violation == "drop":
                    return None, self._invalid(p, "rule", f"reply breaks {rulebook.public(rule)}", text)
                reply = rulebook.repair(rule, reply)
                self.counters["rules_repaired"] += 1
            if reply.strip() == rejected.strip():
                return None, self._invalid(p, "unchanged", "the stylised reply equals the seed reply", text)
            prompt = [{"role": "System", "content": system}, {"role": "User", "content": question}]
            pair = {"prompt": prompt, "chosen": reply, "rejected": rejected}
            return self._item(p, [*prompt, {"role": "Assistant", "content": reply}], pair, rulebook.public(rule) if rule else None), None

        return Built(req, finish)

    # --- two turns: the user presses after the first reply
    def _two_turn(self, p: Plan, prof: Profile, mrc: Optional[dict[str, Any]], rng: random.Random) -> Built:
        assert mrc is not None
        s = self.a.seeds
        if p.kind == "multi_turn_refuse":
            seed1, push, seed2 = rng.choice(s["no_answer"]), rng.choice(s["press_again"]), rng.choice(s["no_answer_again"])
        else:
            seed1, push = rng.choice(s["refusal"]), rng.choice(s["press_attempt"])
            seed2 = fill(rng.choice(s["attempt"]), "seeds.yaml: attempt", answer=mrc["answer"])
        question = mrc["question"]
        values = {**self._common(prof, p.narration), "context": self.passages_block(mrc), "question": question, "seed": seed1, "push": push, "seed2": seed2}
        req = ChatRequest(kind="two_turn", tag=p.id, messages=self._messages(self.a.render("prompts", "two_turn", **values)), schema_name="role_two_replies", schema=wire_schema(TwoReplies), placeholder=json.dumps({"first_reply": seed1 + _DRY, "second_reply": seed2 + _DRY}), check=parser(TwoReplies))
        system = self.system(prof, p.narration, mrc)

        def finish(text: str) -> tuple[Optional[dict[str, Any]], Optional[dict[str, Any]]]:
            obj, reason, detail = parse(TwoReplies, text)
            if obj is None:
                return None, self._invalid(p, reason, detail, text)
            r1, why1 = self._speech(obj.first_reply, p.narration, "first reply")
            r2, why2 = self._speech(obj.second_reply, p.narration, "second reply")
            if r1 is None or r2 is None:
                return None, self._invalid(p, "narration", why1 or why2, text)
            if r2.strip() == seed2.strip():
                return None, self._invalid(p, "unchanged", "the stylised reply equals the seed reply", text)
            prompt = [{"role": "System", "content": system}, {"role": "User", "content": question}, {"role": "Assistant", "content": r1}, {"role": "User", "content": push}]
            pair = {"prompt": prompt, "chosen": r2, "rejected": seed2}
            return self._item(p, [*prompt, {"role": "Assistant", "content": r2}], pair), None

        return Built(req, finish)


def load_profile(rec: dict[str, Any]) -> Profile:
    return Profile.model_validate(rec["profile"])

