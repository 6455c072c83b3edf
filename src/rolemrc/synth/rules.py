"""Nested formatting/content rules: sampling from the pool, checking a reply, repairing it.

A sampled rule is ``{"type": ..., <params>}`` (the shape written to ``test.jsonl``) plus the
phrasing placed in the system message. Checking uses ``rolemrc.eval.verifiers``, the same code
that scores models on these rules.
"""

from __future__ import annotations

import random
import re
from typing import Any

from rolemrc.eval.verifiers import verify
from rolemrc.synth.records import RULE_PARAMS
from rolemrc.synth.text import fill

KINDS = ("format", "content")


def parse_pool(items: Any, where: str) -> list[dict[str, Any]]:
    """Validate the rule pool (``rules.yaml``); errors name the entry."""
    if not isinstance(items, list) or not items:
        raise ValueError(f"{where}: 'rules' must be a non-empty list")
    pool = []
    for i, r in enumerate(items):
        at = f"{where}: rules[{i}]"
        if not isinstance(r, dict):
            raise ValueError(f"{at}: expected a mapping")
        t = r.get("type")
        if t not in RULE_PARAMS:
            raise ValueError(f"{at}.type: {t!r} is not one of {sorted(RULE_PARAMS)}")
        if r.get("kind") not in KINDS:
            raise ValueError(f"{at}.kind: must be one of {KINDS}")
        w = r.get("weight", 1.0)
        if not isinstance(w, (int, float)) or w < 0:
            raise ValueError(f"{at}.weight: must be a number >= 0")
        params = r.get("params") or {}
        for p in RULE_PARAMS[t]:
            if not params.get(p):
                raise ValueError(f"{at}.params.{p}: a non-empty list is required for {t}")
        for k, v in params.items():
            if not isinstance(v, list) or not v:
                raise ValueError(f"{at}.params.{k}: must be a non-empty list")
        if t == "max_words" and not all(isinstance(n, int) and n > 0 for n in params["n"]):
            raise ValueError(f"{at}.params.n: must be positive integers")
        if t in ("ends_with_punctuation", "forbidden_char") and not all(isinstance(c, str) and len(c) == 1 for c in params["char"]):
            raise ValueError(f"{at}.params.char: must be single characters")
        phr = r.get("phrasings")
        if not isinstance(phr, list) or not phr or not all(isinstance(p, str) and p.strip() for p in phr):
            raise ValueError(f"{at}.phrasings: must be a non-empty list of strings")
        pool.append({"type": t, "kind": r["kind"], "weight": float(w), "params": params, "phrasings": phr, "where": at})
    return pool


def sample(pool: list[dict[str, Any]], kind: str, rng: random.Random) -> tuple[dict[str, Any], str]:
    """Pick a rule of ``kind`` by weight; returns (rule record, phrasing for the system message)."""
    cands = [r for r in pool if r["kind"] == kind and r["weight"] > 0]
    if not cands:
        raise ValueError(f"rules.yaml: no rule of kind {kind!r} with a positive weight")
    r = rng.choices(cands, weights=[c["weight"] for c in cands], k=1)[0]
    chosen = {k: rng.choice(v) for k, v in sorted(r["params"].items())}
    record = {"type": r["type"], **{p: chosen[p] for p in RULE_PARAMS[r["type"]]}}
    text = fill(rng.choice(r["phrasings"]), r["where"] + ".phrasings", **chosen)
    # Non-record params (e.g. the emoji a repair may prepend) travel privately.
    return {**record, "_extra": {k: v for k, v in chosen.items() if k not in record}}, text


def public(rule: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in rule.items() if not k.startswith("_")}


def check(rule: dict[str, Any], text: str) -> bool:
    """The evaluation's own verifier, so synthesized references pass exactly what is scored."""
    return verify(public(rule), text)


_TRAILING = re.compile(r"[\s.!?;:,~…]+$")
_SENTENCE_END = re.compile(r"[.?!](?=\s)")


def repair(rule: dict[str, Any], text: str) -> str:
    """Smallest edit that makes ``text`` obey ``rule`` (used when on_rule_violation=fix)."""
    t = rule["type"]
    s = text.strip()
    if t == "starts_with_emoji":
        emoji = rule.get("_extra", {}).get("emoji", "🙂")
        out = f"{emoji} {s}"
    elif t == "all_caps":
        out = s.upper()
    elif t == "ends_with_punctuation":
        char = rule["char"]
        body = _TRAILING.sub("", s)
        if char in ".?!":
            # The verifier wants every sentence, not only the last, to end with the character.
            body = _SENTENCE_END.sub(char, body)
        out = body + char
    elif t == "max_words":
        out = " ".join(s.split()[: rule["n"]]).rstrip(",;:")
    elif t == "forbidden_char":
        c = rule["char"]
        out = re.sub(r"\s{2,}", " ", s.replace(c.lower(), "").replace(c.upper(), "")).strip()
    elif t == "no_commas":
        out = s.replace(",", "").replace("，", "")
    else:
        raise ValueError(f"unknown rule type {t!r}")
    if not check(rule, out):
        raise AssertionError(f"repair of {public(rule)} did not produce a compliant reply: {out!r}")
    return out
