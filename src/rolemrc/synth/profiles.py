"""Profiles stage: the generator expands each persona into a validated seven-section profile."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Any, Optional

from pydantic import BaseModel, ValidationError

from rolemrc.api import Rejected
from rolemrc.synth.assets import Assets
from rolemrc.synth.client import ChatRequest
from rolemrc.synth.records import (
    SECTION_TITLES,
    Profile,
    extract_json_text,
    wire_schema,
)


def parse(model: type[BaseModel], text: str) -> tuple[Optional[Any], str, str]:
    """(object, "", "") or (None, reason, detail); reason is "json" or "schema"."""
    if not text.strip():
        return None, "empty", "the server returned no content"
    try:
        data = json.loads(extract_json_text(text))
    except json.JSONDecodeError as e:
        return None, "json", f"{e.msg} at char {e.pos}"
    try:
        return model.model_validate(data), "", ""
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "<root>"
        return None, "schema", f"{loc}: {first['msg']} ({e.error_count()} error(s))"


def parser(model: type[BaseModel]) -> Callable[[str], Any]:
    """A request's ``check``: the parsed object, or :class:`Rejected` (the client asks again)."""

    def check(text: str) -> Any:
        obj, reason, detail = parse(model, text)
        if obj is None:
            raise Rejected(reason, detail)
        return obj

    return check


def _short_sections(prof: Profile, min_chars: int) -> list[str]:
    return [k for k in SECTION_TITLES if k != "speech_examples" and len(getattr(prof, k)) < min_chars]


def check_profile(text: str, min_chars: int) -> Profile:
    """The profile request's ``check``: parses, and every section has ``min_chars`` characters."""
    prof = parser(Profile)(text)
    short = _short_sections(prof, min_chars)
    if short:
        raise Rejected("schema", f"sections shorter than {min_chars} characters: {', '.join(short)}")
    return prof


def example_profile(assets: Assets) -> Profile:
    """The one-shot example, validated so a broken edit fails before any request."""
    ex = assets.example
    try:
        return Profile.model_validate(ex["profile"])
    except ValidationError as e:
        raise ValueError(f"{assets.path('profile_example.yaml')}: 'profile' does not match the profile schema: {e}") from None


def request(assets: Assets, persona: dict[str, Any], min_chars: int = 0) -> ChatRequest:
    ex = assets.example
    shot = example_profile(assets).model_dump()
    p = assets.prompts
    messages = [
        {"role": "system", "content": p["profile_system"].strip()},
        {"role": "user", "content": assets.render("prompts", "profile_user", persona=ex["persona"])},
        {"role": "assistant", "content": json.dumps(shot, ensure_ascii=False)},
        {"role": "user", "content": assets.render("prompts", "profile_user", persona=persona["persona"])},
    ]
    return ChatRequest(
        kind="profile", tag=persona["id"], messages=messages, schema_name="role_profile",
        schema=wire_schema(Profile), placeholder=json.dumps(shot, ensure_ascii=False),
        check=partial(check_profile, min_chars=min_chars),
    )


def finish(persona: dict[str, Any], text: str, min_chars: int) -> tuple[Optional[dict[str, Any]], Optional[dict[str, Any]]]:
    """(profile record, None) or (None, invalid record with reason)."""
    prof, reason, detail = parse(Profile, text)
    if prof is not None:
        short = _short_sections(prof, min_chars)
        if short:
            prof, reason, detail = None, "schema", f"sections shorter than {min_chars} characters: {', '.join(short)}"
    if prof is None:
        return None, {"id": persona["id"], "persona": persona["persona"], "reason": reason, "detail": detail, "raw": text[:4000]}
    return {"id": persona["id"], "persona": persona["persona"], "profile": prof.model_dump()}, None
