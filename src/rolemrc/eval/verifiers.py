"""Program checks for the nested-instruction (NI) rules, and how well the judge agrees with them.

A test item may carry ``"rule": {"type": ..., ...}``. Supported types and their parameters
(the same checks as the sample data's generator, ``scripts/make_sample_data.py``):

=========================  ==========================================================
``starts_with_emoji``      first non-space character is an emoji
``all_caps``               at least one cased letter and no lowercase letter
``ends_with_punctuation``  every sentence ends with ``char``: the reply ends with it and
                           no other ``. ? !`` stands before a space or the end
``no_commas``              no comma (ASCII ``,`` or fullwidth ``，``)
``max_words``              at most ``n`` whitespace-separated words
``forbidden_char``         ``char`` never appears, in any case (``case_sensitive: true``
                           to match case)
``includes_word``          ``word`` appears as a whole word, in any case
=========================  ==========================================================

``value`` is accepted in place of ``char`` / ``n`` / ``word``. The checks are literal: a
bracketed narration before the emoji, say, breaks "starts with an emoji".
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

RULE_TYPES: tuple[str, ...] = (
    "starts_with_emoji",
    "all_caps",
    "ends_with_punctuation",
    "max_words",
    "forbidden_char",
    "no_commas",
    "includes_word",
)

# Code-point ranges whose characters are emoji (pictographs, symbols, dingbats, flags...).
# No emoji package is in the stack; these ranges cover the Unicode emoji blocks.
_EMOJI_RANGES: tuple[tuple[int, int], ...] = (
    (0x1F000, 0x1FAFF),  # mahjong/cards, enclosed supplements, flags, pictographs, emoticons...
    (0x2600, 0x27BF),  # misc symbols, dingbats
    # Emoji scattered through otherwise textual blocks (only the emoji code points).
    (0x231A, 0x231B), (0x2328, 0x2328), (0x23CF, 0x23CF), (0x23E9, 0x23F3), (0x23F8, 0x23FA),
    (0x2194, 0x2199), (0x21A9, 0x21AA), (0x25AA, 0x25AB), (0x25B6, 0x25B6), (0x25C0, 0x25C0),
    (0x25FB, 0x25FE), (0x2B05, 0x2B07), (0x2B1B, 0x2B1C), (0x2B50, 0x2B50), (0x2B55, 0x2B55),
    (0x3030, 0x3030), (0x303D, 0x303D), (0x3297, 0x3297), (0x3299, 0x3299),
    (0x203C, 0x203C), (0x2049, 0x2049), (0x2122, 0x2122), (0x2139, 0x2139), (0x24C2, 0x24C2),
    (0x00A9, 0x00A9), (0x00AE, 0x00AE),
)
_KEYCAP = "\u20e3"
_VS16 = "\ufe0f"


def is_emoji(ch: str) -> bool:
    """True if the single character ``ch`` is an emoji code point."""
    cp = ord(ch)
    return any(lo <= cp <= hi for lo, hi in _EMOJI_RANGES)


def starts_with_emoji(text: str) -> bool:
    s = text.lstrip()
    if not s:
        return False
    if is_emoji(s[0]):
        return True
    # Keycap sequences such as "1️⃣": a digit, # or *, optional VS16, then U+20E3.
    rest = s[1:].lstrip(_VS16)
    return s[0] in "0123456789#*" and rest.startswith(_KEYCAP)


def all_caps(text: str) -> bool:
    return any(c.isupper() for c in text) and not any(c.islower() for c in text)


def _param(rule: Mapping[str, Any], name: str) -> Any:
    for key in (name, "value"):
        if rule.get(key) not in (None, ""):
            return rule[key]
    raise ValueError(f"rule {dict(rule)!r} needs a {name!r} (or 'value') field")


def _forbidden(rule: Mapping[str, Any], text: str) -> bool:
    char = str(_param(rule, "char"))
    if rule.get("case_sensitive"):
        return char not in text
    return char.casefold() not in text.casefold()


# A sentence ends at . ? ! followed by whitespace or the end of the reply.
_SENTENCE_END = re.compile(r"[.?!](?=\s|$)")


def _ends_with(rule: Mapping[str, Any], text: str) -> bool:
    char = str(_param(rule, "char"))
    body = text.rstrip()
    if not body.endswith(char):
        return False
    return all(m.group() == char for m in _SENTENCE_END.finditer(body)) if char in ".?!" else True


def _includes_word(rule: Mapping[str, Any], text: str) -> bool:
    word = str(_param(rule, "word"))
    return re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text, re.IGNORECASE) is not None


_CHECKS: dict[str, Callable[[Mapping[str, Any], str], bool]] = {
    "starts_with_emoji": lambda rule, t: starts_with_emoji(t),
    "all_caps": lambda rule, t: all_caps(t),
    "ends_with_punctuation": _ends_with,
    "max_words": lambda rule, t: len(t.split()) <= int(_param(rule, "n")),
    "forbidden_char": _forbidden,
    "no_commas": lambda rule, t: "," not in t and "\uff0c" not in t,
    "includes_word": _includes_word,
}


def verify(rule: Mapping[str, Any], reply: str) -> bool:
    """Whether ``reply`` obeys ``rule``; ValueError for an unknown rule type."""
    kind = rule.get("type")
    if kind not in _CHECKS:
        raise ValueError(f"unknown rule type {kind!r}; known: {', '.join(RULE_TYPES)}")
    return bool(_CHECKS[kind](rule, reply))


def verify_item(item: Any, reply: str) -> bool | None:
    """Verify a test item's ``rule`` (dict record or TestItem); None when it has none."""
    rule = item.get("rule") if isinstance(item, Mapping) else getattr(item, "rule", None)
    return None if rule is None else verify(rule, reply)


def verify_all(
    test_items: Sequence[Any], replies: Sequence[str], ids: Sequence[str] | None = None
) -> dict[str, bool]:
    """{item id: passes} for every item that carries a rule (ids default to positions)."""
    if len(test_items) != len(replies):
        raise ValueError(f"{len(test_items)} test items but {len(replies)} replies")
    ids = [str(i) for i in range(len(test_items))] if ids is None else [str(i) for i in ids]
    out = {}
    for item_id, item, reply in zip(ids, test_items, replies, strict=True):
        result = verify_item(item, reply)
        if result is not None:
            out[item_id] = result
    return out


@dataclass
class Agreement:
    """Judge (NI verdicts) vs rule verifier, over items having both a rule and an ok verdict.

    ``confusion`` keys are ``judge{0,1}_verifier{0,1}``; ``n_without_verdict`` counts
    rule-carrying items whose NI judgement was not usable (unparseable, failed, budget).
    """

    n: int
    n_agree: int
    rate: float | None
    confusion: dict[str, int]
    n_without_verdict: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def agreement(verdicts: Iterable[Any], verifier: Mapping[str, bool], dimension: str = "NI") -> Agreement:
    """Agreement of the judge's ``dimension`` verdicts with ``verifier`` results by item id.

    ``verdicts`` are :class:`rolemrc.eval.judge.Verdict`-like (``item_id``, ``dimension``,
    ``status``, ``verdict``).
    """
    confusion = {f"judge{j}_verifier{v}": 0 for j in (1, 0) for v in (1, 0)}
    judged: dict[str, int] = {}
    for vd in verdicts:
        if vd.dimension == dimension and vd.status == "ok" and vd.item_id in verifier:
            judged[str(vd.item_id)] = int(vd.verdict)
    for item_id, j in judged.items():
        confusion[f"judge{j}_verifier{int(verifier[item_id])}"] += 1
    n = len(judged)
    n_agree = confusion["judge1_verifier1"] + confusion["judge0_verifier0"]
    return Agreement(
        n=n,
        n_agree=n_agree,
        rate=(n_agree / n) if n else None,
        confusion=confusion,
        n_without_verdict=sum(1 for k in verifier if k not in judged),
    )
