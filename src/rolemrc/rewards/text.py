"""Completions as text, whichever form the caller gives them in."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def completion_text(completion: Any, index: int) -> str:
    """A completion's text: a string as is, or TRL's conversational form (a list of messages, the
    reply being the last ``{"role": "assistant", "content": ...}``)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], Mapping):
        content = completion[-1].get("content")
        if isinstance(content, str):
            return content
    raise TypeError(f"completion {index}: expected a string or a list of messages ending in one with string "
                    f"content, got {type(completion).__name__}")


def completion_texts(completions: Sequence[Any]) -> list[str]:
    return [completion_text(c, i) for i, c in enumerate(completions)]
