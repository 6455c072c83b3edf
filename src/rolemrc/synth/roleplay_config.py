"""Config of the RoleLLM synthesis stages (:mod:`rolemrc.synth.roleplay`): Context-Instruct and
RoleGPT. Part of :class:`rolemrc.synth.config.SynthConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class ContextInstructConfig:
    # Role profiles with their long text: JSON/JSONL records {name, description, catchphrases,
    # dialogue, script | script_file} (script_file relative to this file).
    roles: Optional[str] = None
    segment_chars: int = 4000  # a segment is at most this many characters, cut at paragraph ends
    max_segments: Optional[int] = None  # per role; None: the whole script
    per_segment: int = 5  # question-answer-confidence triples asked per segment
    min_confidence: int = 7  # triples kept: confidence >= this, on the 1-10 scale asked for


@dataclass
class RoleGPTConfig:
    roles: Optional[str] = None  # as context_instruct.roles (no script needed)
    questions: Optional[str] = None  # general instructions: JSONL/JSON {question} or a .txt, one per line
    per_role: Optional[int] = None  # instructions answered per role; None: all
    few_shot: int = 3  # profile dialogue exchanges given as earlier turns (dialogue mode)
