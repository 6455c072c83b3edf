"""Reward callables named by dotted path in the tests (``_target_: tests.rewards.helpers...``)."""

from __future__ import annotations

from typing import Any

from rolemrc.rewards import completion_texts


def length_reward(*, prompts: Any, completions: list[Any], scale: float = 1.0, **columns: Any) -> list[float | None]:
    """``scale`` x words of the completion; None for an empty completion (not applicable)."""
    return [scale * len(c.split()) if c.strip() else None for c in completion_texts(completions)]


def seen_columns(*, prompts: Any, completions: list[str], **columns: Any) -> list[float]:
    """Records what it was called with (for the signature test)."""
    seen_columns.calls.append({"prompts": prompts, "completions": completions, **columns})
    return [0.0] * len(completions)


seen_columns.calls = []  # type: ignore[attr-defined]


def bad_reward(*, prompts: Any, completions: list[Any], returns: str = "infinite", **columns: Any) -> Any:
    """A broken reward: ``returns`` = ``infinite`` (+inf for every completion), ``short`` (no values),
    ``text`` (a string per completion)."""
    return {"infinite": [float("inf")] * len(completions), "short": [],
            "text": ["high"] * len(completions)}[returns]
