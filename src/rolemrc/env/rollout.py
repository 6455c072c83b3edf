"""The multi-turn rollout: conversations between the role-player (a generate function over token
ids: any engine of :mod:`rolemrc.rollout`) and an environment's episodes, each held as ONE token
sequence with a mask of the role-player's own sampled tokens.

Per turn, every open conversation's running ids are continued once; the reply's sampled ids are
appended as they were sampled (mask 1: the only tokens trained); the environment answers the
decoded reply; the chat template's text between the reply's end-of-turn and the next generation
prompt (the user's turn, headers: mask 0) is tokenised on its own and appended. So each turn's
prompt is exactly the sequence so far (nothing is re-tokenised between turns), and the whole
sequence equals the template's tokenisation of the final conversation
(:meth:`~rolemrc.data.templates.ChatFormat.encode_conversation`, up to the last end-of-turn) when
every reply was sampled as the template tokenises its text; replies sampled otherwise are counted
(``noncanonical``), not rewritten: the loss trains on what was sampled, as TRL's ``env_mask``.

A conversation ends (``reason``) when the environment ends it (its reason: ``script_end``,
``user_end``, ...; ``user_failed`` / ``user_budget`` when the user could not answer:
:attr:`Conversation.failed`, counted and never scored), at the turn cap (``turn_cap``: ``max_turns`` replies), at the length cap
(``length_cap``: ``max_tokens`` tokens in all, the reply cut there or the user's turn not added),
when a reply has no stop token within the engine's ``max_new_tokens`` (``truncated``), or when a
reply stops at a stop token other than the template's end of turn (``stop``: eos)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rolemrc.data.schemas import Message
from rolemrc.data.templates import ChatFormat, TemplateRenderError
from rolemrc.env.base import FAILED_ENDS, Episode, user_turns

ENV_ENDS = ("turn_cap", "length_cap", "truncated", "stop")  # the rollout's own reasons (others: the environment's)
CUT = ("length_cap", "truncated")  # the last reply did not end on its own


@dataclass
class Conversation:
    """One rollout: ``ids`` (the opening prompt, ``prompt_len`` tokens ending with the generation
    prompt, then every later token), ``model_mask`` (1 on the role-player's sampled tokens),
    ``replies`` (each reply's ``[start, end)`` in ``ids``), ``messages`` (the conversation as text),
    ``turn_info`` (the environment's numbers for each reply), ``reason`` (why it ended; "" while open),
    ``noncanonical`` (replies whose sampled ids are not the template's tokenisation of their text)."""

    messages: list[Message]
    ids: list[int]
    prompt_len: int
    model_mask: list[int] = field(default_factory=list)
    replies: list[tuple[int, int]] = field(default_factory=list)
    turn_info: list[dict[str, float]] = field(default_factory=list)
    reason: str = ""
    noncanonical: int = 0
    error: str = ""  # a failed conversation (``failed``): what went wrong

    @property
    def failed(self) -> bool:
        """The user failed (``reason`` in :data:`~rolemrc.env.base.FAILED_ENDS`: an API fault after
        its retries, a spent budget): count it, never score or train on it."""
        return self.reason in FAILED_ENDS

    def __post_init__(self) -> None:
        if not self.model_mask:
            self.model_mask = [0] * len(self.ids)

    @property
    def turns(self) -> int:
        return len(self.replies)

    @property
    def cut(self) -> bool:
        """The last reply was cut (no stop token in ``max_new_tokens``, or the length cap)."""
        return self.reason in CUT

    @property
    def completion(self) -> tuple[list[int], list[int]]:
        """Everything after the opening prompt and its role-player mask (GRPO's completion and ``env_mask``)."""
        return self.ids[self.prompt_len:], self.model_mask[self.prompt_len:]

    def reply_texts(self) -> list[str]:
        return [m["content"] for m in self.messages if m["role"] == "assistant"][-self.turns:] if self.turns else []


def text_after_reply(chat: ChatFormat, messages: list[Message], new: list[Message]) -> str:
    """The template's text from the end of ``messages``' last assistant turn (its end-of-turn marker
    included) to the end of the generation prompt after ``new`` (the user's next turn)."""
    text, spans = chat.assistant_spans(messages)
    end = spans[-1][1]
    following = chat.render(messages + new, add_generation_prompt=True)
    if not following.startswith(text[:end]):
        raise TemplateRenderError(f"chat template is not prefix-consistent after message {len(messages) - 1}: "
                                  "a conversation's next turn does not extend its rendering")
    return following[end:]


def roll(episodes: Sequence[Episode], chat: ChatFormat, generate: Callable[[list[list[int]]], list[list[int]]], *,
         stop_ids: Sequence[int], max_turns: int, max_tokens: int | None = None,
         opening_ids: Sequence[Sequence[int]] | None = None) -> list[Conversation]:
    """Run ``episodes`` to their ends (see the module docstring). ``generate(prompts)``: one
    continuation per prompt (token ids), cut after its first stop token (``stop_ids``) or
    ``max_new_tokens`` long; ``opening_ids``: the opening prompts already tokenised (the data's
    prompt rows), else the template's generation prompt of each episode's ``opening``."""
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    tok = chat.tokenizer
    eot = chat.tokenize(chat.eot)
    eot_id = eot[0] if len(eot) == 1 else None
    stops = set(int(s) for s in stop_ids)
    if opening_ids is None:
        opening_ids = chat.encode_prompts([list(e.opening) for e in episodes])
    convs = [Conversation([dict(m) for m in e.opening], list(ids), len(ids)) for e, ids in zip(episodes, opening_ids,
                                                                                                 strict=True)]
    for turn in range(max_turns):
        active = [i for i, c in enumerate(convs) if not c.reason]
        if not active:
            break
        outs = generate([convs[i].ids for i in active])
        asked: list[tuple[int, list[Message], str]] = []
        for i, out in zip(active, outs, strict=True):
            c, out = convs[i], list(out)
            cut = max_tokens is not None and len(c.ids) + len(out) > max_tokens
            if cut:
                out = out[:max(0, max_tokens - len(c.ids))]
            stopped = bool(out) and out[-1] in stops and not cut
            start = len(c.ids)
            c.ids += out
            c.model_mask += [1] * len(out)
            c.replies.append((start, len(c.ids)))
            reply = tok.decode(out[:-1] if stopped else out, skip_special_tokens=True)
            before = c.messages
            c.messages = before + [{"role": "assistant", "content": reply}]
            c.reason = "length_cap" if cut else "truncated" if not stopped else "stop" if out[-1] != eot_id else ""
            if not c.reason and chat.encode_response(before, reply) != out:
                c.noncanonical += 1
            if not c.reason and turn == max_turns - 1:
                c.reason = "turn_cap"
            if c.reason:
                c.turn_info.append({})
            else:
                asked.append((i, before, reply))
        for c, new in user_turns(episodes, asked, convs):
            piece = chat.tokenize(text_after_reply(chat, c.messages, new))
            if max_tokens is not None and len(c.ids) + len(piece) >= max_tokens:
                c.reason = "length_cap"  # no room for the user's turn and a reply
                continue
            c.ids += piece
            c.model_mask += [0] * len(piece)
            c.messages = c.messages + new
    return convs


def summary(convs: Sequence[Conversation]) -> dict[str, Any]:
    """Counts a run reports about its conversations: turns (mean, max), why they ended, the
    replies sampled otherwise than the template tokenises them, and the failed conversations."""
    n = max(len(convs), 1)
    ends: dict[str, int] = {}
    for c in convs:
        ends[c.reason] = ends.get(c.reason, 0) + 1
    return {"turns_mean": sum(c.turns for c in convs) / n, "turns_max": max((c.turns for c in convs), default=0),
            "ends": dict(sorted(ends.items())), "noncanonical_replies": sum(c.noncanonical for c in convs),
            "failed": sum(c.failed for c in convs)}
