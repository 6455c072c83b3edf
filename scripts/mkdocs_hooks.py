"""MkDocs hook (mkdocs.yml: hooks): inline code breaks across lines only at its spaces. Each word
of an inline code span (a key, path, flag or identifier such as `--overwrite`, `roberta-large`,
`hydra.run.dir=<run>`) gets the class ``nowrap``, which docs/stylesheets/extra.css keeps on one
line: a browser would otherwise break it after a hyphen, before a ``<`` or ``[``, or, in a narrow
column, anywhere. A word over ``LONG`` characters (a test id, a globbed path) could not fit a line
anyway: it may break, preferably after a ``/``, ``::`` or ``,`` (``<wbr>``)."""

from __future__ import annotations

import re

LONG = 60
_CODE = re.compile(r"<code>([^<]+)</code>")  # inline code: fenced blocks hold highlighting spans
_SOFT = re.compile(r"(/|::|,)(?=[^/:,])")


def _word(word: str) -> str:
    if len(word) <= LONG:
        return f'<span class="nowrap">{word}</span>'
    return f'<span class="long">{_SOFT.sub(lambda m: m.group(1) + "<wbr>", word)}</span>'


def _mark(match: re.Match) -> str:
    parts = re.split(r"(\s+)", match.group(1))
    return "<code>" + "".join(p if not p or p.isspace() else _word(p) for p in parts) + "</code>"


def on_page_content(html: str, **kwargs) -> str:
    return _CODE.sub(_mark, html)
