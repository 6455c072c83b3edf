"""Stage folders: JSON Lines I/O, atomic writes and the done-marker that makes stages resumable.

A stage's outputs become visible only through renames after the stage finished, and its marker
(``_stage.json``, with a fingerprint of the inputs and config that produced it) is written last.
A killed stage therefore leaves no marker and is redone; its finished requests come from the cache.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from rolemrc.fileio import atomic_open, atomic_write_json

MARKER = "_stage.json"


def fingerprint(*parts: Any) -> str:
    blob = json.dumps(parts, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> int:
    """Write atomically (temp file + rename); returns the number of lines."""
    n = 0
    with atomic_open(path) as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            n += 1
    return n


def read_jsonl_lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, record); a malformed line raises ValueError naming file and line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            yield lineno, rec


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Yield records; a malformed line raises ValueError naming file and line."""
    for _, rec in read_jsonl_lines(path):
        yield rec


class StageDir:
    """``<out_dir>/<stage>/`` with its marker."""

    def __init__(self, root: Path, name: str) -> None:
        self.name = name
        self.path = Path(root) / name

    def done(self, fp: str) -> bool:
        """Finished with this fingerprint and no record missing (a stage that lacks records is
        redone by the next run, which asks only for what is not cached)."""
        m = self.marker()
        return m is not None and m.get("fingerprint") == fp and not m.get("stats", {}).get("missing")

    def marker(self) -> dict[str, Any] | None:
        p = self.path / MARKER
        if not p.exists():
            return None
        with open(p, encoding="utf-8") as f:
            return json.load(f)

    def start(self) -> None:
        """Invalidate a previous result before rewriting it."""
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / MARKER).unlink(missing_ok=True)

    def finish(self, fp: str, stats: dict[str, Any]) -> None:
        atomic_write_json(self.path / MARKER, {"fingerprint": fp, "stats": stats}, indent=1)

    def require(self) -> dict[str, Any]:
        m = self.marker()
        if m is None:
            raise RuntimeError(f"stage {self.name!r} has no finished output in {self.path}; run it first (add it to stages=[...])")
        return m

    def file(self, name: str) -> Path:
        return self.path / name
