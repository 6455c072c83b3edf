"""``env=llm_user``: a language model plays the user, with a persona and a goal.

The user's persona and goal are the row's ``user_persona`` / ``user_goal`` fields, else
``env.user.persona`` / ``env.user.goal``; the row's ``user_turns`` (when it has them) are shown
as the questions the user had in mind. Each user turn is one request: a system message and a
user message made from two templates (``env.user.template``, a YAML file with ``system`` and
``prompt``; rolemrc's own in ``rolemrc/assets/env/user.yaml``), checked when the environment is
built, before anything is sent (:func:`load_templates`, :data:`TEMPLATE_FIELDS`). The answer is
the user's next message; an answer holding ``env.user.end_marker`` ends the conversation
(``user_end``).

Backends (:data:`USER_BACKENDS`): ``openai`` (any OpenAI-compatible server through
:class:`rolemrc.api.ApiClient`: concurrency, retries with backoff on faults and empty answers,
the request budget ``env.user.max_requests``, the key from the variable ``env.user.api_key_env``)
and ``hf`` (a local transformers model sampled through :class:`rolemrc.rollout.hf.HFEngine`).
Answers are cached (:class:`rolemrc.api.AnswerCache`, ``<cache_dir>/user_cache.sqlite``) by a hash
of the model, the prompt and the sampling settings, so a rerun asks nothing already answered.

A request that still fails after its retries ends its conversation as failed (``user_failed``;
``user_budget`` when the budget is spent): no user turn is added, and the callers count the
conversation and leave it out of every score (:attr:`rolemrc.env.Conversation.failed`)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolemrc import asset
from rolemrc.api import AnswerCache, ApiClient, Budget, api_key, request_key
from rolemrc.config import UserConfig, as_schema
from rolemrc.data.schemas import Message
from rolemrc.data.templates import ChatFormat, TemplateRenderError
from rolemrc.env.base import Call, EnvError, Episode, Step
from rolemrc.env.scripted import script_of
from rolemrc.errors import ConfigError, ModelSourceError
from rolemrc.fileio import read_mapping, template_fields
from rolemrc.registry import Registry
from rolemrc.rollout.engine import Sampling
from rolemrc.rollout.hf import HFEngine, pad_id_of, stop_token_ids

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = "env/user.yaml"  # rolemrc.asset name
CACHE_FILE = "user_cache.sqlite"
PERSONA_FIELD, GOAL_FIELD = "user_persona", "user_goal"
TEMPLATE_KEYS = ("system", "prompt")
TEMPLATE_FIELDS: dict[str, str] = {
    "persona": "who the user is (the row's user_persona, else env.user.persona)",
    "goal": "what the user wants (the row's user_goal, else env.user.goal)",
    "character": "the role-player's system message (its role profile); '(not described)' when it has none",
    "transcript": "the conversation so far, one 'USER (you): ...' or 'CHARACTER: ...' line per turn",
    "script": "the row's later user turns as a list of questions the user had in mind (empty when none)",
    "end_marker": "env.user.end_marker: writing it ends the conversation",
    "turn": "the number of the user message being written (2 for the second)",
}
REQUIRED = {"prompt": "transcript"}
SCRIPT_BLOCK = "\nThe questions you had in mind, in order (a guide, not lines to read out):\n{items}\n"


def load_templates(path: str | None, where: str = "env.user.template") -> dict[str, str]:
    """``{"system": ..., "prompt": ...}`` from ``path`` (None: rolemrc's own), checked: a YAML
    mapping of those two keys to non-empty strings, placeholders only from
    :data:`TEMPLATE_FIELDS`, ``{transcript}`` in ``prompt``. A fault is a ConfigError naming the
    file and the key."""
    p, raw = read_mapping(path or asset(DEFAULT_TEMPLATE), where, f"a mapping with the keys {', '.join(TEMPLATE_KEYS)}",
                          f"a YAML mapping with the templates {' and '.join(TEMPLATE_KEYS)}")
    unknown = sorted(str(k) for k in raw if k not in TEMPLATE_KEYS)
    missing = [k for k in TEMPLATE_KEYS if k not in raw]
    if unknown or missing:
        raise ConfigError(f"{where}={p}: " + "; ".join(
            ([f"unknown key(s) {', '.join(unknown)}"] if unknown else [])
            + ([f"missing key(s) {', '.join(missing)}"] if missing else [])) + f" (keys: {', '.join(TEMPLATE_KEYS)})")
    out: dict[str, str] = {}
    for key in TEMPLATE_KEYS:
        text = raw[key]
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{where}={p}: {key}: the template must be a non-empty string")
        names = template_fields(text, f"{where}={p}: {key}", TEMPLATE_FIELDS)
        need = REQUIRED.get(key)
        if need and need not in names:
            raise ConfigError(f"{where}={p}: {key}: the template never shows {{{need}}}")
        out[key] = text
    return out


def transcript(messages: Sequence[Message]) -> str:
    """The conversation as the user model reads it (the system message left out: ``{character}``)."""
    label = {"user": "USER (you)", "assistant": "CHARACTER"}
    return "\n".join(f"{label[m['role']]}: {m['content']}" for m in messages if m["role"] in label)


def _text_field(row: Mapping[str, Any], name: str, default: str) -> str:
    value = (row.get("columns") or {}).get(name)
    if value is None:
        return default
    if not isinstance(value, str) or not value.strip():
        raise EnvError(f"field {name!r} must be a non-empty string")
    return value


@dataclass
class Answer:
    """One user turn's request, answered: ``text`` (ok), or the failure's ``reason`` and ``error``."""

    text: str | None
    reason: str = ""
    error: str = ""


# ---------------------------------------------------------------- backends


class OpenAIUser:
    """The user behind an OpenAI-compatible chat-completions server (:class:`rolemrc.api.ApiClient`);
    one client and one event loop for the environment's life (the budget is the run's)."""

    def __init__(self, cfg: UserConfig, seed: int = 0) -> None:
        if not cfg.model:
            raise ConfigError("env.user.backend=openai needs env.user.model (the served model's name)")
        api_key(cfg.api_key_env, f"env.user (env.user.api_key_env={cfg.api_key_env})")  # now: before any rollout
        self.cfg = cfg
        self.model_id = cfg.model
        self.counts: Counter[str] = Counter()
        self._loop = asyncio.new_event_loop()
        self._client: ApiClient | None = None

    def sampling(self) -> dict[str, Any]:
        return {"temperature": self.cfg.temperature, "top_p": self.cfg.top_p, "max_tokens": self.cfg.max_tokens}

    async def _answer(self, prompts: Sequence[list[Message]]) -> list[Answer]:
        c = self.cfg
        if self._client is None:  # made inside the loop that uses it
            self._client = ApiClient(
                "env.user", base_url=c.base_url, api_key_env=c.api_key_env, concurrency=c.concurrency,
                timeout_s=c.timeout_s, max_attempts=c.max_attempts, backoff_s=c.backoff_s,
                max_backoff_s=c.max_backoff_s, budget=Budget(c.max_requests, names=("env.user.max_requests", "")),
                counts=self.counts)

        async def one(i: int, messages: list[Message]) -> Answer:
            body = {"model": c.model, "messages": messages, **self.sampling()}
            out = await self._client.chat(body, tag=f"user turn {i}")  # type: ignore[union-attr]
            if out.ok:
                return Answer(out.text)
            return Answer(None, "user_budget" if out.status == "budget_exhausted" else "user_failed", out.error or "")

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    def answer_all(self, prompts: Sequence[list[Message]]) -> list[Answer]:
        return self._loop.run_until_complete(self._answer(prompts))

    def close(self) -> None:
        if self._client is not None:
            self._loop.run_until_complete(self._client.close())
            self._client = None
        self._loop.close()


class HFUser:
    """The user as a local transformers model (``env.user.model``: a folder or hub id), its prompts
    rendered with its own chat template and sampled in one batch per turn through
    :class:`rolemrc.rollout.hf.HFEngine` (seeded per call from ``seed``: the same run asks the same)."""

    def __init__(self, cfg: UserConfig, seed: int = 0) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not cfg.model:
            raise ConfigError("env.user.backend=hf needs env.user.model (a local folder or hub id of a chat model)")
        self.cfg = cfg
        self.model_id = cfg.model
        self.counts: Counter[str] = Counter()
        try:
            tok = AutoTokenizer.from_pretrained(cfg.model)
            model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=cfg.dtype)
        except OSError as e:
            raise ModelSourceError(f"env.user.model={cfg.model}: cannot be loaded as a causal LM "
                                   f"({str(e).splitlines()[0]})") from None
        model.to(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")).eval()
        if not getattr(tok, "chat_template", None):
            raise ConfigError(f"env.user.model={cfg.model}: its tokenizer has no chat template; the simulated user "
                              "needs a chat model")
        self.chat = ChatFormat(tok)
        try:  # the user's prompts are a system and a user message: the template must take both
            self.chat.render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], True)
        except TemplateRenderError as e:
            raise ConfigError(f"env.user.model={cfg.model}: its chat template cannot render a system and a user "
                              f"message ({e})") from None
        self.engine = HFEngine(stop_ids=stop_token_ids(tok, self.chat.eot), pad_id=pad_id_of(tok),
                               sampling=Sampling(cfg.max_tokens, cfg.temperature > 0, cfg.temperature or 1.0, cfg.top_p))
        self.engine.sync(model, 0)
        self.seed, self.calls = int(seed), 0

    def sampling(self) -> dict[str, Any]:
        return {"temperature": self.cfg.temperature, "top_p": self.cfg.top_p, "max_tokens": self.cfg.max_tokens,
                "backend": "hf"}

    def answer_all(self, prompts: Sequence[list[Message]]) -> list[Answer]:
        self.calls += 1
        ids = self.chat.encode_prompts([list(p) for p in prompts])
        rows = self.engine.generate(ids, 1, [self.seed + self.calls])
        stops = set(self.engine.stop_ids)
        out = []
        for row in rows:
            text = self.chat.tokenizer.decode([t for t in row if t not in stops], skip_special_tokens=True)
            if text.strip():
                self.counts["answered"] += 1
                out.append(Answer(text))
            else:  # sampled again it would be another answer, but a local failure is final
                self.counts["failed"] += 1
                out.append(Answer(None, "user_failed", "empty_content: the user model's answer is empty"))
        return out

    def close(self) -> None:
        self.engine.close()


USER_BACKENDS: Registry[Any] = Registry("env.user.backend", error=ConfigError, doc="who plays the simulated user")
USER_BACKENDS.register("openai", OpenAIUser, doc="any OpenAI-compatible endpoint (rolemrc.api)")
USER_BACKENDS.register("hf", HFUser, doc="a local transformers model (rolemrc.rollout.hf.HFEngine)")


# ---------------------------------------------------------------- the environment


@dataclass
class UserEpisode(Episode):
    """One conversation with the simulated user; ``together``: its environment's batch step."""

    opening: list[Message]
    persona: str
    goal: str
    script: list[str]
    env: "LLMUserEnv" = field(repr=False)

    @property
    def together(self) -> Callable[[Sequence[Call]], list[Step]]:  # type: ignore[override]
        return self.env.step_many

    def step(self, messages: list[Message], reply: str) -> Step:
        return self.env.step_many([(self, messages, reply)])[0]


class LLMUserEnv:
    """The simulated user (see the module docstring). ``cache_dir``: where answers are cached when
    ``env.user.cache_dir`` is null (None: no cache); ``seed``: a local model's sampling seed."""

    @classmethod
    def build(cls, env: Any, *, cache_dir: str | Path | None = None, seed: int = 0, **kwargs: Any) -> "LLMUserEnv":
        return cls(env.user, cache_dir=cache_dir, seed=seed)

    def __init__(self, cfg: Any, *, cache_dir: str | Path | None = None, seed: int = 0) -> None:
        cfg = as_schema(cfg, UserConfig)
        if not cfg.end_marker.strip():
            raise ConfigError("env.user.end_marker must not be empty (the text by which the user ends a conversation)")
        if cfg.max_tokens < 1:
            raise ConfigError(f"env.user.max_tokens={cfg.max_tokens} must be >= 1")
        self.cfg = cfg
        self.templates = load_templates(cfg.template)  # checked before anything is sent
        self.backend = USER_BACKENDS.get(cfg.backend, where="env.user.backend")(cfg, seed)
        where = cfg.cache_dir or cache_dir
        self.cache = AnswerCache(Path(where) / CACHE_FILE) if where else None
        self.counts = self.backend.counts  # requests, faults by kind, failures; cached answers as "cached"

    def reset(self, row: Mapping[str, Any]) -> UserEpisode:
        messages = [dict(m) for m in row["messages"]]
        if not messages or messages[-1]["role"] != "user":
            raise EnvError("a conversation with a simulated user opens with the user's turn: "
                           "the prompt must end with a user message")
        return UserEpisode(messages, _text_field(row, PERSONA_FIELD, self.cfg.persona),
                           _text_field(row, GOAL_FIELD, self.cfg.goal), script_of(row), self)

    def prompt(self, episode: UserEpisode, messages: list[Message], reply: str) -> list[Message]:
        """The user model's request after ``reply`` (the system and user messages of the templates)."""
        conversation = [*messages, {"role": "assistant", "content": reply}]
        system = next((m["content"] for m in conversation if m["role"] == "system"), "(not described)")
        script = "\n".join(f"- {t}" for t in episode.script)
        values = {
            "persona": episode.persona, "goal": episode.goal, "character": system,
            "transcript": transcript(conversation), "script": SCRIPT_BLOCK.format(items=script) if script else "",
            "end_marker": self.cfg.end_marker, "turn": sum(m["role"] == "user" for m in conversation) + 1,
        }
        return [{"role": "system", "content": self.templates["system"].format(**values)},
                {"role": "user", "content": self.templates["prompt"].format(**values)}]

    def step_many(self, calls: Sequence[Call]) -> list[Step]:
        """The user's answers to many conversations' replies: cached ones served, the rest asked together."""
        prompts = [self.prompt(e, m, r) for e, m, r in calls]
        keys = [request_key({"model": self.backend.model_id, "messages": p, "sampling": self.backend.sampling(),
                             "endpoint": self.cfg.base_url if self.cfg.backend == "openai" else None})
                for p in prompts]
        answers: list[Answer | None] = [None] * len(prompts)
        if self.cache is not None:
            for k, key in enumerate(keys):
                text = self.cache.get(key, _usable)
                if text is not None:
                    answers[k] = Answer(text)
                    self.counts["cached"] += 1
        todo = [k for k, a in enumerate(answers) if a is None]
        if todo:
            for k, answer in zip(todo, self.backend.answer_all([prompts[k] for k in todo]), strict=True):
                answers[k] = answer
                if answer.text is not None and self.cache is not None:
                    self.cache.put(keys[k], answer.text, self.backend.model_id)
        return [self._step(a) for a in answers]  # type: ignore[arg-type]

    def _step(self, answer: Answer) -> Step:
        if answer.text is None:
            log.warning("simulated user failed (%s): %s", answer.reason, answer.error)
            return Step(None, answer.reason, error=answer.error)
        if self.cfg.end_marker in answer.text:
            return Step(None, "user_end")
        return Step(answer.text.strip())

    def close(self) -> None:
        self.backend.close()
        if self.cache is not None:
            self.cache.close()


def _usable(text: str) -> None:
    if not text.strip():
        raise ValueError("empty answer")
