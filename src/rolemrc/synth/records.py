"""Record shapes: what the generator must return (pydantic) and what the pipeline writes.

Generator outputs are validated by pydantic models; the JSON schema sent to the server is
derived from the same models, so the contract lives in one place.
"""

from __future__ import annotations

import json
import re
from functools import cache
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

# The seven profile sections (paper §3), in the order they are rendered.
SECTION_TITLES: dict[str, str] = {
    "role_name_and_brief_description": "Role Name and Brief Description",
    "specific_abilities_and_skills": "Specific Abilities and Skills",
    "speech_style": "Speech Style",
    "personality_characteristics": "Personality Characteristics",
    "past_experience_and_background": "Past Experience and Background",
    "ability_and_knowledge_boundaries": "Ability and Knowledge Boundaries",
    "speech_examples": "Speech Examples",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)


def _text() -> Any:
    return Field(min_length=1)


class Profile(_Strict):
    """A standardized role profile: a short name plus the seven sections."""

    role_name: str = Field(min_length=1, max_length=80)
    role_name_and_brief_description: str = _text()
    specific_abilities_and_skills: str = _text()
    speech_style: str = _text()
    personality_characteristics: str = _text()
    past_experience_and_background: str = _text()
    ability_and_knowledge_boundaries: str = _text()
    speech_examples: list[str] = Field(min_length=1, max_length=8)

    @field_validator("speech_examples")
    @classmethod
    def _examples_non_empty(cls, v: list[str]) -> list[str]:
        v = [s.strip() for s in v]
        if any(not s for s in v):
            raise ValueError("speech examples must be non-empty strings")
        return v

    def render(self) -> str:
        """The profile as the text block placed in the system message."""
        parts = []
        for key, title in SECTION_TITLES.items():
            value = getattr(self, key)
            if isinstance(value, list):
                value = "\n".join(f"- {s}" for s in value)
            parts.append(f"{title}:\n{value}")
        return "\n\n".join(parts)

    def matching_text(self, sections: list[str]) -> str:
        out = []
        for key in sections:
            if key not in SECTION_TITLES:
                raise ValueError(f"match.profile_sections: unknown section {key!r}; known: {', '.join(SECTION_TITLES)}")
            value = getattr(self, key)
            out.append(" ".join(value) if isinstance(value, list) else value)
        return "\n".join(out)


class Exchange(_Strict):
    user: str = _text()
    role: str = _text()


class Reply(_Strict):
    reply: str = _text()


class TwoReplies(_Strict):
    first_reply: str = _text()
    second_reply: str = _text()


@cache
def chat_model(role_first: bool, lo: int, hi: int) -> type[BaseModel]:
    """Schema of a generated chat: an optional opening line by the role, then user/role exchanges.

    Pairs make strict alternation and "the role speaks last" hold by construction.
    """
    fields: dict[str, Any] = {"exchanges": (list[Exchange], Field(min_length=lo, max_length=hi))}
    if role_first:
        fields = {"opening": (str, Field(min_length=1)), **fields}
    name = f"chat_{'role' if role_first else 'user'}_first_{lo}_{hi}"
    return create_model(name, __base__=_Strict, **fields)


# Keywords that some OpenAI-compatible servers reject inside strict JSON schemas; pydantic still
# enforces them when the answer comes back.
_UNSENT_KEYWORDS = ("minLength", "maxLength", "title")


@cache
def _wire_schema(model: type[BaseModel]) -> str:
    return json.dumps(_clean_schema(model))


def wire_schema(model: type[BaseModel]) -> dict[str, Any]:
    """JSON schema of ``model`` in the form sent as ``response_format`` (a fresh copy)."""
    return json.loads(_wire_schema(model))


def _clean_schema(model: type[BaseModel]) -> dict[str, Any]:

    def clean(node: Any, names: bool = False) -> Any:
        # ``names``: the keys of this mapping are field / definition names, not keywords.
        if isinstance(node, dict):
            if names:
                return {k: clean(v) for k, v in node.items()}
            return {k: clean(v, k in ("properties", "$defs")) for k, v in node.items() if k not in _UNSENT_KEYWORDS}
        if isinstance(node, list):
            return [clean(v) for v in node]
        return node

    return clean(model.model_json_schema())


# ---------------------------------------------------------------- written shapes

ROLES = ("System", "User", "Assistant")


def check_messages(messages: Any, *, where: str, last: Optional[str]) -> None:
    """Raise ValueError (naming ``where``) unless ``messages`` is a RoleMRC message list.

    System first, then User/Assistant alternating (the assistant may speak first), no empty
    content, and the last message's role equal to ``last`` when given.
    """
    if not isinstance(messages, list) or len(messages) < 2:
        raise ValueError(f"{where}: expected a list of at least 2 messages, got {type(messages).__name__} of length {len(messages) if isinstance(messages, list) else '-'}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise ValueError(f"{where}[{i}]: expected {{'role', 'content'}}, got {m!r:.120}")
        if m["role"] not in ROLES:
            raise ValueError(f"{where}[{i}].role: {m['role']!r} is not one of {ROLES}")
        if not isinstance(m["content"], str) or not m["content"].strip():
            raise ValueError(f"{where}[{i}].content: empty or not a string")
    if messages[0]["role"] != "System":
        raise ValueError(f"{where}[0].role: must be System, got {messages[0]['role']!r}")
    for i in range(1, len(messages)):
        if messages[i]["role"] == "System":
            raise ValueError(f"{where}[{i}].role: System only allowed first")
        if i > 1 and messages[i]["role"] == messages[i - 1]["role"]:
            raise ValueError(f"{where}[{i}].role: {messages[i]['role']} follows {messages[i - 1]['role']}; turns must alternate")
    if last is not None and messages[-1]["role"] != last:
        raise ValueError(f"{where}[-1].role: must be {last}, got {messages[-1]['role']!r}")


def check_sft(rec: dict[str, Any], where: str) -> None:
    if set(rec) != {"task", "conversations"} or not isinstance(rec["task"], str) or not rec["task"]:
        raise ValueError(f"{where}: SFT records have exactly 'task' (non-empty) and 'conversations', got keys {sorted(rec)}")
    check_messages(rec["conversations"], where=f"{where}.conversations", last="Assistant")


def check_pair(rec: dict[str, Any], where: str) -> None:
    if set(rec) != {"task", "prompt", "chosen", "rejected"}:
        raise ValueError(f"{where}: pair records have exactly task/prompt/chosen/rejected, got keys {sorted(rec)}")
    check_messages(rec["prompt"], where=f"{where}.prompt", last="User")
    for k in ("chosen", "rejected"):
        if not isinstance(rec[k], str) or not rec[k].strip():
            raise ValueError(f"{where}.{k}: empty or not a string")
    if rec["chosen"].strip() == rec["rejected"].strip():
        raise ValueError(f"{where}: chosen equals rejected")


RULE_PARAMS: dict[str, tuple[str, ...]] = {
    "starts_with_emoji": (),
    "all_caps": (),
    "ends_with_punctuation": ("char",),
    "max_words": ("n",),
    "forbidden_char": ("char",),
    "no_commas": (),
}


def check_test(rec: dict[str, Any], where: str, tasks: tuple[str, ...]) -> None:
    keys = set(rec)
    if not {"task", "question", "reference"} <= keys or keys - {"task", "question", "reference", "rule"}:
        raise ValueError(f"{where}: test records have task/question/reference (+ rule), got keys {sorted(rec)}")
    if rec["task"] not in tasks:
        raise ValueError(f"{where}.task: {rec['task']!r} is not one of the 18 test tasks")
    check_messages(rec["question"], where=f"{where}.question", last="User")
    if not isinstance(rec["reference"], str) or not rec["reference"].strip():
        raise ValueError(f"{where}.reference: empty or not a string")
    if "rule" in rec:
        rule = rec["rule"]
        if not isinstance(rule, dict) or rule.get("type") not in RULE_PARAMS:
            raise ValueError(f"{where}.rule: expected {{'type': one of {sorted(RULE_PARAMS)}, ...}}, got {rule!r}")
        want = set(RULE_PARAMS[rule["type"]]) | {"type"}
        if set(rule) != want:
            raise ValueError(f"{where}.rule: {rule['type']} takes keys {sorted(want)}, got {sorted(rule)}")


_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.S)


def extract_json_text(text: str) -> str:
    """The JSON part of a model answer: strips code fences and prose around one object."""
    m = _FENCE.search(text)
    if m:
        text = m.group(1)
    start, end = text.find("{"), text.rfind("}")
    if start == -1 or end < start:
        return text
    return text[start : end + 1]
