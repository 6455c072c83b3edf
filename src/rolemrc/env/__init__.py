"""Multi-turn environments: the world a role-player talks to over a whole conversation.

- ``base.py``: the contract (:class:`Environment`: ``reset(row)`` -> an :class:`Episode`, whose
  ``opening`` messages start the conversation and whose ``step(messages, reply)`` gives the user's
  next message or the end, as a :class:`Step`).
- ``scripted.py``: ``env=scripted``, the user replays the row's ``user_turns`` (deterministic).
- ``user.py``: ``env=llm_user``, a language model plays the user with a persona and a goal (an
  OpenAI-compatible server or a local transformers model).
- ``rollout.py``: :func:`roll`, conversations on any engine held as one token sequence each with a
  mask of the role-player's tokens (:class:`Conversation`), and :func:`summary`.
- ``converse.py``: :func:`converse`, the same conversations held as text, for a role-player that
  answers chat messages (a served model): :class:`Dialogue`, same episodes and end reasons.

Environments are registered by name in :data:`ENVS` (``env.name``; ``none``: no environment, one
reply per prompt); each class's ``build(env_cfg, **kwargs)`` takes what it needs of ``kwargs``.
"""

from __future__ import annotations

from typing import Any

from rolemrc.env.base import FAILED_ENDS, EnvError, Environment, Episode, Step, step_all
from rolemrc.env.converse import Dialogue, Fault, Reply, converse
from rolemrc.env.rollout import Conversation, roll, summary, text_after_reply
from rolemrc.env.scripted import ScriptedEnv
from rolemrc.env.user import LLMUserEnv
from rolemrc.registry import Registry

__all__ = ["ENVS", "FAILED_ENDS", "Conversation", "Dialogue", "EnvError", "Environment", "Episode", "Fault",
           "LLMUserEnv", "Reply", "ScriptedEnv", "Step", "converse", "make_env", "roll", "step_all", "summary",
           "text_after_reply"]

ENVS: Registry[Any] = Registry("env.name", doc="multi-turn environments (conf/env): who answers the role-player")
ENVS.register("scripted", ScriptedEnv, doc="the user replays the row's user_turns (deterministic)")
ENVS.register("llm_user", LLMUserEnv, doc="a language model plays the user with a persona and a goal")


def make_env(env: Any, **kwargs: Any) -> Environment:
    """The environment ``env.name`` names (``env``: the ``env:`` config group, typed)."""
    return ENVS.get(env.name, where="env.name", hint=" (or none)").build(env, **kwargs)
