"""Filling the short data strings of the synthesis assets (seed scripts, rule phrasings, prompt
blocks). A leaf module: :mod:`rolemrc.synth.rules` and :mod:`rolemrc.synth.dialogues` use it."""

from __future__ import annotations

import re
import string
from typing import Any

_BLANKS = re.compile(r"\n\s*\n(\s*\n)+")


def tidy(text: str) -> str:
    """Collapse the blank lines that empty optional blocks leave behind."""
    return _BLANKS.sub("\n\n", text).strip()


def fill(text: str, where: str, **values: Any) -> str:
    """Substitute $-placeholders in a short data string (seed script, rule phrasing)."""
    try:
        return string.Template(text).substitute(values)
    except (KeyError, ValueError) as e:
        raise ValueError(f"{where}: cannot fill {text!r}: {e!r} (provided: {', '.join(sorted(values)) or 'nothing'})") from None
