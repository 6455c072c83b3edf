"""The record shapes rolemrc trains and evaluates on, and their validation.

Every reader yields ``(line, record)``; the functions here turn one raw record into a typed
example or raise :class:`RecordError` saying what is wrong. The caller adds the file and line.
Roles are normalised to lowercase (RoleMRC writes ``System``/``User``/``Assistant``).
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Any

from rolemrc.errors import UserError
from rolemrc.tasks import TASKS

ROLES = ("system", "user", "assistant")

Message = dict[str, str]


class RecordError(ValueError):
    """A single record is malformed; the message says which field and why."""


class DataError(ValueError, UserError):
    """Bad records in a data file; the message names file, line and problem for each."""


@dataclass
class Conversation:
    """An SFT example: messages with lowercase roles; loss goes on the assistant turns."""

    messages: list[Message]
    task: str | None = None
    origin: str = ""  # "file:line", for reports


@dataclass
class Pair:
    """A preference pair: ``prompt`` messages ending in a user (or system-only) turn."""

    prompt: list[Message]
    chosen: str
    rejected: str
    task: str | None = None
    origin: str = ""
    # how much the chosen response should outscore the rejected one (objective=reward: the
    # Bradley-Terry loss's per-pair margin, TRL's ``margin`` column); None: none given
    margin: float | None = None


@dataclass
class Unpaired:
    """An unpaired preference example (``objective=kto``, data kind ``unpaired``): a ``prompt``
    (messages ending in a user or system-only turn), one assistant ``completion`` and whether it
    is desirable (``label``)."""

    prompt: list[Message]
    completion: str
    label: bool
    task: str | None = None
    origin: str = ""


@dataclass
class TestItem:
    task: str
    question: list[Message]
    reference: str
    rule: dict[str, Any] | None = None
    origin: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class PromptItem:
    """An online-RL prompt (``objective=grpo``, data kind ``prompts``): the conversation up to the
    assistant's turn, and the fields its rewards may read (``task``, ``rule``, ``reference`` and any
    other field of the record, in ``extra``), handed to each reward as one list per field."""

    prompt: list[Message]
    task: str | None = None
    rule: Any = None  # a rule object ({"type": ...}) or a list of them; None: no rule
    reference: str | None = None  # a reference reply (the test item's, or the cut assistant turn)
    origin: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def columns(self) -> dict[str, Any]:
        """The reward columns of this prompt: ``task``, ``rule``, ``reference`` and ``extra``'s fields."""
        return {**self.extra, "task": self.task, "rule": self.rule, "reference": self.reference}


def _field(record: Any, name: str, expected: str | None = None) -> Any:
    """``record[name]``; a missing field names the fields there are, a null one says so (and, given
    ``expected``, what the field must hold)."""
    if not isinstance(record, dict):
        raise RecordError(f"record is a {type(record).__name__}, expected a JSON object")
    if name not in record:
        raise RecordError(f"missing field {name!r} (has: {', '.join(map(str, record)) or 'nothing'})")
    if record[name] is None:
        raise RecordError(f"field {name!r} is null" + (f"; it must be {expected}" if expected else ""))
    return record[name]


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise RecordError(f"field {name!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise RecordError(f"field {name!r} is empty")
    return value


def normalise_messages(raw: Any, name: str) -> list[Message]:
    """Check a message list's fields and roles; return it with lowercase roles.

    Turn order is checked by :func:`check_turn_order`.
    """
    if not isinstance(raw, list) or not raw:
        raise RecordError(f"field {name!r} must be a non-empty list of messages")
    messages: list[Message] = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise RecordError(f"{name}[{i}] must be an object with 'role' and 'content'")
        role = msg.get("role")
        if not isinstance(role, str) or role.lower() not in ROLES:
            raise RecordError(f"{name}[{i}].role: unknown role {role!r} (expected System, User or Assistant)")
        content = msg.get("content")
        if content is None:
            raise RecordError(f"{name}[{i}]: " + ("field 'content' is null" if "content" in msg
                                                   else "missing field 'content'"))
        messages.append({"role": role.lower(), "content": _text(content, f"{name}[{i}].content")})
    return messages


def check_turn_order(messages: list[Message], name: str, last: str | None) -> None:
    """System only first; then user and assistant strictly alternate (either may start).

    ``last`` requires the final message's role ("assistant" for SFT, "user" for prompts).
    """
    body = messages[1:] if messages[0]["role"] == "system" else messages
    for i, msg in enumerate(body):
        index = i + len(messages) - len(body)
        if msg["role"] == "system":
            raise RecordError(f"{name}[{index}]: a System message may only come first")
        if i and msg["role"] == body[i - 1]["role"]:
            raise RecordError(f"{name}[{index}]: two {msg['role']} turns in a row (turns must alternate)")
    if last is not None and body and body[-1]["role"] != last:
        raise RecordError(f"{name}: last message must be {last}, got {body[-1]['role']}")


def parse_conversation(record: Any) -> Conversation:
    """RoleMRC SFT shape ``{"conversations": [...]}``, or the common ``{"messages": [...]}``."""
    messages_only = isinstance(record, dict) and "messages" in record and "conversations" not in record
    key = "messages" if messages_only else "conversations"
    messages = normalise_messages(_field(record, key), key)
    check_turn_order(messages, key, last=None)
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordError(f"{key}: no Assistant turn, nothing to train on")
    task = record.get("task")
    return Conversation(messages=messages, task=task if isinstance(task, str) else None)


def parse_pair(record: Any) -> Pair:
    """RoleMRC pairs (``prompt`` messages + ``chosen``/``rejected`` strings) or
    UltraFeedback-style pairs (``chosen``/``rejected`` full message lists sharing a prefix)."""
    chosen_raw, rejected_raw = _field(record, "chosen"), _field(record, "rejected")
    if isinstance(chosen_raw, list) or isinstance(rejected_raw, list):
        chosen_msgs = normalise_messages(chosen_raw, "chosen")
        rejected_msgs = normalise_messages(rejected_raw, "rejected")
        for name, msgs in (("chosen", chosen_msgs), ("rejected", rejected_msgs)):
            if msgs[-1]["role"] != "assistant":
                raise RecordError(f"{name}: last message must be the assistant response")
        if chosen_msgs[:-1] != rejected_msgs[:-1]:
            raise RecordError("chosen and rejected conversations differ before the final response")
        prompt = chosen_msgs[:-1]
        if not prompt:
            raise RecordError("chosen: no prompt messages before the response")
        chosen, rejected = chosen_msgs[-1]["content"], rejected_msgs[-1]["content"]
    else:
        prompt = normalise_messages(_field(record, "prompt"), "prompt")
        chosen, rejected = _text(chosen_raw, "chosen"), _text(rejected_raw, "rejected")
    only_system = len(prompt) == 1 and prompt[0]["role"] == "system"
    check_turn_order(prompt, "prompt", last=None if only_system else "user")
    if chosen.strip() == rejected.strip():
        raise RecordError("chosen and rejected are identical")
    task = record.get("task")
    margin = record.get("margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                               or not math.isfinite(margin)):
        raise RecordError(f"field 'margin' must be a finite number (how much chosen should outscore rejected), "
                          f"got {margin!r}")
    return Pair(prompt=prompt, chosen=chosen, rejected=rejected, task=task if isinstance(task, str) else None,
                margin=None if margin is None else float(margin))


def parse_test_item(record: Any) -> TestItem:

    task = _text(_field(record, "task"), "task")
    if task not in TASKS:
        raise RecordError(f"task {task!r} is not one of the 18 RoleMRC test tasks")
    question = normalise_messages(_field(record, "question"), "question")
    check_turn_order(question, "question", last="user")
    reference = _text(_field(record, "reference"), "reference")
    rule = record.get("rule")
    if rule is not None and not (isinstance(rule, dict) and isinstance(rule.get("type"), str)):
        raise RecordError("field 'rule' must be an object with a string 'type'")
    extra = {k: v for k, v in record.items() if k not in {"task", "question", "reference", "rule"}}
    return TestItem(task=task, question=question, reference=reference, rule=rule, extra=extra)


def _rules(rule: Any) -> Any:
    """A rule object with a string ``type``, a non-empty list of them, or None."""
    items = [rule] if isinstance(rule, dict) else rule if isinstance(rule, list) and rule else None
    if rule is not None and (items is None or not all(isinstance(r, dict) and isinstance(r.get("type"), str)
                                                       for r in items)):
        raise RecordError("field 'rule' must be an object with a string 'type' (or a non-empty list of them)")
    return rule


def parse_prompt(record: Any) -> PromptItem:
    """A prompt to sample completions for, from three shapes:

    * RoleMRC's test items ``{"task", "question", "reference", "rule"?}``: the question (ending in a
      user turn) is the prompt;
    * ``{"prompt": [...messages], "rule"?, "reference"?, "task"?}`` (TRL's conversational prompt);
    * an SFT conversation (``conversations`` or ``messages``) cut before its last assistant turn,
      which becomes the ``reference``.
    """
    if not isinstance(record, dict):
        raise RecordError(f"record is a {type(record).__name__}, expected a JSON object")
    known = {"task", "rule", "reference"}
    if "question" in record:
        prompt = normalise_messages(_field(record, "question"), "question")
        check_turn_order(prompt, "question", last="user")
        known.add("question")
        reference = record.get("reference")
    elif "prompt" in record:
        prompt = normalise_messages(_field(record, "prompt"), "prompt")
        only_system = len(prompt) == 1 and prompt[0]["role"] == "system"
        check_turn_order(prompt, "prompt", last=None if only_system else "user")
        known.add("prompt")
        reference = record.get("reference")
    elif "conversations" in record or "messages" in record:
        key = "conversations" if "conversations" in record else "messages"
        messages = normalise_messages(_field(record, key), key)
        check_turn_order(messages, key, last="assistant")
        cut = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompt, reference = messages[:cut], messages[cut]["content"]
        if not prompt:
            raise RecordError(f"{key}: no prompt before the last assistant turn")
        if record.get("reference") is not None:
            raise RecordError(f"{key}: give either a conversation (its last assistant turn is the reference) "
                              "or a 'reference', not both")
        known.add(key)
    else:
        raise RecordError("a prompt record needs 'question' (RoleMRC test item), 'prompt' (messages) or "
                          f"'conversations'/'messages' (cut before the last assistant turn); has: "
                          f"{', '.join(map(str, record)) or 'nothing'}")
    if reference is not None:
        reference = _text(reference, "reference")
    task = record.get("task")
    if task is not None and not isinstance(task, str):
        raise RecordError(f"field 'task' must be a string, got {type(task).__name__}")
    turns = record.get("user_turns")  # the user's later turns (env=scripted replays them)
    if turns is not None and not (isinstance(turns, list) and all(isinstance(t, str) and t.strip() for t in turns)):
        raise RecordError(f"field 'user_turns' must be a list of non-empty strings (the user's later turns), "
                          f"got {_shown_value(turns)}")
    extra = {k: v for k, v in record.items() if k not in known}
    return PromptItem(prompt=prompt, task=task, rule=_rules(record.get("rule")), reference=reference, extra=extra)


DIALOGUE_FIELDS = ("user_turns", "reference_turns")  # what a dialogue seed adds to its prompt row


def parse_dialogue(record: Any) -> PromptItem:
    """A multi-turn dialogue as the seed of a conversation (a ``format: dialogue`` prompts source):
    RoleMRC's SFT shape ``{"conversations": [...], "task"?}`` (or ``messages``). The prompt is the
    dialogue up to its first user turn (the system message with the role profile, and an assistant
    opening first when the role speaks first); ``user_turns`` are its later user turns (the script
    ``env=scripted`` replays, the questions ``env=llm_user`` has in mind); ``reference_turns`` are its
    own assistant turns after the first user turn, the k-th answering the k-th user turn (the first
    is also ``reference``). Other fields of the record are kept as columns."""
    if not isinstance(record, dict):
        raise RecordError(f"record is a {type(record).__name__}, expected a JSON object")
    key = "conversations" if "conversations" in record or "messages" not in record else "messages"
    messages = normalise_messages(_field(record, key), key)
    check_turn_order(messages, key, last=None)
    first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first is None:
        raise RecordError(f"{key}: no User turn: a dialogue seed opens with the user's first turn")
    clash = [f for f in (*DIALOGUE_FIELDS, "reference") if f in record]
    if clash:
        raise RecordError(f"field {clash[0]!r}: a dialogue's turns come from {key!r}; remove the field, or read the "
                          "record without format: dialogue")
    later = messages[first + 1:]
    task = record.get("task")
    if task is not None and not isinstance(task, str):
        raise RecordError(f"field 'task' must be a string, got {type(task).__name__}")
    references = [m["content"] for m in later if m["role"] == "assistant"]
    extra = {k: v for k, v in record.items() if k not in (key, "task", "rule")}
    extra.update(user_turns=[m["content"] for m in later if m["role"] == "user"], reference_turns=references)
    return PromptItem(prompt=messages[:first + 1], task=task, rule=_rules(record.get("rule")),
                      reference=references[0] if references else None, extra=extra)


def _shown_value(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def parse_unpaired(record: Any) -> Unpaired:
    """TRL's unpaired preference records, conversational: ``{"prompt": [...messages], "completion":
    "text" or [{"role": "assistant", "content": "text"}], "label": true|false}``. A string prompt
    (TRL's standard, template-free form) is refused: rolemrc renders every prompt with the chat
    template, so it names the fix (a one-message list) rather than guess a role."""
    if not isinstance(record, dict):
        raise RecordError(f"record is a {type(record).__name__}, expected a JSON object")
    if "chosen" in record or "rejected" in record:
        raise RecordError("a preference pair (chosen/rejected), not an unpaired example: put pairs in data.pairs "
                          "(objective=kto splits them when data.unpaired is empty)")
    label = _field(record, "label", "true (desirable) or false (undesirable)")
    if not isinstance(label, bool):
        raise RecordError(f"field 'label' must be true (desirable) or false (undesirable), got "
                          f"{type(label).__name__} {label!r}")
    raw_prompt = _field(record, "prompt")
    if isinstance(raw_prompt, str):
        raise RecordError("field 'prompt' is a string: give it as messages, e.g. [{\"role\": \"user\", "
                          "\"content\": ...}] (rolemrc renders prompts with the chat template)")
    prompt = normalise_messages(raw_prompt, "prompt")
    only_system = len(prompt) == 1 and prompt[0]["role"] == "system"
    check_turn_order(prompt, "prompt", last=None if only_system else "user")
    raw = _field(record, "completion")
    if isinstance(raw, list):
        messages = normalise_messages(raw, "completion")
        if len(messages) != 1 or messages[0]["role"] != "assistant":
            raise RecordError(f"field 'completion' must be one assistant message, got "
                              f"{len(messages)} message(s) ({', '.join(m['role'] for m in messages)})")
        completion = messages[0]["content"]
    else:
        completion = _text(raw, "completion")
    task = record.get("task")
    return Unpaired(prompt=prompt, completion=completion, label=label, task=task if isinstance(task, str) else None)


PARSERS = {"sft": parse_conversation, "pairs": parse_pair, "test": parse_test_item, "prompts": parse_prompt,
           "unpaired": parse_unpaired}
