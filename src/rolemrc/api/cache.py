"""Answers of an API (or local) model on disk: SQLite, one row per request key, valid answers only.

The key is :func:`request_key` of everything that shapes the answer (model, messages, sampling),
which the caller gives. Only answers that passed the caller's check are ever stored, and every read is
checked again (``valid``): an entry an older version stored (an empty reply, truncated JSON) or
one a changed parser now rejects is ignored and asked again, never served. Rows are committed one
by one, so a run killed at any moment keeps everything answered so far.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["AnswerCache", "request_key"]


def request_key(payload: Mapping[str, Any]) -> str:
    """The one request hash of every answer cache (judge, generation, synthesis): sha256 of the
    payload as JSON with sorted keys and no whitespace. The payload holds everything that shapes
    the answer (model, messages, sampling; the endpoint, a schema)."""
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class AnswerCache:
    """``get(key, valid)`` / ``put(key, text, model)`` over ``<path>`` (an SQLite file).

    The table layout (``answers(key, model, text, created)``) is the one the judge cache has
    always had, so existing ``judge_cache.sqlite`` files keep their valid answers.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, timeout=30.0)
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS answers (key TEXT PRIMARY KEY, model TEXT, text TEXT, created REAL)"
        )
        self._db.commit()
        self.invalid_seen = 0  # stored answers the check rejected (asked again, then replaced)

    def get(self, key: str, valid: Callable[[str], Any] | None = None) -> str | None:
        """The stored text, or None when absent or when ``valid(text)`` raises (not served)."""
        row = self._db.execute("SELECT text FROM answers WHERE key = ?", (key,)).fetchone()
        if row is None or row[0] is None:
            return None
        text = row[0]
        if valid is not None:
            try:
                valid(text)
            except Exception:
                self.invalid_seen += 1
                return None
        return text

    def put(self, key: str, text: str, model: str = "") -> None:
        """Store a checked answer (callers check before storing; a failure is never stored)."""
        self._db.execute(
            "INSERT OR REPLACE INTO answers (key, model, text, created) VALUES (?, ?, ?, ?)",
            (key, model, text, time.time()),
        )
        self._db.commit()

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM answers").fetchone()[0])

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> "AnswerCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
