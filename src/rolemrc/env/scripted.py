"""``env=scripted``: the user replays a dialogue's own later user turns, in order, whatever the
role-player says; the conversation ends after the last one (``script_end``). Deterministic: the
tests, the CPU demo, and RL on RoleMRC's multi-turn dialogues without an API.

The script is the row's ``user_turns`` field (a list of strings: the user's 2nd, 3rd, ... turns;
the first is the last message of the prompt)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rolemrc.data.schemas import Message
from rolemrc.env.base import EnvError, Episode, Step

SCRIPT_FIELD = "user_turns"


def script_of(row: Mapping[str, Any]) -> list[str]:
    """The later user turns of ``row`` (its ``user_turns`` column); [] when it has none."""
    turns = (row.get("columns") or {}).get(SCRIPT_FIELD)
    if turns is None:
        return []
    if not isinstance(turns, list) or not all(isinstance(t, str) and t.strip() for t in turns):
        raise EnvError(f"field {SCRIPT_FIELD!r} must be a list of non-empty strings (the user's later turns)")
    return list(turns)


@dataclass
class ScriptedEpisode(Episode):
    """The row's script, said one turn per reply (``together``: None, nothing to batch)."""

    opening: list[Message]
    script: list[str]
    said: int = 0

    def step(self, messages: list[Message], reply: str) -> Step:
        if self.said >= len(self.script):
            return Step(None, "script_end")
        self.said += 1
        return Step(self.script[self.said - 1])


class ScriptedEnv:
    """The user says the row's ``user_turns`` one after another (see the module docstring)."""

    @classmethod
    def build(cls, env: Any, **kwargs: Any) -> "ScriptedEnv":
        return cls()

    def reset(self, row: Mapping[str, Any]) -> ScriptedEpisode:
        messages = [dict(m) for m in row["messages"]]
        if not messages or messages[-1]["role"] != "user":
            raise EnvError("a scripted conversation opens with the user's turn: the prompt must end with a user message")
        return ScriptedEpisode(messages, script_of(row))

    def close(self) -> None:
        pass
