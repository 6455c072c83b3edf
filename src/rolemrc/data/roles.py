"""RoCIT system instructions: a role profile rendered through one configurable template.

RoleLLM's role-conditioned instruction tuning (RoCIT) puts the role into the system
instruction: who the role is (name and description), how it talks (catchphrases) and, where
there are some, a few lines of its dialogue. The same rendering is used for training rows
(``format: rolebench`` SFT sources) and for evaluation prompts (RoleBench, CharacterLLM), so a
model is asked in the shape it was trained on.

Profiles are read from files (``roles.profiles``):

- a JSON object ``{role name: description}`` (RoleBench's ``profiles-eng/desc.json`` and
  ``profiles-zh/desc.json``), or
- JSON/JSONL profile records ``{"name", "description", "catchphrases": [str],
  "dialogue": [{"user": str, "assistant": str}]}`` (``catchphrases`` and ``dialogue`` optional),
  one per line (JSONL) or as a list (JSON). Several files merge; later ones add fields.

The template is a ``str.format`` string with the fields ``{name}``, ``{description}``,
``{catchphrases}`` and ``{dialogue}``; the last two are blocks rendered from
:data:`CATCHPHRASES_BLOCK` / :data:`DIALOGUE_BLOCK` and empty when the profile has none, and
runs of blank lines left by empty blocks are collapsed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolemrc.data.schemas import (
    Conversation, Message, PromptItem, RecordError, TestItem, check_turn_order, normalise_messages,
)
from rolemrc.config import plain
from rolemrc.errors import ConfigError, InputNotFound

# Our own wording of RoleLLM's structure: identity + description, speaking style and
# catchphrases, optional example dialogue, then the instruction to stay in character.
DEFAULT_TEMPLATE = (
    "You are {name}. {description}\n"
    "{catchphrases}\n"
    "{dialogue}\n"
    "Stay in character as {name} in everything you say: answer each question the way {name} "
    "would, with {name}'s knowledge, manner and way of speaking. Keep replies natural and not "
    "overly formal, and never say that you are an AI or a language model."
)
CATCHPHRASES_BLOCK = "Phrases {name} is known for: {phrases}."
DIALOGUE_BLOCK = "Some lines {name} has spoken before:\n{turns}"
DIALOGUE_TURN = "Q: {user}\n{name}: {assistant}"
FIELDS = ("name", "description", "catchphrases", "dialogue")


@dataclass
class RoleProfile:
    name: str
    description: str = ""
    catchphrases: list[str] = field(default_factory=list)
    dialogue: list[tuple[str, str]] = field(default_factory=list)


def check_template(template: str, where: str = "roles.template") -> str:
    """The template if it formats with the known fields only; else a ConfigError naming the field."""
    try:
        template.format(name="n", description="d", catchphrases="c", dialogue="x")
    except KeyError as e:
        raise ConfigError(f"{where}: unknown field {{{e.args[0]}}} (known: {', '.join(FIELDS)})") from None
    except (IndexError, ValueError) as e:
        raise ConfigError(f"{where}: not a valid format string ({e})") from None
    if "{name}" not in template:
        raise ConfigError(f"{where}: the template must contain {{name}}")
    return template


def render_system(profile: RoleProfile, template: str | None = None, few_shot: int = 2) -> str:
    """The RoCIT system instruction for ``profile``."""
    name = profile.name
    phrases = ", ".join(f'"{p}"' for p in profile.catchphrases)
    turns = "\n".join(DIALOGUE_TURN.format(user=u, assistant=a, name=name) for u, a in profile.dialogue[:few_shot])
    text = (template or DEFAULT_TEMPLATE).format(
        name=name,
        description=profile.description.strip(),
        catchphrases=CATCHPHRASES_BLOCK.format(name=name, phrases=phrases) if phrases else "",
        dialogue=DIALOGUE_BLOCK.format(name=name, turns=turns) if turns else "",
    )
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{2,}", "\n", text).strip()


# ---------------------------------------------------------------- profile files


def _profile_record(raw: Any, where: str) -> RoleProfile:
    if not isinstance(raw, dict):
        raise RecordError(f"{where}: a profile must be a JSON object")
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip():
        raise RecordError(f"{where}: field 'name' must be a non-empty string")
    desc = raw.get("description", "")
    if not isinstance(desc, str):
        raise RecordError(f"{where}: field 'description' must be a string")
    phrases = raw.get("catchphrases") or []
    if not (isinstance(phrases, list) and all(isinstance(p, str) and p.strip() for p in phrases)):
        raise RecordError(f"{where}: field 'catchphrases' must be a list of non-empty strings")
    dialogue = []
    for i, turn in enumerate(raw.get("dialogue") or []):
        if not (isinstance(turn, dict) and isinstance(turn.get("user"), str) and isinstance(turn.get("assistant"), str)):
            raise RecordError(f"{where}: dialogue[{i}] must be {{\"user\": str, \"assistant\": str}}")
        dialogue.append((turn["user"], turn["assistant"]))
    return RoleProfile(name.strip(), desc, list(phrases), dialogue)


def load_profiles(paths: list[str] | tuple[str, ...]) -> dict[str, RoleProfile]:
    """``{name: profile}`` from profile files (see the module docstring); bad entries are
    errors naming ``file:line``."""
    out: dict[str, RoleProfile] = {}
    for p in paths:
        path = Path(str(p)).expanduser()
        if not path.is_file():
            raise InputNotFound(f"roles.profiles: profile file not found: {path}")
        records: list[tuple[int, Any]] = []
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".jsonl":
            for i, line in enumerate(text.splitlines(), start=1):
                if line.strip():
                    try:
                        records.append((i, json.loads(line)))
                    except json.JSONDecodeError as e:
                        raise RecordError(f"{path}:{i}: invalid JSON: {e.msg}") from None
        else:
            try:
                doc = json.loads(text)
            except json.JSONDecodeError as e:
                raise RecordError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
            if isinstance(doc, dict) and all(isinstance(v, str) for v in doc.values()):
                # RoleBench's desc.json: {role name: description}
                for name, desc in doc.items():
                    prof = out.setdefault(name, RoleProfile(name))
                    prof.description = desc
                continue
            records = list(enumerate(doc if isinstance(doc, list) else [doc], start=1))
        for i, raw in records:
            prof = _profile_record(raw, f"{path}:{i}")
            old = out.get(prof.name)
            if old is not None:  # merge: later files add what earlier ones lack
                prof.description = prof.description or old.description
                prof.catchphrases = prof.catchphrases or old.catchphrases
                prof.dialogue = prof.dialogue or old.dialogue
            out[prof.name] = prof
    return out


class RoleSystem:
    """Renders the system instruction of a role by name, from a ``roles`` config
    (:class:`rolemrc.config_suites.RolesConfig` fields: profiles, template, few_shot, strict)."""

    def __init__(self, roles: Any = None, extra_profiles: list[str] | None = None) -> None:
        r = dict(plain(roles) or {})
        self.template = check_template(r["template"]) if r.get("template") else DEFAULT_TEMPLATE
        self.few_shot = int(r.get("few_shot", 2))
        self.strict = bool(r.get("strict", True))
        files = list(extra_profiles or []) + list(r.get("profiles") or [])
        self.profiles = load_profiles(files)
        self.files = files
        self._cache: dict[str, str] = {}

    def __call__(self, name: str) -> str:
        if name not in self._cache:
            prof = self.profiles.get(name)
            if prof is None:
                if self.strict and self.files:
                    raise RecordError(f"role {name!r} has no profile in {', '.join(map(str, self.files))}")
                prof = RoleProfile(name)
            self._cache[name] = render_system(prof, self.template, self.few_shot)
        return self._cache[name]

    def describe(self) -> dict[str, Any]:
        return {"template": self.template, "few_shot": self.few_shot, "profiles": [str(f) for f in self.files]}


# ---------------------------------------------------------------- RoleBench rows


def rolebench_row(record: Any, system: Callable[[str], str]) -> tuple[list[Message], list[str], str]:
    """A RoleBench row ``{"role", "question", "generated": [answers]}`` (the public release's
    field names) as ``(system + user messages, reference answers, role)``; a row already in the
    conversation shape passes through (its system turn kept as it is)."""
    if not isinstance(record, dict):
        raise RecordError(f"record is a {type(record).__name__}, expected a JSON object")
    if "conversations" in record or "messages" in record:
        messages = normalise_messages(record.get("conversations") or record.get("messages"), "conversations")
        if messages[-1]["role"] != "assistant" or len(messages) < 2:
            raise RecordError("conversations: the last message must be the assistant's reference answer")
        return messages[:-1], [messages[-1]["content"]], str(record.get("role") or "")
    missing = [k for k in ("role", "question", "generated") if k not in record]
    if missing:
        raise RecordError(f"RoleBench row lacks {missing} (has: {', '.join(map(str, record))})")
    refs = record["generated"] if isinstance(record["generated"], list) else [record["generated"]]
    refs = [r for r in refs if isinstance(r, str) and r.strip()]
    role, question = record["role"], record["question"]
    if not refs or not all(isinstance(x, str) and x.strip() for x in (role, question)):
        raise RecordError("RoleBench row has an empty role, question or answer")
    return [{"role": "system", "content": system(role)}, {"role": "user", "content": question}], refs, role


def rolebench_parser(kind: str, roles: Any = None) -> Callable[[Any], Any]:
    """The record parser of a ``format: rolebench`` source of ``kind`` ("sft", "test" or "prompts"),
    rendering system instructions with the source's ``roles`` (RoCIT)."""
    system = RoleSystem(roles)
    if kind == "sft":
        def parse_sft(record: Any) -> Conversation:
            prompt, refs, _ = rolebench_row(record, system)
            messages = prompt + [{"role": "assistant", "content": refs[0]}]
            check_turn_order(messages, "conversations", last="assistant")
            return Conversation(messages=messages, task="rolebench")

        return parse_sft
    if kind == "test":
        def parse_test(record: Any) -> TestItem:
            prompt, refs, role = rolebench_row(record, system)
            extra: dict[str, Any] = {"references": refs}
            if role:
                extra["rolebench_role"] = role
            return TestItem("rolebench", prompt, refs[0], extra=extra)

        return parse_test
    if kind == "prompts":  # a conversation seed: the RoCIT system message and the question
        def parse_prompt(record: Any) -> PromptItem:
            prompt, refs, role = rolebench_row(record, system)
            extra: dict[str, Any] = {"references": refs}
            if role:
                extra["rolebench_role"] = role
            return PromptItem(prompt, task="rolebench", reference=refs[0], extra=extra)

        return parse_prompt
    raise ValueError(f"format 'rolebench' is not readable as {kind} data")
