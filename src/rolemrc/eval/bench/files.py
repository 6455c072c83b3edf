"""Reading benchmarks' released JSON files with errors that name the file, the line and the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rolemrc.data.schemas import DataError
from rolemrc.errors import InputNotFound

_WS = " \t\r\n"


def _text(path: Path, what: str) -> str:
    if not path.is_file():
        raise InputNotFound(f"{what} not found: {path}")
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start + 1}); re-save it as UTF-8") from None


def read_json(path: Path, what: str) -> Any:
    """The JSON document in ``path``; a DataError naming file:line where it does not parse."""
    try:
        return json.loads(_text(path, what))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: not JSON ({e.msg}, column {e.colno}); {what} is one JSON document") from None


def read_json_list(path: Path, what: str) -> list[tuple[int, Any]]:
    """The entries of the JSON array in ``path``, each with the line it starts on."""
    text = _text(path, what)
    dec = json.JSONDecoder()

    def skip(i: int) -> int:
        while i < len(text) and text[i] in _WS:
            i += 1
        return i

    def line(i: int) -> int:
        return text.count("\n", 0, i) + 1

    i = skip(0)
    if i >= len(text) or text[i] != "[":
        raise DataError(f"{path}:{line(i)}: expected a JSON list (the released {what} is one JSON array)")
    out: list[tuple[int, Any]] = []
    i = skip(i + 1)
    if i < len(text) and text[i] == "]":
        return out
    while True:
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: not JSON ({e.msg}, column {e.colno})") from None
        out.append((line(i), obj))
        i = skip(end)
        if i < len(text) and text[i] == ",":
            i = skip(i + 1)
            continue
        if i < len(text) and text[i] == "]":
            break
        raise DataError(f"{path}:{line(i)}: expected ',' or ']' after entry [{len(out) - 1}]")
    if skip(i + 1) < len(text):
        raise DataError(f"{path}:{line(skip(i + 1))}: text after the JSON list")
    return out


def field_of(row: Any, name: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``row[name]`` if it is a ``kind``; else a DataError naming ``where`` and the field."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if name not in row:
        raise DataError(f"{where}: field {name!r} is missing (has: {', '.join(map(str, row)) or 'nothing'})")
    value = row[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        raise DataError(f"{where}: field {name!r} must be {' or '.join(k.__name__ for k in kinds)}, "
                        f"got {type(value).__name__}")
    return value
