"""The environment contract: what a multi-turn rollout asks of the world the role-player talks to.

An environment opens a conversation from a data row (:meth:`Environment.reset`: an
:class:`Episode` holding the opening messages, a system prompt with the role and the user's first
turn) and the episode answers each of the role-player's replies (:meth:`Episode.step`: the user's
next message, or the end, with the reason and any per-turn reward information). It sees text only: the rollout
(:mod:`rolemrc.env.rollout`) holds the conversation as token ids and calls the engines."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rolemrc.data.schemas import Message


@dataclass(frozen=True)
class Step:
    """An environment's answer to one reply: ``user`` is the user's next message, or None when the
    conversation ends (``reason`` says why: ``script_end``, ``user_end``, ...; or the user failed:
    :data:`FAILED_ENDS`, with ``error``); ``info``: numbers
    about the reply just given (per-turn reward information, logged and handed to rewards)."""

    user: str | None
    reason: str = ""
    info: Mapping[str, float] = field(default_factory=dict)
    error: str = ""  # a failed step (``reason`` in FAILED_ENDS): what went wrong, for the logs

    @property
    def done(self) -> bool:
        return self.user is None

    @property
    def failed(self) -> bool:
        return self.reason in FAILED_ENDS


# The ends that are no end of the conversation but a failure of the user (an API fault after its
# retries, a spent request budget): the conversation is kept for the counts, never scored or
# trained on, and the failure is never a turn.
FAILED_ENDS = ("user_failed", "user_budget")


Call = tuple[Any, list[Message], str]  # (episode, messages, reply): one reply to answer


@runtime_checkable
class Episode(Protocol):
    """One conversation: ``opening``, its first messages (ending with the user's turn);
    ``step(messages, reply)``: the answer to ``reply`` given after ``messages`` (the conversation so
    far, without the reply); ``together``: None (the default: each reply answered on its own by
    ``step``), or the environment's function answering many calls at once (an API user's concurrent
    requests, a local model's batch), which :func:`step_all` calls once for all the open
    conversations that share it. Episodes subclass this class to take the default."""

    opening: list[Message]
    together: Callable[[Sequence[Call]], list[Step]] | None = None

    def step(self, messages: list[Message], reply: str) -> Step: ...


def step_all(calls: Sequence[Call]) -> list[Step]:
    """Each ``(episode, messages, reply)``'s :class:`Step`: the calls whose episodes share a
    ``together`` function are answered by one call of it, the others one by one (``step``)."""
    out: list[Step | None] = [None] * len(calls)
    groups: dict[Any, list[int]] = {}
    for k, (episode, messages, reply) in enumerate(calls):
        if episode.together is None:
            out[k] = episode.step(messages, reply)
        else:
            groups.setdefault(episode.together, []).append(k)
    for together, ks in groups.items():
        for k, step in zip(ks, together([calls[k] for k in ks]), strict=True):
            out[k] = step
    return out  # type: ignore[return-value]


def user_turns(episodes: Sequence[Episode], asked: Sequence[tuple[int, list[Message], str]],
               convs: Sequence[Any]) -> Iterator[tuple[Any, list[Message]]]:
    """The environment's :class:`Step` for each ``(i, messages before the reply, reply)`` (:func:`step_all`)
    recorded on ``convs[i]`` (``turn_info``; ``reason``, ``error`` when it ends); yields those going on
    with the user's turn."""
    steps = step_all([(episodes[i], before, reply) for i, before, reply in asked])
    for (i, _, _), step in zip(asked, steps, strict=True):
        conv = convs[i]
        conv.turn_info.append(dict(step.info))
        if step.user is None:
            conv.reason = step.reason or "user_end"
            conv.error = step.error
            continue
        yield conv, [{"role": "user", "content": step.user}]


@runtime_checkable
class Environment(Protocol):
    """``reset(row)``: the :class:`Episode` seeded by ``row`` (a prompts row: ``messages``, the prompt
    as the data holds it, and ``columns``, the record's other fields); ``close()``: free what it
    holds (clients, models)."""

    def reset(self, row: Mapping[str, Any]) -> Episode: ...

    def close(self) -> None: ...


class EnvError(ValueError):
    """A data row an environment cannot open or continue (named by the caller with its origin)."""
