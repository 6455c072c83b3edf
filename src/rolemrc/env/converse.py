"""Conversations held as text: :func:`converse` runs episodes to their ends with a role-player that
answers chat messages (a served model behind an OpenAI-compatible API), where :func:`roll` holds
token ids for a local engine. The same episode contract and the same end reasons:

- the environment's own (``script_end``, ``user_end``, ...), when its step ends the conversation;
- ``turn_cap``: ``max_turns`` replies given;
- ``truncated``: the reply stopped at the length limit (the API's ``finish_reason`` ``length``);
- ``length_cap``: the conversation reached ``max_tokens`` tokens, as the server counts them
  (its ``usage``: prompt plus reply); a server that reports no usage is never cut here.

``stop`` (a reply ending with eos rather than the end-of-turn token) does not exist over an API,
which reports one kind of stop. A reply that could not be obtained (the server's faults after
its retries, the request budget spent) is no turn: its conversation stops, unfinished
(``Dialogue.error`` says why, ``reason`` stays ""), and is never scored; so is one whose user
failed (``user_failed`` / ``user_budget``, as in :func:`roll`): :attr:`Dialogue.failed`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rolemrc.data.schemas import Message
from rolemrc.env.base import FAILED_ENDS, Episode, user_turns


@dataclass
class Reply:
    """The role-player's answer to one conversation: ``text``; ``cut``: it stopped at the length
    limit; ``tokens``: the conversation's length in tokens with it (None: not known)."""

    text: str
    cut: bool = False
    tokens: int | None = None


@dataclass
class Fault:
    """No reply: ``error`` says why (the conversation stops unfinished)."""

    error: str


@dataclass
class Dialogue:
    """One conversation as text: ``messages`` (the opening's ``opening`` messages first, then each
    reply and user turn), ``turn_info`` (the environment's numbers for each reply), ``reason`` (why it
    ended; "" while open or unfinished), ``error`` (why it is unfinished)."""

    messages: list[Message]
    opening: int
    turn_info: list[dict[str, float]] = field(default_factory=list)
    reason: str = ""
    error: str = ""

    @property
    def turns(self) -> int:
        return sum(m["role"] == "assistant" for m in self.messages[self.opening:])

    @property
    def failed(self) -> bool:
        """No end of the conversation: the role-player's reply (``error``, no ``reason``) or the user
        (``reason`` in :data:`~rolemrc.env.base.FAILED_ENDS`) could not be obtained."""
        return bool(self.error) and not self.reason or self.reason in FAILED_ENDS

    @property
    def finished(self) -> bool:
        return bool(self.reason) and not self.failed


def converse(episodes: Sequence[Episode], reply: Callable[[list[list[Message]]], list[Reply | Fault]], *,
             max_turns: int, max_tokens: int | None = None) -> list[Dialogue]:
    """Run ``episodes`` to their ends (see the module docstring): per turn, ``reply(conversations)``
    answers every open conversation at once (a :class:`Reply`, or a :class:`Fault`)."""
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    dialogues = [Dialogue([dict(m) for m in e.opening], len(e.opening)) for e in episodes]
    for turn in range(max_turns):
        active = [i for i, d in enumerate(dialogues) if not d.reason and not d.error]
        if not active:
            break
        answers = reply([list(dialogues[i].messages) for i in active])
        asked: list[tuple[int, list[Message], str]] = []
        if len(answers) != len(active):
            raise ValueError(f"reply() answered {len(answers)} of {len(active)} conversations")
        for i, ans in zip(active, answers, strict=True):
            d = dialogues[i]
            if isinstance(ans, Fault):
                d.error = ans.error or "no reply"
                continue
            before = d.messages
            d.messages = before + [{"role": "assistant", "content": ans.text}]
            if ans.cut:
                d.reason = "truncated"
            elif max_tokens is not None and ans.tokens is not None and ans.tokens >= max_tokens:
                d.reason = "length_cap"
            elif turn == max_turns - 1:
                d.reason = "turn_cap"
            if d.reason:
                d.turn_info.append({})
                continue
            asked.append((i, before, ans.text))
        for d, new in user_turns(episodes, asked, dialogues):
            d.messages = d.messages + new
    return dialogues
