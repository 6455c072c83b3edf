"""The ``verifier`` reward: RoleMRC's nested-instruction rules checked by program."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rolemrc.eval.verifiers import RULE_TYPES, verify
from rolemrc.rewards.text import completion_texts

VERIFIER_MODES: tuple[str, ...] = ("all", "fraction")


class VerifierReward:
    """1.0 / 0.0 per completion: whether it obeys its prompt's ``rule`` (``mode="all"``: every rule,
    when ``rule`` is a list), or the fraction of the rules it obeys (``mode="fraction"``). A prompt
    without a rule gives ``None`` (not applicable). An unknown rule type is a ValueError naming the
    completion's position and the known types, before anything is scored."""

    def __init__(self, mode: str = "all") -> None:
        if mode not in VERIFIER_MODES:
            raise ValueError(f"verifier mode must be one of {', '.join(VERIFIER_MODES)}, got {mode!r}")
        self.mode = mode

    def __call__(self, *, prompts: Sequence[Any], completions: Sequence[Any], rule: Sequence[Any] | None = None,
                 **columns: Any) -> list[float | None]:
        rules = [None] * len(completions) if rule is None else list(rule)
        if len(rules) != len(completions):
            raise ValueError(f"{len(completions)} completions but {len(rules)} rules")
        parsed = [self._rules(i, r) for i, r in enumerate(rules)]
        texts = completion_texts(completions)
        out: list[float | None] = []
        for rs, text in zip(parsed, texts, strict=True):
            if not rs:
                out.append(None)
                continue
            met = [verify(r, text) for r in rs]
            out.append(float(all(met)) if self.mode == "all" else sum(met) / len(met))
        return out

    @staticmethod
    def _rules(index: int, rule: Any) -> list[Mapping[str, Any]]:
        rules = [] if rule is None else [rule] if isinstance(rule, Mapping) else list(rule)
        for r in rules:
            if not isinstance(r, Mapping) or r.get("type") not in RULE_TYPES:
                raise ValueError(f"completion {index}: rule {r!r} has no known type; known: {', '.join(RULE_TYPES)}")
        return rules
