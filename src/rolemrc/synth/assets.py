"""Data files that carry everything the paper leaves open: wording, seed scripts, rule pool.

Files live in the packaged ``rolemrc/assets/synth/``; a file of the same name in
``assets_dir`` (config) replaces it, so a user can copy and edit only what they change.
"""

from __future__ import annotations

import hashlib
import string
from functools import cached_property
from pathlib import Path
from typing import Any, Optional

import yaml

from rolemrc.synth.rules import parse_pool

PACKAGED = Path(__file__).resolve().parent.parent / "assets" / "synth"

# file -> keys it must define (checked on load, so a broken copy fails before any request).
REQUIRED: dict[str, tuple[str, ...]] = {
    "prompts.yaml": ("profile_system", "profile_user", "free_chat", "mrc_dialogue", "reply", "two_turn", "role_opens", "user_opens", "narration_on", "narration_off", "rule_line", "system"),
    "templates.yaml": ("role_system", "narration_on", "narration_off", "passages", "passage_item", "rule", "directive"),
    "seeds.yaml": ("no_answer", "no_answer_again", "refusal", "attempt", "attempt_requests", "press_again", "press_attempt"),
    "directives.yaml": ("directives", "refusals"),
    "rules.yaml": ("rules",),
    "profile_example.yaml": ("persona", "profile"),
    "paper_table2.yaml": ("groups", "totals"),
}
# Files only RoleLLM's stages read (rolemrc.synth.roleplay): checked the same way, hashed by those
# stages' own fingerprints rather than by Assets.fingerprint.
ROLEPLAY: dict[str, tuple[str, ...]] = {
    "roleplay_prompts.yaml": ("context_instruct_system", "context_instruct_user", "rolegpt_system"),
}


class Assets:
    def __init__(self, override_dir: Optional[str] = None) -> None:
        self.override = Path(override_dir) if override_dir else None
        if self.override is not None and not self.override.is_dir():
            raise FileNotFoundError(f"assets_dir {self.override} is not a directory")

    def path(self, name: str) -> Path:
        if self.override is not None and (self.override / name).exists():
            return self.override / name
        p = PACKAGED / name
        if not p.exists():
            raise FileNotFoundError(f"synthesis asset {name} not found in {self.override or '-'} nor {PACKAGED}")
        return p

    def load(self, name: str) -> dict[str, Any]:
        p = self.path(name)
        with open(p, encoding="utf-8") as f:
            try:
                data = yaml.safe_load(f)
            except yaml.YAMLError as e:
                raise ValueError(f"{p}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{p}: expected a mapping at the top level")
        required = REQUIRED.get(name) or ROLEPLAY.get(name, ())
        missing = [k for k in required if k not in data]
        if missing:
            raise ValueError(f"{p}: missing key(s) {', '.join(missing)}")
        for k in required:
            v = data[k]
            if v is None or (isinstance(v, (list, str, dict)) and not v):
                raise ValueError(f"{p}: key {k!r} is empty")
        return data

    @cached_property
    def prompts(self) -> dict[str, Any]:
        return self.load("prompts.yaml")

    @cached_property
    def templates(self) -> dict[str, Any]:
        return self.load("templates.yaml")

    @cached_property
    def seeds(self) -> dict[str, Any]:
        return self.load("seeds.yaml")

    @cached_property
    def directives(self) -> dict[str, Any]:
        return self.load("directives.yaml")

    @cached_property
    def rules(self) -> list[dict[str, Any]]:
        return parse_pool(self.load("rules.yaml")["rules"], str(self.path("rules.yaml")))

    @cached_property
    def example(self) -> dict[str, Any]:
        return self.load("profile_example.yaml")

    @cached_property
    def paper(self) -> dict[str, Any]:
        return self.load("paper_table2.yaml")

    def fingerprint(self) -> str:
        """Hash of every asset's content: editing wording invalidates the stages that use it."""
        h = hashlib.sha256()
        for name in sorted(REQUIRED):
            h.update(name.encode())
            h.update(self.path(name).read_bytes())
        return h.hexdigest()[:16]

    def render(self, file: str, key: str, **values: Any) -> str:
        """Fill template ``key`` of ``file`` ('prompts', 'templates' or a file of :data:`ROLEPLAY`);
        missing values raise."""
        name = file if file in ROLEPLAY else f"{file}.yaml"
        table = self.prompts if file == "prompts" else self.templates if file == "templates" else self.load(name)
        try:
            return string.Template(str(table[key])).substitute(values)
        except KeyError as e:
            raise KeyError(f"{self.path(name)}: template {key!r} uses ${e.args[0]}, which is not provided (provided: {', '.join(sorted(values))})") from None
        except ValueError as e:
            raise ValueError(f"{self.path(name)}: template {key!r}: {e} (write $$ for a literal $)") from None
